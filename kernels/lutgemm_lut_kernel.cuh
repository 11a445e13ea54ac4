// The LUT kernel of LUT-GEMM (LUT-GEMM §3.1-3.2 and appendix B; nuQmm §III.B-C): y = x·wᵀ for 1..8
// columns of x straight from the BCQ sign planes, one shared-memory table lookup per 8 weights.
//
// The LUT (μ = 8): for each 8-column sub-vector of x a table T[key] = Σ_t (2·bit_t(key) − 1)·x_t over
// the 256 keys, so one shared-memory read replaces 8 multiply-adds; a word of a plane is 4 keys.
//
// Work split: a "unit" is a tile of 1024 rows × one chunk of NT sub-vectors (NT = 8..32); a unit is
// q planes of NH pipeline steps each, then (with an offset) the offset plane: one step where the chunk's z fit in a
// stage (kOffsetSteps), else NH.
//
//   columns ─────────────────────────────────────────────►  (chunk = NT·8 columns = NT/4 words)
//   rows  ┌──────────┬──────────┬──────────┬─────┐
//    │    │ unit 0   │ unit 1   │ unit 2   │ ... │  row tile 0 (1024 rows)
//    │    ├──────────┼──────────┼──────────┼─────┤
//    ▼    │ ...      │          │          │     │  row tile 1
//         └──────────┴──────────┴──────────┴─────┘
//
//   tile  (1024 rows)  → block: steps are numbered row tile by row tile, unit by unit; block b of B runs
//                        the contiguous range [b·S/B, (b+1)·S/B) of all S steps ("stream-K"), so blocks
//                        differ by at most one step of work whatever the shape (B = SMs × resident
//                        blocks, one wave). Per unit the block builds the chunk's NT tables (32 KB).
//   warp  (128 rows)   → 8 warps per block, warp w takes rows 128w..128w+127 of the tile;
//   thread (4 rows)    → lane l takes 4 consecutive rows 4l..4l+3 of its warp's 128: one 16-byte load
//                        gives the same word of its 4 rows.
//
// When its range leaves a row tile, a block adds its fp32 partial sums to the workspace (complete_tile in
// lutgemm_common.cuh finishes the tile). Loads run S - 1 steps ahead of the compute: each lane copies its
// words and scales into its own slots of a ring of S stages in shared memory (cp.async), so no registers
// hold loads in flight.
//
// Bank conflicts, and what we do about them (beyond the paper): with every lane of a warp reading
// the same table at data-dependent keys, a 256-entry fp32 table spread over 32 banks gives ~3.5-way
// conflicts on average. Instead the NT tables of a chunk are interleaved, entry (key, t) at byte
// key·128 + t·E (E = entry bytes, NT·E = 128), so table t always sits in the same bank group, and
// in one instruction lane l reads table
//     t = 4·((j + φ) mod NW) + (m + ψ) mod 4,    φ = (l mod NT) / 4,  ψ = l mod 4,
// i.e. lanes start at different words (j rotated by φ) and bytes (m rotated by ψ) of their rows.
// The NT lanes of one shared-memory phase (32 lanes for 4-byte, 16 for 8-byte, 8 for 16-byte
// reads) then hit NT distinct tables = distinct banks: every table read is conflict-free.
// The global loads stay full 32-byte sectors (4 lanes × 4 rows × 4 bytes of one word).
//
// Batch (columns of x, 1..8 per launch, padded to BP ∈ {1, 2, 4, 8}): an entry holds the BP
// values of a key: fp32 for BP = 1 (free: a 4-byte read costs the same); fp16 for BP ≥ 2, halving
// shared-memory traffic, which bounds LUT-GEMM at larger batch (the paper's stated limitation).
// The 4 lookups of one word are summed in fp16, then scaled by α in fp32 and accumulated in fp32 (compact α:
// scaled by α_0, and a step's sum by 2^i).
// Table construction is exact fp32 (Gray-code order: each entry is the previous one ± 2·x_t),
// rounded once to the entry type.
#pragma once

#include "lutgemm_common.cuh"

namespace lutgemm {

// Compile-time shape of the LUT for a padded batch BP.
template <int BP>
struct Cfg {
  static_assert(BP == 1 || BP == 2 || BP == 4 || BP == 8, "BP must be 1, 2, 4 or 8");
  static constexpr int kEntryBytes = BP == 1 ? 4 : 2 * BP;    // E: fp32 for BP = 1, else BP × fp16
  static constexpr int kTables = 128 / kEntryBytes;            // NT: 32, 32, 16, 8 = lanes of one smem phase
  static constexpr int kWords = kTables / 4;                   // NW: words per chunk
  static constexpr int kChunkCols = 32 * kWords;               // 256, 256, 128, 64
  static constexpr int kStepWords = kWords < LUT_STEP_WORDS ? kWords : LUT_STEP_WORDS;  // SW: words per step
  static constexpr int kSteps = kWords / kStepWords;           // NH: steps per (chunk, plane)
  // steps of the offset plane per chunk: one where a stage's word slots (16 bytes a word) hold the chunk's z
  // (8 bytes a word)
  static constexpr bool kOffsetOneStep = LUT_OFFSET_ONE_STEP && kWords == 2 * kStepWords;
  static constexpr int kOffsetSteps = kOffsetOneStep ? 1 : kSteps;
  static constexpr int kPieces = kEntryBytes / 4;              // builder lanes per entry (4 bytes each)
  static constexpr int kStages = LUT_STAGES;                   // S: ring stages, S - 1 steps in flight
  static constexpr int kStageBytes = kStepWords * kThreads * (16 + 8);  // words + α of one step, all lanes
  // dynamic shared memory: LUT, ring, and slack to start the ring on a 128-byte boundary
  static constexpr int kSmemBytes = kLutBytes + kStages * kStageBytes + 128;
};

// ---- table entries -------------------------------------------------------------------------------

// BP values of one key: fp32 (BP = 1) or BP/2 packed half2.
template <int BP>
struct Entry {
  static constexpr int kWords = BP == 1 ? 1 : BP / 2;
  uint32_t v[kWords];
};

template <int BP>
__device__ __forceinline__ Entry<BP> load_entry(const unsigned char* p) {
  Entry<BP> e;
  if constexpr (Entry<BP>::kWords == 1) {
    e.v[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (Entry<BP>::kWords == 2) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    e.v[0] = t.x;
    e.v[1] = t.y;
  } else {
    const uint4 t = *reinterpret_cast<const uint4*>(p);
    e.v[0] = t.x;
    e.v[1] = t.y;
    e.v[2] = t.z;
    e.v[3] = t.w;
  }
  return e;
}

__device__ __forceinline__ float bits_to_float(uint32_t b) {
  float f;
#ifdef LUTGEMM_HOST_EMU
  std::memcpy(&f, &b, 4);
#else
  f = __uint_as_float(b);
#endif
  return f;
}

__device__ __forceinline__ uint32_t float_to_bits(float f) {
  uint32_t b;
#ifdef LUTGEMM_HOST_EMU
  std::memcpy(&b, &f, 4);
#else
  b = __float_as_uint(f);
#endif
  return b;
}

__device__ __forceinline__ uint32_t hadd2_bits(uint32_t a, uint32_t b) {
  __half2 ha, hb;
#ifdef LUTGEMM_HOST_EMU
  std::memcpy(&ha, &a, 4);
  std::memcpy(&hb, &b, 4);
  const __half2 s = __hadd2(ha, hb);
  uint32_t r;
  std::memcpy(&r, &s, 4);
  return r;
#else
  ha = *reinterpret_cast<__half2*>(&a);
  hb = *reinterpret_cast<__half2*>(&b);
  const __half2 s = __hadd2(ha, hb);
  return *reinterpret_cast<const uint32_t*>(&s);
#endif
}

// s += e (fp32 for BP = 1, else fp16 pairs)
template <int BP>
__device__ __forceinline__ void entry_add(Entry<BP>& s, const Entry<BP>& e) {
  if constexpr (BP == 1) {
    s.v[0] = float_to_bits(bits_to_float(s.v[0]) + bits_to_float(e.v[0]));
  } else {
#pragma unroll
    for (int h = 0; h < Entry<BP>::kWords; ++h) s.v[h] = hadd2_bits(s.v[h], e.v[h]);
  }
}

// acc[b] += a · s[b] in fp32
template <int BP>
__device__ __forceinline__ void entry_fma(float (&acc)[BP], float a, const Entry<BP>& s) {
  if constexpr (BP == 1) {
    acc[0] = fmaf(a, bits_to_float(s.v[0]), acc[0]);
  } else {
#pragma unroll
    for (int h = 0; h < BP / 2; ++h) {
      const float2 f = half2_bits_to_float2(s.v[h]);
      acc[2 * h] = fmaf(a, f.x, acc[2 * h]);
      acc[2 * h + 1] = fmaf(a, f.y, acc[2 * h + 1]);
    }
  }
}

// ---- pipeline steps through the shared-memory ring -------------------------------------------------

// Position in the block's sequence of steps: unit (row tile rt, chunk c), plane i (i == q is the
// offset plane), step h within the plane.
struct Cursor {
  int rt, c, i, h;
};

template <int BP>
__device__ __forceinline__ void advance(Cursor& cur, int q, int planes, int n_ch) {
  if (++cur.h < (cur.i < q ? Cfg<BP>::kSteps : Cfg<BP>::kOffsetSteps)) return;
  cur.h = 0;
  if (++cur.i < planes) return;
  cur.i = 0;
  if (++cur.c < n_ch) return;
  cur.c = 0;
  ++cur.rt;
}

// One ring stage as this lane sees it: SW words of its 4 rows (16 bytes each) and, per word, the 4
// halves of α. In the extra "offset plane" that follows the q sign planes, the offset z take the α slots, or,
// where the plane is one step per chunk (Cfg::kOffsetOneStep), the word slots: the chunk's NW words, two to a slot.
struct Stage {
  uint4* w;  // [SW][kThreads]
  uint2* a;  // [SW][kThreads]
};

// Start copying step `cur` for this lane into a stage: the words (j + φ) mod NW of the chunk, j in
// this step's range (all NW for a one-step offset plane). Words past the row's end, and rows past k, come in as
// zeros (α = 0: no contribution). COMPACT_ALPHA: α is [G, 1, k], every plane reads plane 0's.
template <int BP, bool COMPACT_ALPHA>
__device__ __forceinline__ void issue_step(const LutParams& p, const Cursor& cur, uint32_t phi, uint32_t row0,
                                           const Stage& st, int tid) {
  using C = Cfg<BP>;
  // 32-bit element offsets (the host checks q·W·k and G·q·k < 2^31): fewer address instructions per copy
  const uint32_t k = uint32_t(p.k), W = uint32_t(p.W);
  const bool row_ok = row0 < k;
  const uint32_t w0 = uint32_t(cur.c) * C::kWords, j0 = uint32_t(cur.h) * C::kStepWords + phi;
  if (cur.i < p.q) {
    // α[g][i][r] at g·(q·k) + i·k + r; compact: g·k + r
    const uint32_t plane = uint32_t(cur.i) * W * k + row0, scale = (COMPACT_ALPHA ? 0u : uint32_t(cur.i) * k) + row0;
    const uint32_t group_stride = COMPACT_ALPHA ? k : uint32_t(p.q) * k;
#pragma unroll
    for (int jj = 0; jj < C::kStepWords; ++jj) {
      const uint32_t w = w0 + ((j0 + jj) & (C::kWords - 1));
      const bool ok = row_ok && w < W;
      copy_async<16>(st.w + jj * kThreads + tid, p.qw + (ok ? plane + w * k : 0u), ok);
      copy_async<8>(st.a + jj * kThreads + tid, p.alpha + (ok ? scale + word_group(w, p.group_magic) * group_stride : 0u), ok);
    }
  } else if constexpr (C::kOffsetOneStep) {  // the chunk's z, two words to a 16-byte word slot
#pragma unroll
    for (int u = 0; u < C::kWords; ++u) {
      const uint32_t w = w0 + ((phi + uint32_t(u)) & (C::kWords - 1));
      const bool ok = row_ok && w < W;
      copy_async<8>(reinterpret_cast<uint2*>(st.w + (u >> 1) * kThreads + tid) + (u & 1),
                    p.offset + (ok ? row0 + word_group(w, p.group_magic) * k : 0u), ok);
    }
  } else {  // the offset plane reads no sign words
#pragma unroll
    for (int jj = 0; jj < C::kStepWords; ++jj) {
      const uint32_t w = w0 + ((j0 + jj) & (C::kWords - 1));
      const bool ok = row_ok && w < W;
      copy_async<8>(st.a + jj * kThreads + tid, p.offset + (ok ? row0 + word_group(w, p.group_magic) * k : 0u), ok);
    }
  }
}

// x values this thread needs to build its piece of the tables of chunk c: columns 8t..8t+7 of the
// chunk for batch columns 2·piece, 2·piece+1 (just column 0 when BP = 1), packed as half2.
template <int BP>
__device__ __forceinline__ void load_x(const LutParams& p, int c, int lane, uint32_t (&xh)[8]) {
  using C = Cfg<BP>;
  const int t = lane / C::kPieces;
  const int b0 = BP == 1 ? 0 : 2 * (lane % C::kPieces);
  const int col0 = c * C::kChunkCols + 8 * t;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int col = col0 + u;
    const bool ok = col < p.d;
    const float v0 = ok && b0 < p.nb ? __half2float(load_half(p.x + size_t(b0) * p.d + col)) : 0.f;
    const float v1 = BP > 1 && ok && b0 + 1 < p.nb ? __half2float(load_half(p.x + size_t(b0 + 1) * p.d + col)) : 0.f;
    xh[u] = float2_to_half2_bits(v0, v1);  // exact: the values are fp16
  }
}

__host__ __device__ constexpr int gray(int s) { return s ^ (s >> 1); }
__host__ __device__ constexpr int lowest_bit(int s) { return s & 1 ? 0 : s & 2 ? 1 : s & 4 ? 2 : s & 8 ? 3 : 4; }

// Build the NT tables of a chunk. Warp wv writes keys wv·32 .. wv·32+31 (key bits 5..7 = wv), one
// key per store instruction: lane l writes bytes 4l..4l+3 of the key's 128-byte row, i.e. piece
// l mod P of table l / P (P = E/4 pieces per entry), so a warp's store is one conflict-free row.
// Keys are visited in Gray-code order so each entry is the previous one ± 2·x_t (exact in fp32).
// Warp 7 also records the plain column sums Σ_t x_t (key 255) per table for the offset term.
template <int BP>
__device__ __forceinline__ void build_tables(unsigned char* lut, float* tsum, const uint32_t (&xh)[8], int lane,
                                             int warp) {
  using C = Cfg<BP>;
  const int t = lane / C::kPieces;
  const int b0 = BP == 1 ? 0 : 2 * (lane % C::kPieces);
  float x0[8], x1[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const float2 f = half2_bits_to_float2(xh[u]);
    x0[u] = f.x;
    x1[u] = f.y;
  }
  float e0 = 0.f, e1 = 0.f;  // entry of key warp·32 + 0
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const bool plus = u >= 5 && ((warp >> (u - 5)) & 1);
    e0 += plus ? x0[u] : -x0[u];
    e1 += plus ? x1[u] : -x1[u];
  }
#pragma unroll
  for (int s = 0; s < 32; ++s) {
    if (s > 0) {
      const int b = lowest_bit(s);
      const bool up = (gray(s) >> b) & 1;
      e0 += up ? 2.f * x0[b] : -2.f * x0[b];
      e1 += up ? 2.f * x1[b] : -2.f * x1[b];
    }
    const int key = (warp << 5) | gray(s);
    const uint32_t bits = BP == 1 ? float_to_bits(e0) : float2_to_half2_bits(e0, e1);
    *reinterpret_cast<uint32_t*>(lut + key * 128 + lane * 4) = bits;
    if (gray(s) == 31 && warp == kWarps - 1) {
      tsum[t * BP + b0] = e0;
      if (BP > 1) tsum[t * BP + b0 + 1] = e1;
    }
  }
}

// The offset term of word wl of the chunk for this lane's 4 rows: acc[r][b] += z[r] · Σ_{the word's columns} x_b
// (tsum holds the column sums of each 8-column table).
template <int BP>
__device__ __forceinline__ void add_offset_word(float (&acc)[kRowsPerLane][BP], uint2 zbits, int wl,
                                                const float* tsum) {
  const float2 z01 = half2_bits_to_float2(zbits.x), z23 = half2_bits_to_float2(zbits.y);
  const float z[4] = {z01.x, z01.y, z23.x, z23.y};
#pragma unroll
  for (int b = 0; b < BP; ++b) {
    const float xs = tsum[(4 * wl) * BP + b] + tsum[(4 * wl + 1) * BP + b] + tsum[(4 * wl + 2) * BP + b] +
                     tsum[(4 * wl + 3) * BP + b];
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) acc[r][b] = fmaf(z[r], xs, acc[r][b]);
  }
}

// ---- the matvec kernel ---------------------------------------------------------------------------

// grid: min(steps, SMs × resident blocks); block: kThreads; dynamic shared memory Cfg<BP>::kSmemBytes.
// p.ws and p.counters must be zero; the kernel leaves them zero (the block completing a tile clears
// the tile's sums and counter), so a workspace kept between launches needs no memset: one graph node
// less per matvec. Without p.y it only adds x·wᵀ into p.ws (whatever p.ws held) and stops there.
// Block b runs steps [b·S/B, (b+1)·S/B) of the sequence (row tile, chunk, plane, step): stream-K at
// step granularity, so blocks differ by at most one step of work, and a block may start or stop
// in the middle of a unit (its partial sums are just as additive).
// MIN_BLOCKS: the register budget (__launch_bounds__), LUT_MIN_BLOCKS or, for the lean instances,
// LUT_MIN_BLOCKS_LEAN (lutgemm_tuning.h). COMPACT_ALPHA: the instance for a compact α [G, 1, k].
template <int BP, int MIN_BLOCKS = LUT_MIN_BLOCKS, bool COMPACT_ALPHA = false>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) lut_gemm_kernel(const LutParams p) {
  static_assert(!COMPACT_ALPHA || BP <= kCompactAlphaMaxBatch, "compact alpha serves up to kCompactAlphaMaxBatch");
  using C = Cfg<BP>;
  constexpr int NT = C::kTables, NW = C::kWords, SW = C::kStepWords, NH = C::kSteps, EB = C::kEntryBytes;
  constexpr int S = C::kStages;
#ifdef LUTGEMM_HOST_EMU
  alignas(128) static unsigned char smem[C::kSmemBytes];
#else
  extern __shared__ __align__(16) unsigned char smem[];
#endif
  __shared__ float tsum[NT * BP];
  __shared__ int s_last;
#ifdef LUTGEMM_HOST_EMU
  // the emulation runs blocks one after another in the same shared memory: poison it, so that a block that
  // read tables or column sums it did not build (say, one starting inside a unit) fails the tests
  if (threadIdx.x == 0) {
    std::memset(smem, 0xFF, sizeof smem);
    for (float& t : tsum) t = NAN;
  }
  __syncthreads();
#endif

  qk::allow_next_grid();  // a grid of one wave (the default) has all its blocks running by now
  const long long s0 = p.steps * blockIdx.x / gridDim.x;
  const long long s1 = p.steps * (blockIdx.x + 1) / gridDim.x;
  if (s0 >= s1) return;  // whole block

  // [LUT][slack][ring: S stages of SW × kThreads words, then S stages of their α]. The LUT sits at a
  // fixed offset of the shared window, so a lookup is one load at [offset + window base] (sm_90 keeps
  // the base in a uniform register); aligning it at run time would cost every lookup one more add
  // (64 of the ~600 instructions of a step at one column). A lane's lookup offsets differ from its
  // neighbours' modulo 128, so they need no alignment to avoid bank conflicts. The ring does: its
  // copies cost 2-5 times the shared-memory wavefronts when it starts off a 128-byte boundary
  // (ncu, H100), and dynamic shared memory is only 16-byte aligned.
  unsigned char* lut = smem;
  uint4* ring_w = reinterpret_cast<uint4*>(lut + kLutBytes + (128 - reinterpret_cast<uintptr_t>(lut + kLutBytes) % 128) % 128);
  uint2* ring_a = reinterpret_cast<uint2*>(ring_w + S * SW * kThreads);
  auto stage = [&](int s) { return Stage{ring_w + s * SW * kThreads, ring_a + s * SW * kThreads}; };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row_in_tile = warp * kRowsPerWarp + lane * kRowsPerLane;
  const int phi = (lane & (NT - 1)) >> 2;  // word rotation
  // byte rotation: a lane reads byte (m + ψ) mod 4 of a word as its m-th key, from table 4·word + that byte
  const uint32_t rot8 = 8 * (lane & 3);
  uint32_t byte_off[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) byte_off[m] = ((m + lane) & 3) * EB;
  const int planes = p.planes;
  long long remaining = s1 - s0, to_issue = s1 - s0;
  const int unit_steps = p.q * NH + (planes - p.q) * C::kOffsetSteps;
  const long long unit = s0 / unit_steps;
  const int in_unit = int(s0 % unit_steps);  // the offset plane's steps come last
  Cursor ld{int(unit / p.n_ch), int(unit % p.n_ch), in_unit / NH, in_unit % NH};
  Cursor cur = ld;
  bool first = true;  // the first step builds its unit's tables even when it starts mid-unit
  int seg_steps = 0;  // steps of the current row tile done by this block since the last flush
  float acc[kRowsPerLane][BP];
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r)
#pragma unroll
    for (int b = 0; b < BP; ++b) acc[r][b] = 0.f;
  uint32_t xh[8];

  // prologue: S - 1 steps in flight (one commit group per step, empty past the block's last step)
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (to_issue > 0) {
      issue_step<BP, COMPACT_ALPHA>(p, ld, phi, ld.rt * kTileRows + row_in_tile, stage(s), tid);
      advance<BP>(ld, p.q, planes, p.n_ch);
      --to_issue;
    }
    commit_async();
  }
  qk::wait_prior_grid();  // the weights are on their way; x and the workspace belong to earlier kernels
  load_x<BP>(p, cur.c, lane, xh);

  for (int slot = 0; remaining > 0; slot = slot + 1 == S ? 0 : slot + 1) {
    wait_async<S - 2>();  // this step's group has landed
    uint4 w[SW];
    uint2 a[SW];
    const Stage st = stage(slot);
#pragma unroll
    for (int jj = 0; jj < SW; ++jj) {
      if (cur.i < p.q || C::kOffsetOneStep) w[jj] = st.w[jj * kThreads + tid];
      if (cur.i < p.q || !C::kOffsetOneStep) a[jj] = st.a[jj * kThreads + tid];
    }
    // refill the stage the previous step read (its values are consumed) with step + S - 1
    if (to_issue > 0) {
      issue_step<BP, COMPACT_ALPHA>(p, ld, phi, ld.rt * kTileRows + row_in_tile, stage(slot == 0 ? S - 1 : slot - 1), tid);
      advance<BP>(ld, p.q, planes, p.n_ch);
      --to_issue;
    }
    commit_async();

    if ((cur.i == 0 && cur.h == 0) || first) {  // a unit's first step: build its chunk's tables
      __syncthreads();  // everyone is done with the previous chunk's tables
      build_tables<BP>(lut, tsum, xh, lane, warp);
      __syncthreads();
      first = false;
    }
    const bool unit_end = cur.i == planes - 1 && cur.h == (cur.i < p.q ? NH : C::kOffsetSteps) - 1;
    if (unit_end && remaining > 1) load_x<BP>(p, cur.c + 1 == p.n_ch ? 0 : cur.c + 1, lane, xh);  // next unit's x

    if (cur.i < p.q) {
      // compact α: α_i = 2^i·α_0. The step's words add α_0·Σ into `part`, then acc += 2^i·part: one multiply per
      // row and step instead of one per row and word (in the words' loop it cost more than the α bytes saved:
      // GPTQ-4 decode 2.054 against 2.048 ms with the full α; this way 2.034, H100)
      const float plane_scale = COMPACT_ALPHA ? bits_to_float((127u + uint32_t(cur.i)) << 23) : 1.f;
      [[maybe_unused]] float part[kRowsPerLane][BP];  // compact α only
#pragma unroll
      for (int jj = 0; jj < SW; ++jj) {
        const int j = cur.h * SW + jj;
        const uint32_t word_off = uint32_t((j + phi) & (NW - 1)) * (4 * EB);
        const uint32_t rows[4] = {w[jj].x, w[jj].y, w[jj].z, w[jj].w};
        const float2 a01 = half2_bits_to_float2(a[jj].x), a23 = half2_bits_to_float2(a[jj].y);
        const float al[4] = {a01.x, a01.y, a23.x, a23.y};
#pragma unroll
        for (int r = 0; r < kRowsPerLane; ++r) {
          Entry<BP> sum;
          const uint32_t rot = __funnelshift_r(rows[r], rows[r], rot8);  // byte m of rot = byte (m + ψ) mod 4 of the row
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            // key·128 has bits 7..14 only, table offset t·E < 128: OR is the sum
            // byte m to bits 7..14 by a multiply (m = 0) or multiply-high by a power of two: FMA pipe
            const uint32_t k128 = m == 0 ? rot * p.pow2[7] : __umulhi(rot, p.pow2[39 - 8 * m]);
            const uint32_t addr = (k128 & 0x7F80u) | (word_off + byte_off[m]);
            const Entry<BP> e = load_entry<BP>(lut + addr);
            if (m == 0) sum = e; else entry_add<BP>(sum, e);
          }
          if constexpr (COMPACT_ALPHA) {
            if (jj == 0) {
#pragma unroll
              for (int b = 0; b < BP; ++b) part[r][b] = 0.f;
            }
            entry_fma<BP>(part[r], al[r], sum);
          } else {
            entry_fma<BP>(acc[r], al[r], sum);
          }
        }
      }
      if constexpr (COMPACT_ALPHA) {
#pragma unroll
        for (int r = 0; r < kRowsPerLane; ++r)
#pragma unroll
          for (int b = 0; b < BP; ++b) acc[r][b] = fmaf(plane_scale, part[r][b], acc[r][b]);
      }
    } else if constexpr (C::kOffsetOneStep) {  // offset plane, the whole chunk: y += z · Σ_{columns of a word} x
#pragma unroll
      for (int u = 0; u < NW; ++u) {
        const uint4 zz = w[u >> 1];
        const uint2 z = u & 1 ? make_uint2(zz.z, zz.w) : make_uint2(zz.x, zz.y);
        add_offset_word<BP>(acc, z, (u + phi) & (NW - 1), tsum);
      }
    } else {  // offset plane, this step's words
#pragma unroll
      for (int jj = 0; jj < SW; ++jj) add_offset_word<BP>(acc, a[jj], ((cur.h * SW + jj) + phi) & (NW - 1), tsum);
    }
    ++seg_steps;
    // end of this block's run on row tile cur.rt: add its partial sums, and finish the tile if it is complete
    if ((cur.c == p.n_ch - 1 && unit_end) || remaining == 1) {
      const int row0 = cur.rt * kTileRows + row_in_tile;
      if (row0 < p.k) {
#pragma unroll
        for (int b = 0; b < BP; ++b)
          if (b < p.nb) atomic_add4(p.ws + size_t(b) * p.k + row0, acc[0][b], acc[1][b], acc[2][b], acc[3][b]);
      }
      if (p.y != nullptr && complete_tile(p.counters + cur.rt, seg_steps, p.n_ch * unit_steps, &s_last) &&
          row0 < p.k) {
        // this block completed the tile: fp32 sums -> fp16 output
        float bias[4] = {0.f, 0.f, 0.f, 0.f};
        if (p.bias != nullptr) {
          const uint2 bb = load_half4(p.bias + row0);
          const float2 b01 = half2_bits_to_float2(bb.x), b23 = half2_bits_to_float2(bb.y);
          bias[0] = b01.x, bias[1] = b01.y, bias[2] = b23.x, bias[3] = b23.y;
        }
        for (int b = 0; b < p.nb; ++b) {
          const float4 v = load_l2(p.ws + size_t(b) * p.k + row0);
          *reinterpret_cast<float4*>(p.ws + size_t(b) * p.k + row0) = make_float4(0.f, 0.f, 0.f, 0.f);
          uint2 out;
          out.x = float2_to_half2_bits(v.x + bias[0], v.y + bias[1]);
          out.y = float2_to_half2_bits(v.z + bias[2], v.w + bias[3]);
          *reinterpret_cast<uint2*>(p.y + size_t(b) * p.k + row0) = out;
        }
      }
      seg_steps = 0;
#pragma unroll
      for (int r = 0; r < kRowsPerLane; ++r)
#pragma unroll
        for (int b = 0; b < BP; ++b) acc[r][b] = 0.f;
    }
    advance<BP>(cur, p.q, planes, p.n_ch);
    --remaining;
  }
  wait_async<0>();  // no copy may outlive the block (only empty groups remain here)
}

}  // namespace lutgemm
