// The tensor-core kernel of LUT-GEMM: y = x·wᵀ for 5..8 columns of x (any 1..8 in tests), where the LUT
// kernel's 8-column tables would move 16 bytes of shared memory per lookup.
//
// Mapping (one step = one unit = 512 rows × one 128-column chunk, all its planes):
//
//   block  (512 rows, 8 warps)    stream-K over units: block b runs units [b·U/B, (b+1)·U/B)
//   ┌──────────────────────────┐
//   │ warp 0: rows   0..63     │  4 mma tiles of 16 rows: tile τ holds rows 32·(τ/2) + 4g + 2(τ%2)
//   │ warp 1: rows  64..127    │  and the row after it (mma rows g, g + 8)
//   │ ...                      │
//   │ warp 7: rows 448..511    │
//   └──────────────────────────┘
//   lane = 4g + t: loads word t of the chunk for rows 4g..4g+3 and 32+4g..32+4g+3 of every plane, and
//   holds x's B fragment of batch row g (zeros past the batch).
//
// At 8 columns a LUT lookup moves 16 bytes of shared memory, which bounds the LUT kernel well above
// the time to stream the weights. This kernel instead turns the sign planes into fp16 A fragments in
// registers and lets mma.sync.m16n8k16 multiply them with x (batch = the n8 side), fp32
// accumulation; α scales each plane's partial sums per group as in the LUT kernel. It needs whole 128-column
// chunks per group (group_size % 128 == 0, or one group per row).
//
// Warp = 64 rows as four 16-row mma tiles: lane (g = lane/4, t = lane%4) loads one word of rows
// 4g..4g+3 and of rows 32+4g..32+4g+3 (16 bytes each, so a warp reads 8 full 128-byte lines of a
// chunk's 4 words). The k order of the mma is ours to choose as long as A and B agree: in k-step κ
// (0..7) of a 128-column chunk, thread t supplies k = 2t, 2t+1, 2t+8, 2t+9 as bits κ, κ+16, κ+8,
// κ+24 of word t of the chunk, and x's fragment holds the same columns. Tile τ maps mma rows g / g+8
// to rows 32·(τ/2) + 4g + 2(τ%2) / the row after it.
//
// The decode is one AND per A register: `word & (1 << κ | 1 << (κ+16))` (and the same of word >> 8)
// leaves in each half either 0 or the fp16 subnormal 2^(κ−24), i.e. bit·2^(κ−24). x's fragment of
// k-step κ is pre-scaled by 2^−κ once per chunk (exact but for x below 2^−7, which loses at most
// 2^−25 to subnormal rounding), so every product is bit·x·2^−24 and the 8 k-steps share one
// accumulator: D = 2^−24·Σ bit·x. A sign ±1 = 2·bit − 1, so plane i adds α_i·2^25·(D − 2^−25·Σx):
// each plane's mma chain starts from −2^−25·Σx instead of zero, and the warp keeps its sums in units
// of 2^25 until they leave it (the offset adds z·Σx per chunk); Σx comes from 8 mmas of an
// all-ones A on x's fragments before they are scaled. The host emulation checks this algebra and
// the layout; the device tests (fp32 reference) check that the tensor cores keep subnormal operands.
// (Putting the bits on the fp16 sign bits instead costs a shift per pair: 50 % more instructions.)
//
// A step is a unit: 512 rows × one 128-column chunk with all its planes. What a warp does per chunk
// besides the planes (copies' addresses, x fragments, Σx) is then shared by 64 rows and all planes:
// the kernel is issue-bound (ncu), and at 32 rows per warp that share would be ~45 % of the instructions.
#pragma once

#include "lutgemm_common.cuh"

namespace lutgemm {

constexpr int kMmaRowsPerWarp = 64;
constexpr int kMmaTileRows = kWarps * kMmaRowsPerWarp;  // 512
constexpr int kMmaChunkWords = 4;
constexpr int kMmaMaxPlanes = 9;  // q ≤ 8 sign planes and the offset

// Ring stages (MMA_STAGES, lutgemm_tuning.h): S - 1 chunks in flight per lane. A stage holds per lane its
// x fragment (64 bytes) and 2·q words (16 bytes each) and, per warp, the α / z quads of its 64 rows (the
// lanes copy them in turn; all read them after a __syncwarp): 43 KB at q = 3 for the block.
constexpr int kMmaQuadsPerPlane = kMmaRowsPerWarp / 4;  // 4-row α quads of one warp and plane
constexpr int kMmaXBytes = 64 * kThreads;  // per lane: x of its batch row over its word's 32 columns
__host__ __device__ constexpr int mma_stage_bytes(int q, int planes) {
  return kMmaXBytes + 32 * q * kThreads + 8 * planes * kMmaQuadsPerPlane * kWarps;
}
constexpr int kMmaMaxSmemBytes = MMA_STAGES * mma_stage_bytes(8, kMmaMaxPlanes);
static_assert(kMmaMaxSmemBytes <= 227 * 1024, "the tensor-core ring must fit one SM's shared memory at q = 8");

// d += a · b on the tensor cores: a 16×16 fp16 (4 regs), b 16×8 fp16 (2 regs), d 16×8 fp32.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef LUTGEMM_HOST_EMU
  // the PTX fragment layout: A(row, k) is in lane (row%8)·4 + (k%8)/2, register (k≥8)·2 + (row≥8),
  // half k%2; B(k, n) in lane n·4 + (k%8)/2, register k≥8, half k%2; D(row, n) in lane (row%8)·4 + n/2,
  // element (row≥8)·2 + n%2
  const int lane = threadIdx.x & 31;
  emu::MmaExchange& ex = emu::mma_exchange[threadIdx.x >> 5];
  for (int r = 0; r < 4; ++r) ex.a[lane][r] = a[r];
  ex.b[lane][0] = b0;
  ex.b[lane][1] = b1;
  emu::warp_bar->arrive_and_wait();
  auto half_of = [](uint32_t reg, int hi) {
    __half h;
    const uint16_t bits = uint16_t(hi ? reg >> 16 : reg & 0xFFFF);
    std::memcpy(&h, &bits, 2);
    return __half2float(h);
  };
  const int g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), n = 2 * t + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const float av = half_of(ex.a[(row % 8) * 4 + (k % 8) / 2][(k >= 8 ? 2 : 0) + (row >= 8 ? 1 : 0)], k & 1);
      const float bv = half_of(ex.b[n * 4 + (k % 8) / 2][k >= 8 ? 1 : 0], k & 1);
      acc += av * bv;
    }
    d[e] = acc;
  }
  emu::warp_bar->arrive_and_wait();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// A-fragment pair of k-step κ from a sign word (or the word shifted right by 8): bits κ and κ+16 kept
// in place, i.e. bit·2^(κ−24) as two fp16 subnormals.
__device__ __forceinline__ uint32_t bit_pair(uint32_t word, int kk) { return word & (0x00010001u << kk); }

// x·2^−κ for both halves of a B-fragment register (see above).
__device__ __forceinline__ uint32_t scale_half2(uint32_t bits, int kk) {
  const float s = 1.f / float(1 << kk);
#ifdef LUTGEMM_HOST_EMU
  const float2 f = half2_bits_to_float2(bits);
  return float2_to_half2_bits(f.x * s, f.y * s);
#else
  const __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(s));
  return *reinterpret_cast<const uint32_t*>(&h);
#endif
}

// Start copying chunk c's x fragment for this lane into a ring stage: batch row g, the 32 columns of
// word t of the chunk (4 pieces of 16 bytes), through L1, as the block's 8 warps read the same 2 KB.
// Piece v of lane l sits at [warp][v][l], so the 32 lanes of one load read 512 contiguous bytes
// (ncu: the lane-contiguous layout, 64 bytes per lane, cost the loads 4 times their wavefronts).
__device__ __forceinline__ void mma_issue_x(const LutParams& p, int c, int lane, int warp, unsigned char* stage) {
  const uint32_t g = lane >> 2, t = lane & 3;
  uint4* xs = reinterpret_cast<uint4*>(stage) + warp * 128 + lane;
  const int col0 = 32 * int(uint32_t(c) * kMmaChunkWords + t);
  const bool inside = int(g) < p.nb && col0 < p.d;
  if (!inside || (p.x_vec && col0 + 32 <= p.d)) {
    const __half* src = p.x + (inside ? size_t(g) * p.d + col0 : 0);
#pragma unroll
    for (int v = 0; v < 4; ++v) copy_async<16, true>(xs + 32 * v, src + 8 * v, inside);
  } else {  // the row's last, partial word (or x not 16-byte aligned): plain loads, plain stores
    const __half* src = p.x + size_t(g) * p.d + col0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float lo = col0 + 2 * j < p.d ? __half2float(load_half(src + 2 * j)) : 0.f;
      const float hi = col0 + 2 * j + 1 < p.d ? __half2float(load_half(src + 2 * j + 1)) : 0.f;
      reinterpret_cast<uint32_t*>(xs + 32 * (j / 4))[j % 4] = float2_to_half2_bits(lo, hi);
    }
  }
}

// Start copying unit (rt, c)'s weights for this lane into a ring stage: word t of the chunk for its
// rows 4g..4g+3 and 32+4g..32+4g+3 of every sign plane (16 bytes each; [plane][half][lane] per warp,
// conflict-free loads as x above), and slots l, l + 32, ... of the warp's α / z quads, slot = 8·j + group
// g for quad j = 2·plane + half ([plane][half][g]). 32-bit element offsets: the host checks q·W·k
// and G·q·k < 2^31.
__device__ __forceinline__ void mma_issue_weights(const LutParams& p, int rt, int c, int lane, int warp,
                                                  unsigned char* stage) {
  const uint32_t k = uint32_t(p.k), q = uint32_t(p.q), g = lane >> 2, t = lane & 3;
  const uint32_t r0 = uint32_t(rt) * kMmaTileRows + warp * kMmaRowsPerWarp + 4 * g;
  const uint32_t wd = uint32_t(c) * kMmaChunkWords + t;
  const bool word_ok = wd < uint32_t(p.W);
  const uint32_t grp = word_group(c * kMmaChunkWords, p.group_magic);  // one group per chunk
  const uint32_t wstride = uint32_t(p.W) * k;
  uint4* w = reinterpret_cast<uint4*>(stage + kMmaXBytes) + warp * 64 * q + lane;
  uint2* a = reinterpret_cast<uint2*>(stage + kMmaXBytes + 32 * q * kThreads) + warp * p.planes * kMmaQuadsPerPlane;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t r = r0 + 32 * h;
    const bool ok = word_ok && r < k;
    const uint32_t woff = ok ? wd * k + r : 0u, step = ok ? wstride : 0u;
#pragma unroll 1
    for (uint32_t i = 0; i < q; ++i) copy_async<16>(w + i * 64 + 32 * h, p.qw + woff + i * step, ok);
  }
  const uint32_t row_a = uint32_t(rt) * kMmaTileRows + warp * kMmaRowsPerWarp + 4 * (lane & 7);
  for (uint32_t slot = lane; slot < 16u * uint32_t(p.planes); slot += 32) {
    const uint32_t j = slot >> 3, i = j >> 1, r = row_a + 32 * (j & 1);
    const bool ok = r < k;
    const __half* src = i < q ? p.alpha + (ok ? (grp * q + i) * k + r : 0u) : p.offset + (ok ? grp * k + r : 0u);
    copy_async<8>(a + slot, src, ok);
  }
}

// The same copies as mma_issue_x + mma_issue_weights for a unit whose rows, words and x columns all lie
// inside the matrix (and x rows 16-byte aligned): no bounds checks, and the per-lane parts of the
// addresses fixed for the launch (MmaLane). ncu (H100, 49152×12288 q2 at 8 columns) counted the
// general functions' address arithmetic and checks as 22 % of the kernel's instructions.
struct MmaLane {
  const __half* x;  // x + g·d + 32t: the lane's batch row at word t of chunk 0 (lanes past the batch: unread)
  uint32_t w;       // t·k + r: plane 0's word t of chunk 0 at the lane's first row r of row tile 0
  uint32_t r;       // warp·64 + 4·(lane % 8) + 32·(lane / 8 % 2): the rows of the lane's first α / z slot
  bool x_ok;        // g < nb
};

__device__ __forceinline__ MmaLane mma_lane(const LutParams& p, int lane, int warp) {
  const uint32_t g = lane >> 2, t = lane & 3, k = uint32_t(p.k);
  MmaLane l;
  l.x_ok = int(g) < p.nb;
  l.x = p.x + (l.x_ok ? g * uint32_t(p.d) + 32 * t : 0u);
  l.w = t * k + warp * kMmaRowsPerWarp + 4 * g;
  l.r = warp * kMmaRowsPerWarp + 4 * (lane & 7) + 32 * ((lane >> 3) & 1);
  return l;
}

template <int Q>
__device__ __forceinline__ void mma_issue_interior(const LutParams& p, const MmaLane& l, int rt, int c, int lane,
                                                   int warp, unsigned char* stage) {
  const uint32_t k = uint32_t(p.k), q = Q > 0 ? uint32_t(Q) : uint32_t(p.q);
  uint4* xs = reinterpret_cast<uint4*>(stage) + warp * 128 + lane;
  const __half* xsrc = l.x + 32 * kMmaChunkWords * c;
#pragma unroll
  for (int v = 0; v < 4; ++v) copy_async<16, true>(xs + 32 * v, xsrc + 8 * v, l.x_ok);

  const uint32_t row0 = uint32_t(rt) * kMmaTileRows;
  const uint32_t wstride = uint32_t(p.W) * k;
  const uint32_t* wsrc = p.qw + (uint32_t(c) * kMmaChunkWords * k + row0 + l.w);
  uint4* w = reinterpret_cast<uint4*>(stage + kMmaXBytes) + warp * 64 * q + lane;
#pragma unroll(Q > 0 ? Q : 1)
  for (uint32_t i = 0; i < q; ++i, wsrc += wstride, w += 64) {
    copy_async<16>(w, wsrc, true);
    copy_async<16>(w + 32, wsrc + 32, true);
  }

  // α / z slots lane, lane + 32, ... as in mma_issue_weights: quad j = slot / 8 of plane j / 2 (the
  // offset plane when it is q); the next slot is 4 quads on, i.e. 2 planes, same half and group
  const uint32_t grp = word_group(c * kMmaChunkWords, p.group_magic), r = row0 + l.r;
  uint2* a = reinterpret_cast<uint2*>(stage + kMmaXBytes + 32 * q * kThreads) + warp * p.planes * kMmaQuadsPerPlane + lane;
  uint32_t i = uint32_t(lane) >> 4;
  const __half* asrc = p.alpha + (grp * q + i) * k + r;
#pragma unroll(Q > 0 ? (Q + 1) / 2 : 1)
  for (; i < q; i += 2, asrc += 2 * k, a += 32) copy_async<8>(a, asrc, true);
  if (i == q && p.planes > int(q)) copy_async<8>(a, p.offset + grp * k + r, true);
}

// B fragments of the 8 k-steps: b[κ] = (x at bits κ, κ+16), b[8+κ] = (x at bits κ+8, κ+24) of word t,
// times 2^−κ; and Σx of the chunk per batch column (sums[0], sums[1]: columns 2t, 2t+1), from mmas
// of an all-ones A on the fragments before they are scaled.
__device__ __forceinline__ void mma_pack_x(const uint32_t (&u)[16], uint32_t (&b)[16], float (&sums)[4]) {
  const uint32_t ones[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const unsigned sel = kk & 1 ? 0x7632u : 0x5410u;  // high or low halves of the two words
    const uint32_t lo = __byte_perm(u[kk >> 1], u[(kk >> 1) + 8], sel);
    const uint32_t hi = __byte_perm(u[(kk + 8) >> 1], u[((kk + 8) >> 1) + 8], sel);
    mma_16816(sums, ones, lo, hi);
    b[kk] = scale_half2(lo, kk);
    b[8 + kk] = scale_half2(hi, kk);
  }
}
// grid: min(steps, SMs × resident blocks); block: kThreads; dynamic shared memory
// MMA_STAGES · mma_stage_bytes(q, planes); p from make_mma_params (ws, counters zero, left zero).
// Q = q for the instances of q = 1..MMA_STATIC_Q_MAX, Q = 0 for the one that reads q at run time
// (lutgemm_tuning.h).
template <int Q>
__global__ void __launch_bounds__(kThreads, MMA_MIN_BLOCKS) bcq_mma_kernel(const LutParams p) {
  constexpr int S = MMA_STAGES;
#ifdef LUTGEMM_HOST_EMU
  alignas(16) static unsigned char smem[kMmaMaxSmemBytes];
#else
  extern __shared__ __align__(16) unsigned char smem[];
#endif
  __shared__ int s_last;
  qk::allow_next_grid();  // as the LUT kernel
  const long long s0 = p.steps * blockIdx.x / gridDim.x;
  const long long s1 = p.steps * (blockIdx.x + 1) / gridDim.x;
  if (s0 >= s1) return;  // whole block
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int q = Q > 0 ? Q : p.q, planes = p.planes, stage_bytes = mma_stage_bytes(q, planes);
  long long remaining = s1 - s0, to_issue = s1 - s0;
  int ld_rt = int(s0 / p.n_ch), ld_c = int(s0 % p.n_ch);  // the next unit to copy
  int rt = ld_rt, c = ld_c;                               // the unit being computed
  int seg_steps = 0;
  // units that mma_issue_interior may copy: whole row tiles, whole chunks of x (16-byte aligned rows)
  const int inner_rt = p.k / kMmaTileRows, inner_ch = p.x_vec ? p.d / (32 * kMmaChunkWords) : 0;
  const MmaLane copy_lane = mma_lane(p, lane, warp);
  constexpr float kAccUnit = 0x1p25f;  // acc holds sums / 2^25 (see the plane loop)
  float acc[8][2];  // rows 4g + r (r < 4) and 32 + 4g + r - 4, batch columns 2t, 2t + 1; units of 1 / kAccUnit
#pragma unroll
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = 0.f;
  uint32_t bx[16];
  // x and weights run S - 1 units ahead through the ring. The first units' weights are copied before
  // the wait for the previous kernel, their x after it: group s holds unit s's x (group 0 also all
  // the first weights), so the loop's wait for group s still covers unit s.
  const int first_units = int(to_issue < S - 1 ? to_issue : S - 1);
  for (int s = 0; s < first_units; ++s) {
    mma_issue_weights(p, ld_rt, ld_c, lane, warp, smem + s * stage_bytes);
    if (++ld_c == p.n_ch) ld_c = 0, ++ld_rt;
  }
  to_issue -= first_units;
  qk::wait_prior_grid();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < first_units) mma_issue_x(p, int((s0 + s) % p.n_ch), lane, warp, smem + s * stage_bytes);
    commit_async();
  }

  for (int slot = 0; remaining > 0; slot = slot + 1 == S ? 0 : slot + 1) {
    wait_async<S - 2>();  // this lane's copies of the unit have landed,
    __syncwarp();         // and the other lanes' (α quads are shared); the previous stage is consumed
    if (to_issue > 0) {   // refill the stage the previous unit read
      unsigned char* refill = smem + (slot == 0 ? S - 1 : slot - 1) * stage_bytes;
      if (ld_rt < inner_rt && ld_c < inner_ch) {
        mma_issue_interior<Q>(p, copy_lane, ld_rt, ld_c, lane, warp, refill);
      } else {
        mma_issue_x(p, ld_c, lane, warp, refill);
        mma_issue_weights(p, ld_rt, ld_c, lane, warp, refill);
      }
      if (++ld_c == p.n_ch) ld_c = 0, ++ld_rt;
      --to_issue;
    }
    commit_async();
    const unsigned char* st = smem + slot * stage_bytes;
    float sx0, sx1;  // Σx of the chunk for batch columns 2t, 2t + 1
    {
      const uint4* xs = reinterpret_cast<const uint4*>(st) + warp * 128 + lane;
      uint32_t u[16];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const uint4 x4 = xs[32 * v];
        u[4 * v] = x4.x, u[4 * v + 1] = x4.y, u[4 * v + 2] = x4.z, u[4 * v + 3] = x4.w;
      }
      float sums[4] = {0.f, 0.f, 0.f, 0.f};
      mma_pack_x(u, bx, sums);
      sx0 = sums[0], sx1 = sums[1];
    }
    // Units of 2^−25 (applied when the sums leave the warp): plane i adds α_i·(D_i − 2^−25·Σx), i.e.
    // α_i·Σ(2·bit − 1)·x / 2^25, with −2^−25·Σx as the starting accumulator of its mma chain.
    const float nsx0 = -sx0 * 0x1p-25f, nsx1 = -sx1 * 0x1p-25f;
    const uint4* ring_w = reinterpret_cast<const uint4*>(st + kMmaXBytes) + warp * 64 * q + lane;
    const uint2* ring_a =
        reinterpret_cast<const uint2*>(st + kMmaXBytes + 32 * q * kThreads) + warp * planes * kMmaQuadsPerPlane + (lane >> 2);
#pragma unroll(Q > 0 ? Q : 1)
    for (int i = 0; i < q; ++i) {
      const uint4 wa = ring_w[i * 64], wb = ring_w[i * 64 + 32];
      const uint2 qa = ring_a[2 * i * 8], qb = ring_a[(2 * i + 1) * 8];
      const uint32_t words[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
      const float2 a0 = half2_bits_to_float2(qa.x), a1 = half2_bits_to_float2(qa.y);
      const float2 a2 = half2_bits_to_float2(qb.x), a3 = half2_bits_to_float2(qb.y);
      const float alpha[8] = {a0.x, a0.y, a1.x, a1.y, a2.x, a2.y, a3.x, a3.y};
#pragma unroll
      for (int tile = 0; tile < 4; ++tile) {
        const uint32_t lo = words[2 * tile], hi = words[2 * tile + 1];  // mma rows g and g + 8
        const uint32_t lo8 = lo >> 8, hi8 = hi >> 8;
        float part[4] = {nsx0, nsx1, nsx0, nsx1};  // D(row, n) starts at −2^−25·Σx of batch column n
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          const uint32_t a[4] = {bit_pair(lo, kk), bit_pair(hi, kk), bit_pair(lo8, kk), bit_pair(hi8, kk)};
          mma_16816(part, a, bx[kk], bx[8 + kk]);
        }
        acc[2 * tile][0] = fmaf(alpha[2 * tile], part[0], acc[2 * tile][0]);
        acc[2 * tile][1] = fmaf(alpha[2 * tile], part[1], acc[2 * tile][1]);
        acc[2 * tile + 1][0] = fmaf(alpha[2 * tile + 1], part[2], acc[2 * tile + 1][0]);
        acc[2 * tile + 1][1] = fmaf(alpha[2 * tile + 1], part[3], acc[2 * tile + 1][1]);
      }
    }
    if (planes > q) {  // the offset: z·Σx, in the same units
      const uint2 za = ring_a[2 * q * 8], zb = ring_a[(2 * q + 1) * 8];
      const float2 z0 = half2_bits_to_float2(za.x), z1 = half2_bits_to_float2(za.y);
      const float2 z2 = half2_bits_to_float2(zb.x), z3 = half2_bits_to_float2(zb.y);
      const float z[8] = {z0.x, z0.y, z1.x, z1.y, z2.x, z2.y, z3.x, z3.y};
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        acc[r][0] = fmaf(z[r], -nsx0, acc[r][0]);
        acc[r][1] = fmaf(z[r], -nsx1, acc[r][1]);
      }
    }
    ++seg_steps;
    if (c == p.n_ch - 1 || remaining == 1) {  // leave row tile rt: as the LUT kernel
      const int row0 = rt * kMmaTileRows + warp * kMmaRowsPerWarp + 4 * (lane >> 2);
      const int n0 = 2 * (lane & 3);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row0 + 32 * h >= p.k) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (n0 + j < p.nb)
            atomic_add4(p.ws + size_t(n0 + j) * p.k + row0 + 32 * h, kAccUnit * acc[4 * h][j], kAccUnit * acc[4 * h + 1][j],
                        kAccUnit * acc[4 * h + 2][j], kAccUnit * acc[4 * h + 3][j]);
      }
      if (p.y != nullptr && complete_tile(p.counters + rt, seg_steps, p.n_ch, &s_last)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + 32 * h;
          if (row >= p.k) continue;
          float bias[4] = {0.f, 0.f, 0.f, 0.f};
          if (p.bias != nullptr) {
            const uint2 bb = load_half4(p.bias + row);
            const float2 b01 = half2_bits_to_float2(bb.x), b23 = half2_bits_to_float2(bb.y);
            bias[0] = b01.x, bias[1] = b01.y, bias[2] = b23.x, bias[3] = b23.y;
          }
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            if (n0 + j >= p.nb) continue;
            const float4 v = load_l2(p.ws + size_t(n0 + j) * p.k + row);
            *reinterpret_cast<float4*>(p.ws + size_t(n0 + j) * p.k + row) = make_float4(0.f, 0.f, 0.f, 0.f);
            uint2 out;
            out.x = float2_to_half2_bits(v.x + bias[0], v.y + bias[1]);
            out.y = float2_to_half2_bits(v.z + bias[2], v.w + bias[3]);
            *reinterpret_cast<uint2*>(p.y + size_t(n0 + j) * p.k + row) = out;
          }
        }
      }
      seg_steps = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = 0.f;
    }
    if (++c == p.n_ch) c = 0, ++rt;
    --remaining;
  }
  wait_async<0>();  // no copy may outlive the block (only empty groups remain here)
}

}  // namespace lutgemm
