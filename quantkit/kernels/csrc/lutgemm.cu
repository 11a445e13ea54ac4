// LUT-GEMM for binary-coding quantized weights (LUT-GEMM §3.1-3.2 and appendix B; nuQmm §III.B-C).
// Three kernels: lut_gemm_kernel (the LUT matvec, 1..8 columns of x), bcq_mma_kernel (the same
// product on tensor cores, for 5..8 columns, where shared memory bounds the LUT; see its section) and
// dequant_kernel (BCQ -> dense weight, for large batches through cuBLAS).
//
// Computes y[b, r] = Σ_c w[r, c]·x[b, c] (+ bias[r]) for a BCQ weight (quantkit/formats/bcq.py)
//   w[r, c] = Σ_i alpha[c/g, i, r]·(2·bit_i[r, c] − 1) + offset[c/g, r]
// straight from the packed planes: qweight int32 [q, W, k] (rows fastest; byte m of word w holds the
// 8-column sub-vector 32w+8m..32w+8m+7), alpha fp16 [G, q, k], offset fp16 [G, k].
//
// The LUT (μ = 8): for each 8-column sub-vector of x a table T[key] = Σ_t (2·bit_t(key) − 1)·x_t over
// the 256 keys, so one shared-memory read replaces 8 multiply-adds; a word of a plane is 4 keys.
//
// Work split: a "unit" is a tile of 1024 rows × one chunk of NT sub-vectors (NT = 8..32); a unit is
// q (+1 with an offset) planes of NH pipeline steps each.
//
//   columns ─────────────────────────────────────────────►  (chunk = NT·8 columns = NT/4 words)
//   rows  ┌──────────┬──────────┬──────────┬─────┐
//    │    │ unit 0   │ unit 1   │ unit 2   │ ... │  row tile 0 (1024 rows)
//    │    ├──────────┼──────────┼──────────┼─────┤
//    ▼    │ ...      │          │          │     │  row tile 1
//         └──────────┴──────────┴──────────┴─────┘
//   Steps are numbered row tile by row tile, unit by unit; block b of B runs the contiguous range
//   [b·S/B, (b+1)·S/B) of all S steps ("stream-K"), so blocks differ by at most one step of work
//   whatever the shape (B = SMs × resident blocks, one wave). Per unit the block builds the chunk's
//   NT tables in shared memory (32 KB); each of its 8 warps handles 128 rows, each lane 4
//   consecutive rows (one 16-byte load gives the same word of 4 rows). When its range leaves a row
//   tile, a block adds its fp32 partial sums to a workspace with atomics; the block that completes
//   a row tile (per-tile step counter) converts it to fp16 and adds the bias. With no output (y null,
//   "accumulate") the sums stay in the workspace for the next kernel to read and clear: no counter,
//   no read-back, ~1.1-1.4 µs less per call at the 7B decode shapes (BENCHMARKS.md). Loads run S - 1 steps
//   ahead of the compute: each lane copies its words and scales into its own slots of a ring of S
//   stages in shared memory (cp.async), so no registers hold loads in flight.
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
// The 4 lookups of one word are summed in fp16, then scaled by α in fp32 and accumulated in fp32.
// Table construction is exact fp32 (Gray-code order: each entry is the previous one ± 2·x_t),
// rounded once to the entry type.
//
// This file also compiles as plain C++ (-DLUTGEMM_HOST_EMU, see the end): the kernels then run on
// the CPU with one std::thread per CUDA thread, which is how the CPU test suite checks them.

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifdef LUTGEMM_HOST_EMU
// ---- host emulation of the few CUDA features used below -------------------------------------
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <vector_functions.h>
#include <vector_types.h>
#undef __shared__
#define __shared__ static  // one copy per kernel instantiation; blocks are emulated one at a time
#define __launch_bounds__(...)
namespace emu {
inline thread_local uint3 tid, bid;
inline thread_local uint3 gdim, bdim;
inline thread_local std::barrier<>* bar = nullptr;
inline thread_local std::barrier<>* warp_bar = nullptr;
struct MmaExchange {  // fragments of one warp's mma, to emulate the warp-collective instruction
  uint32_t a[32][4];
  uint32_t b[32][2];
};
inline MmaExchange mma_exchange[32];
}  // namespace emu
#define threadIdx emu::tid
#define blockIdx emu::bid
#define gridDim emu::gdim
#define blockDim emu::bdim
inline void __syncthreads() { emu::bar->arrive_and_wait(); }
inline void __syncwarp() { emu::warp_bar->arrive_and_wait(); }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned(v >> (s & 31));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const uint64_t v = (uint64_t(b) << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
#else
#include <cuda_runtime.h>
#endif

#ifdef LUTGEMM_HOST_EMU
#define QK_HOST_EMU
#endif
#include "cp_async.h"
#include "grid_dependency.h"

namespace lutgemm {

constexpr int kThreads = 256;  // 8 warps; the table builder relies on 8 warps = 8 values of key bits 5..7
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerLane = 4;
constexpr int kRowsPerWarp = 32 * kRowsPerLane;
constexpr int kTileRows = kWarps * kRowsPerWarp;  // 1024
constexpr int kLutBytes = 256 * 128;              // 256 keys × (NT tables × E bytes = 128)
constexpr int kMaxBatch = 8;

// Ring stages of the matvec pipeline: each lane has S - 1 steps of sign words and scales in flight
// (cp.async into shared memory) while it computes one. 3 stages (104 KB with the LUT at 1..4 columns,
// 2 resident blocks per SM) keep ~96 KB of loads in flight per SM, several times the H100's
// bandwidth x latency product.
#ifndef LUT_STAGES
#define LUT_STAGES 3
#endif
static_assert(LUT_STAGES >= 2 && LUT_STAGES <= 8, "LUT_STAGES must be 2..8");
// Words of a row a lane handles per pipeline step (a ring stage holds one step).
#ifndef LUT_STEP_WORDS
#define LUT_STEP_WORDS 4
#endif
static_assert(LUT_STEP_WORDS == 1 || LUT_STEP_WORDS == 2 || LUT_STEP_WORDS == 4, "LUT_STEP_WORDS must be 1, 2 or 4");
// Resident blocks per SM the register allocation must allow (shared memory allows 2 at 3 stages).
#ifndef LUT_MIN_BLOCKS
#define LUT_MIN_BLOCKS 2
#endif

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
  static constexpr int kPieces = kEntryBytes / 4;              // builder lanes per entry (4 bytes each)
  static constexpr int kStages = LUT_STAGES;                   // S: ring stages, S - 1 steps in flight
  static constexpr int kStageBytes = kStepWords * kThreads * (16 + 8);  // words + α of one step, all lanes
  // dynamic shared memory: LUT, ring, and slack to start the ring on a 128-byte boundary
  static constexpr int kSmemBytes = kLutBytes + kStages * kStageBytes + 128;
};

struct LutParams {
  const __half* x;       // [nb, d] fp16, row stride d
  const uint32_t* qw;    // [q, W, k] sign planes
  const __half* alpha;   // [G, q, k]
  const __half* offset;  // [G, k] or nullptr
  const __half* bias;    // [k] or nullptr
  __half* y;             // [nb, k] output, or nullptr: accumulate, the sums stay in ws (bias not applied)
  float* ws;             // [nb, k] fp32 partial sums, zero on entry and left zero (see lut_gemm_kernel)
  int* counters;         // [n_rt] steps finished per row tile, zero on entry and left zero; unused without y
  int nb, d, k, q, W;
  int x_vec;             // x rows start 16-byte aligned (d % 8 == 0 and an aligned base): vector loads
  uint32_t group_magic;  // group of word w = umulhi(2w+1, magic), see group_magic() below; 0 if one group
  uint32_t pow2[32];     // pow2[i] = 2^i: shifts done as multiplies by a value the compiler cannot see (below)
  int n_rt, n_ch;        // row tiles, chunks
  int planes;            // q, plus one "offset plane" when there is an offset
  long long steps;       // n_rt · n_ch · planes · NH: the pipeline steps of the whole matrix
};

// floor(w / gw) for gw = g/32 words per group, as umulhi(2w+1, ceil(2^32 / (2gw))): floor((2w+1)/(2gw))
// equals floor(w/gw), and the multiply-high is exact while (2w+1)·2gw < 2^32 (checked: W < 2^15).
inline uint32_t group_magic(int group_size, int groups) {
  if (groups == 1) return 0;
  const uint64_t div = 2ull * uint64_t(group_size / 32);
  return uint32_t(((1ull << 32) + div - 1) / div);
}

__device__ __forceinline__ uint32_t word_group(int w, uint32_t magic) { return __umulhi(2u * uint32_t(w) + 1u, magic); }

// ---- loads -------------------------------------------------------------------------------------

// α / z of 4 rows: reused by the other words of the group, so cached.
__device__ __forceinline__ uint2 load_half4(const __half* p) {
#ifdef LUTGEMM_HOST_EMU
  return *reinterpret_cast<const uint2*>(p);
#else
  return __ldg(reinterpret_cast<const uint2*>(p));
#endif
}

__device__ __forceinline__ __half load_half(const __half* p) {
#ifdef LUTGEMM_HOST_EMU
  return *p;
#else
  return __ldg(p);
#endif
}

// Workspace written by other blocks' atomics: read from L2, never from a stale L1 line.
__device__ __forceinline__ float4 load_l2(const float* p) {
#ifdef LUTGEMM_HOST_EMU
  float4 v;
  v.x = std::atomic_ref<float>(const_cast<float*>(p)[0]).load();
  v.y = std::atomic_ref<float>(const_cast<float*>(p)[1]).load();
  v.z = std::atomic_ref<float>(const_cast<float*>(p)[2]).load();
  v.w = std::atomic_ref<float>(const_cast<float*>(p)[3]).load();
  return v;
#else
  return __ldcg(reinterpret_cast<const float4*>(p));
#endif
}

// ---- the shared-memory ring (cp_async.h) ---------------------------------------------------------
// A lane copies its own words into its own ring slots and reads back only those, so no block barrier
// guards the ring: cp.async.wait_group orders a thread's copies before its own reads.
using qk::commit_async;
using qk::copy_async;
using qk::wait_async;

__device__ __forceinline__ void atomic_add4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));  // one vector red on sm_90
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
  atomicAdd(p + 2, c);
  atomicAdd(p + 3, d);
#endif
}

// Tile completion (split-K): after adding its partial sums of a row tile to the workspace, a block adds
// the steps it ran to the tile's counter; the block whose addition completes the tile's `total` steps
// gets true in every thread (the others false), resets the counter and converts the sums. One thread
// counts, after a block barrier, with an acquire-release atomic: the barrier makes the other threads'
// additions part of its release (the PTX memory model's cumulativity, the pattern of CUTLASS's split-K
// semaphore), and its acquire, followed by the barrier, orders the last block's reads of the sums.
// Measured against every thread fencing (__threadfence) before thread 0 counts, and against thread 0
// fencing alone (fence.acq_rel.gpu): 0.4-0.7 µs less per call up to 22016x4096 (BENCHMARKS.md).
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
#ifdef LUTGEMM_HOST_EMU
  return std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_acq_rel);
#else
  int old;
  asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#endif
}

__device__ __forceinline__ bool complete_tile(int* counter, int add, int total, int* s_last) {
  __syncthreads();  // every thread's additions are issued
  if (threadIdx.x == 0) {
    const bool last = atomic_add_acq_rel_gpu(counter, add) + add == total;
    if (last) *counter = 0;  // every block has counted: back to zero for the next launch
    *s_last = last;
  }
  __syncthreads();
  return *s_last;
}

__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) {
  __half2 h;
  static_assert(sizeof(h) == 4, "");
#ifdef LUTGEMM_HOST_EMU
  std::memcpy(&h, &bits, 4);
#else
  h = *reinterpret_cast<__half2*>(&bits);
#endif
  return __half22float2(h);
}

__device__ __forceinline__ uint32_t float2_to_half2_bits(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t bits;
#ifdef LUTGEMM_HOST_EMU
  std::memcpy(&bits, &h, 4);
#else
  bits = *reinterpret_cast<const uint32_t*>(&h);
#endif
  return bits;
}

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
__device__ __forceinline__ void advance(Cursor& cur, int planes, int n_ch) {
  if (++cur.h < Cfg<BP>::kSteps) return;
  cur.h = 0;
  if (++cur.i < planes) return;
  cur.i = 0;
  if (++cur.c < n_ch) return;
  cur.c = 0;
  ++cur.rt;
}

// One ring stage as this lane sees it: SW words of its 4 rows (16 bytes each) and, per word, the 4
// halves of α (or of the offset z, in the extra "offset plane" that follows the q sign planes).
struct Stage {
  uint4* w;  // [SW][kThreads]
  uint2* a;  // [SW][kThreads]
};

// Start copying step `cur` for this lane into a stage: the words (j + φ) mod NW of the chunk, j in
// this step's range. Words past the row's end, and rows past k, come in as zeros (α = 0: no contribution).
template <int BP>
__device__ __forceinline__ void issue_step(const LutParams& p, const Cursor& cur, uint32_t phi, uint32_t row0,
                                           const Stage& st, int tid) {
  using C = Cfg<BP>;
  // 32-bit element offsets (the host checks q·W·k and G·q·k < 2^31): fewer address instructions per copy
  const uint32_t k = uint32_t(p.k), W = uint32_t(p.W);
  const bool row_ok = row0 < k;
  const uint32_t w0 = uint32_t(cur.c) * C::kWords, j0 = uint32_t(cur.h) * C::kStepWords + phi;
  if (cur.i < p.q) {
    const uint32_t plane = uint32_t(cur.i) * W * k + row0, scale = uint32_t(cur.i) * k + row0, group_stride = uint32_t(p.q) * k;
#pragma unroll
    for (int jj = 0; jj < C::kStepWords; ++jj) {
      const uint32_t w = w0 + ((j0 + jj) & (C::kWords - 1));
      const bool ok = row_ok && w < W;
      copy_async<16>(st.w + jj * kThreads + tid, p.qw + (ok ? plane + w * k : 0u), ok);
      copy_async<8>(st.a + jj * kThreads + tid, p.alpha + (ok ? scale + word_group(w, p.group_magic) * group_stride : 0u), ok);
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

// ---- the matvec kernel ---------------------------------------------------------------------------

// grid: min(steps, SMs × resident blocks); block: kThreads; dynamic shared memory Cfg<BP>::kSmemBytes.
// p.ws and p.counters must be zero; the kernel leaves them zero (the block completing a tile clears
// the tile's sums and counter), so a workspace kept between launches needs no memset: one graph node
// less per matvec. Without p.y it only adds x·wᵀ into p.ws (whatever p.ws held) and stops there.
// Block b runs steps [b·S/B, (b+1)·S/B) of the sequence (row tile, chunk, plane, step): stream-K at
// step granularity, so blocks differ by at most one step of work, and a block may start or stop
// in the middle of a unit (its partial sums are just as additive).
template <int BP>
__global__ void __launch_bounds__(kThreads, LUT_MIN_BLOCKS) lut_gemm_kernel(const LutParams p) {
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

  qk::allow_next_grid();  // a grid of one wave (the default) has all its blocks running by now
  const long long s0 = p.steps * blockIdx.x / gridDim.x;
  const long long s1 = p.steps * (blockIdx.x + 1) / gridDim.x;
  if (s0 >= s1) return;  // whole block

  // [LUT][slack][ring: S stages of SW × kThreads words, then S stages of their α]. The LUT sits at a
  // fixed offset of the shared window, so a lookup is one load at [offset + window base] (sm_90 keeps
  // the base in a uniform register); aligned at run time, as it was, every lookup paid one more add
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
  const long long unit = s0 / (planes * NH);
  const int in_unit = int(s0 % (planes * NH));
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
      issue_step<BP>(p, ld, phi, ld.rt * kTileRows + row_in_tile, stage(s), tid);
      advance<BP>(ld, planes, p.n_ch);
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
      if (cur.i < p.q) w[jj] = st.w[jj * kThreads + tid];
      a[jj] = st.a[jj * kThreads + tid];
    }
    // refill the stage the previous step read (its values are consumed) with step + S - 1
    if (to_issue > 0) {
      issue_step<BP>(p, ld, phi, ld.rt * kTileRows + row_in_tile, stage(slot == 0 ? S - 1 : slot - 1), tid);
      advance<BP>(ld, planes, p.n_ch);
      --to_issue;
    }
    commit_async();

    if ((cur.i == 0 && cur.h == 0) || first) {  // a unit's first step: build its chunk's tables
      __syncthreads();  // everyone is done with the previous chunk's tables
      build_tables<BP>(lut, tsum, xh, lane, warp);
      __syncthreads();
      first = false;
    }
    const bool unit_end = cur.i == planes - 1 && cur.h == NH - 1;
    if (unit_end && remaining > 1) load_x<BP>(p, cur.c + 1 == p.n_ch ? 0 : cur.c + 1, lane, xh);  // next unit's x

    if (cur.i < p.q) {
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
          entry_fma<BP>(acc[r], al[r], sum);
        }
      }
    } else {  // offset plane: y += z · Σ_{columns of the word} x
#pragma unroll
      for (int jj = 0; jj < SW; ++jj) {
        const int wl = ((cur.h * SW + jj) + phi) & (NW - 1);
        const float2 z01 = half2_bits_to_float2(a[jj].x), z23 = half2_bits_to_float2(a[jj].y);
        const float z[4] = {z01.x, z01.y, z23.x, z23.y};
#pragma unroll
        for (int b = 0; b < BP; ++b) {
          const float xs = tsum[(4 * wl) * BP + b] + tsum[(4 * wl + 1) * BP + b] + tsum[(4 * wl + 2) * BP + b] +
                           tsum[(4 * wl + 3) * BP + b];
#pragma unroll
          for (int r = 0; r < kRowsPerLane; ++r) acc[r][b] = fmaf(z[r], xs, acc[r][b]);
        }
      }
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
      if (p.y != nullptr && complete_tile(p.counters + cur.rt, seg_steps, p.n_ch * planes * NH, &s_last) &&
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
    advance<BP>(cur, planes, p.n_ch);
    --remaining;
  }
  wait_async<0>();  // no copy may outlive the block (only empty groups remain here)
}


// ---- the tensor-core path for small batches ------------------------------------------------------
//
// At 8 columns a LUT lookup moves 16 bytes of shared memory, which bounds the LUT kernel well above
// the time to stream the weights. This kernel instead turns the sign planes into fp16 A fragments in
// registers and lets mma.sync.m16n8k16 multiply them with x (batch = the n8 side), fp32
// accumulation; α scales each plane's partial sums per group as above. It needs whole 128-column
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
// ncu showed the kernel issue-bound, and at 32 rows per warp that share was ~45 % of the instructions.
// Work is split over blocks as in the LUT kernel (stream-K by steps).
constexpr int kMmaRowsPerWarp = 64;
constexpr int kMmaTileRows = kWarps * kMmaRowsPerWarp;  // 512
constexpr int kMmaChunkWords = 4;
constexpr int kMmaMaxPlanes = 9;  // q ≤ 8 sign planes and the offset

// Ring stages: S - 1 chunks in flight per lane. A stage holds per lane its x fragment (64 bytes) and
// 2·q words (16 bytes each) and, per warp, the α / z quads of its 64 rows (the lanes copy them in
// turn; all read them after a __syncwarp): 43 KB at q = 3 for the block. 2 stages (one chunk in
// flight while one is computed) measured as fast as 3, and leave room for 2 blocks per SM up to q = 4.
#ifndef MMA_STAGES
#define MMA_STAGES 2
#endif
static_assert(MMA_STAGES >= 2 && MMA_STAGES <= 8, "MMA_STAGES must be 2..8");
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
// Resident blocks per SM the register allocation must allow (the ring allows 2 up to q = 4).
#ifndef MMA_MIN_BLOCKS
#define MMA_MIN_BLOCKS 2
#endif
// q = 1..MMA_STATIC_Q_MAX have an instance each (Q = q: the plane and copy loops unrolled, their strides
// constants); wider q share one that reads q at run time (Q = 0). H100 A/B, 2026-11-27: the per-q
// instances are 1.3-2.4 % faster at 8 columns on 49152x12288 (q2 109.7 -> 107.1 us) and 1-2 % elsewhere.
#ifndef MMA_STATIC_Q_MAX
#define MMA_STATIC_Q_MAX 4
#endif
static_assert(MMA_STATIC_Q_MAX >= 0 && MMA_STATIC_Q_MAX <= 4, "the launchers dispatch q = 1..4");
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

// ---- the dequantize kernel -----------------------------------------------------------------------

struct DequantParams {
  const uint32_t* qw;    // [q, W, k]
  const __half* alpha;   // [G, q, k]
  const __half* offset;  // [G, k] or nullptr
  void* out;             // [k, d] row-major, OutT
  int k, d, q, W, g;
};

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

constexpr int kDqRows = 32, kDqWords = 8;  // block tile: 32 rows × 8 words (256 columns)

// Exactly BCQQuantizedTensor.dequantize: fp32 sum over planes in order 0..q-1, offset last, one
// rounding to OutT. Thread (lane, warp) = (row, word), so sign/α reads are coalesced over rows; the
// 32×256 tile goes through shared memory (rows padded by 16 bytes: conflict-free 16-byte writes)
// so that the output rows are written with coalesced 16-byte stores.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const DequantParams p) {
  constexpr int kVec = 16 / sizeof(OutT);                     // elements per 16-byte store
  constexpr int kRowBytes = 32 * kDqWords * sizeof(OutT) + 16;
  __shared__ __align__(16) unsigned char tile[kDqRows * kRowBytes];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = blockIdx.x * kDqRows + lane;
  const int w = blockIdx.y * kDqWords + warp;
  const int col0 = w * 32;
  if (r < p.k && w < p.W) {
    uint32_t bits[8];
    float al[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) bits[i] = i < p.q ? p.qw[(size_t(i) * p.W + w) * p.k + r] : 0u;
    int grp = col0 / p.g;
    int next = (grp + 1) * p.g;  // first column of the next group
    float z = 0.f;
    auto load_group = [&]() {
#pragma unroll
      for (int i = 0; i < 8; ++i) al[i] = i < p.q ? __half2float(p.alpha[(size_t(grp) * p.q + i) * p.k + r]) : 0.f;
      if (p.offset != nullptr) z = __half2float(p.offset[size_t(grp) * p.k + r]);
    };
    load_group();
    OutT* trow = reinterpret_cast<OutT*>(tile + lane * kRowBytes) + warp * 32;
#pragma unroll 1
    for (int v = 0; v < 32 / kVec; ++v) {
      alignas(16) OutT vals[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int u = v * kVec + e;
        if (col0 + u == next) {  // a group boundary inside the word (g not a multiple of 32)
          ++grp;
          next += p.g;
          if (col0 + u < p.d) load_group();
        }
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (i < p.q) acc += (bits[i] >> u) & 1u ? al[i] : -al[i];
        if (p.offset != nullptr) acc += z;
        vals[e] = from_float<OutT>(acc);
      }
      *reinterpret_cast<uint4*>(trow + v * kVec) = *reinterpret_cast<const uint4*>(vals);
    }
  }
  __syncthreads();
  // write out: warp handles rows 4·warp .. 4·warp+3 of the tile
  const int cbase = blockIdx.y * kDqWords * 32;
  const int ncols = p.d - cbase < 32 * kDqWords ? p.d - cbase : 32 * kDqWords;
  OutT* out = static_cast<OutT*>(p.out);
  const bool vec = (size_t(p.d) * sizeof(OutT)) % 16 == 0;  // every row (and cbase) 16-byte aligned
  for (int rr = warp * (kDqRows / kWarps); rr < (warp + 1) * (kDqRows / kWarps); ++rr) {
    const int row = blockIdx.x * kDqRows + rr;
    if (row >= p.k) break;
    const OutT* src = reinterpret_cast<const OutT*>(tile + rr * kRowBytes);
    OutT* dst = out + size_t(row) * p.d + cbase;
    if (vec) {
      for (int e = lane * kVec; e < ncols; e += 32 * kVec)
        *reinterpret_cast<uint4*>(dst + e) = *reinterpret_cast<const uint4*>(src + e);
    } else {
      for (int e = lane; e < ncols; e += 32) dst[e] = src[e];
    }
  }
}

// ---- host side shared by the CUDA op and the emulation -----------------------------------------

inline int padded_batch(int nb) { return nb <= 1 ? 1 : nb <= 2 ? 2 : nb <= 4 ? 4 : 8; }

inline int chunk_cols(int bp) { return bp == 1 ? Cfg<1>::kChunkCols : bp == 2 ? Cfg<2>::kChunkCols : bp == 4 ? Cfg<4>::kChunkCols : Cfg<8>::kChunkCols; }
inline int steps_per_plane(int bp) { return bp == 1 ? Cfg<1>::kSteps : bp == 2 ? Cfg<2>::kSteps : bp == 4 ? Cfg<4>::kSteps : Cfg<8>::kSteps; }

// Row tiles of the LUT kernel.
inline int row_tiles(int k) { return (k + kTileRows - 1) / kTileRows; }
// Per-tile counters one launch may need (the tensor-core path has the smaller tiles).
inline int max_row_tiles(int k) { return (k + kMmaTileRows - 1) / kMmaTileRows; }

// Whether the tensor-core path can serve a weight: whole 128-column chunks per group.
inline bool mma_supported(int group_size, int groups) { return groups == 1 || group_size % 128 == 0; }

inline LutParams make_lut_params(const __half* x, int nb, int d, const uint32_t* qw, const __half* alpha,
                                 const __half* offset, const __half* bias, __half* y, float* ws, int* counters,
                                 int q, int W, int k, int G, int g) {
  LutParams p{};
  p.x = x, p.qw = qw, p.alpha = alpha, p.offset = offset, p.bias = bias, p.y = y, p.ws = ws, p.counters = counters;
  p.nb = nb, p.d = d, p.k = k, p.q = q, p.W = W;
  p.x_vec = d % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  p.group_magic = group_magic(g, G);
  for (int i = 0; i < 32; ++i) p.pow2[i] = 1u << i;
  p.n_rt = row_tiles(k);
  const int cw = chunk_cols(padded_batch(nb)) / 32;
  p.n_ch = (W + cw - 1) / cw;
  p.planes = q + (offset != nullptr ? 1 : 0);
  p.steps = (long long)p.n_rt * p.n_ch * p.planes * steps_per_plane(padded_batch(nb));
  return p;
}

inline LutParams make_mma_params(LutParams p) {  // from make_lut_params: re-tile for bcq_mma_kernel
  p.n_rt = (p.k + kMmaTileRows - 1) / kMmaTileRows;
  p.n_ch = (p.W + kMmaChunkWords - 1) / kMmaChunkWords;
  p.steps = (long long)p.n_rt * p.n_ch;  // a step is a whole chunk, all planes
  return p;
}

inline int lut_grid(const LutParams& p, int max_blocks) {
  return int(p.steps < max_blocks ? p.steps : max_blocks);
}

}  // namespace lutgemm

#ifndef LUTGEMM_HOST_EMU
// ---- launchers and the PyTorch ops (bound in lutgemm.cpp) -------------------------------------
// The ops live here, in the nvcc-compiled unit; their checks are QK_CHECKs (check.h says why).

#include <ATen/core/Tensor.h>

#include <algorithm>

#include "check.h"
#include "kernel_attrs.h"
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // the stream c10::cuda::getCurrentCUDAStream() returns, without cuBLAS headers

#include <optional>

namespace {
// The LUT kernel for BP padded columns, its dynamic shared memory allowed on the current device.
template <int BP>
auto lut_kernel() {
  qk::configure_once<lutgemm::lut_gemm_kernel<BP>>(lutgemm::Cfg<BP>::kSmemBytes, -1);  // a failure shows at launch
  return lutgemm::lut_gemm_kernel<BP>;
}

template <int BP>
int lut_resident_blocks() {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, lut_kernel<BP>(), lutgemm::kThreads, lutgemm::Cfg<BP>::kSmemBytes);
  return n;
}

// The tensor-core kernel, its dynamic shared memory (the ring; it depends on q) allowed on the current
// device, with all of L1 as shared memory so the blocks the occupancy query counts fit.
template <int Q>
auto mma_kernel_q() {
  qk::configure_once<lutgemm::bcq_mma_kernel<Q>>(lutgemm::kMmaMaxSmemBytes, 100);  // a failure shows at launch
  return lutgemm::bcq_mma_kernel<Q>;
}

// the instance for q sign planes: compiled for that q up to MMA_STATIC_Q_MAX, else q read at run time
auto mma_kernel(int q) {
  if (q <= MMA_STATIC_Q_MAX) {
    switch (q) {
      case 1: return mma_kernel_q<1>();
      case 2: return mma_kernel_q<2>();
      case 3: return mma_kernel_q<3>();
      case 4: return mma_kernel_q<4>();
      default: break;
    }
  }
  return mma_kernel_q<0>();
}

inline int mma_smem_bytes(int q, int planes) { return MMA_STAGES * lutgemm::mma_stage_bytes(q, planes); }

// Resident blocks per SM of each kernel (bp = 0: the tensor-core kernel, whose ring grows with the
// planes), asked once per process (one GPU model assumed).
int resident_blocks(int bp, int planes = 0, int q = 0) {
  static int cached[4] = {0, 0, 0, 0};
  static int cached_mma[lutgemm::kMmaMaxPlanes + 1][9] = {};
  int& slot = bp == 0 ? cached_mma[planes][q] : cached[bp == 1 ? 0 : bp == 2 ? 1 : bp == 4 ? 2 : 3];
  if (slot == 0) {
    int n = 0;
    if (bp == 0) {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, mma_kernel(q), lutgemm::kThreads, mma_smem_bytes(q, planes));
    } else if (bp == 1) n = lut_resident_blocks<1>();
    else if (bp == 2) n = lut_resident_blocks<2>();
    else if (bp == 4) n = lut_resident_blocks<4>();
    else n = lut_resident_blocks<8>();
    slot = n > 0 ? n : 1;
  }
  return slot;
}
}  // namespace

// Floats of zeroed workspace lutgemm_cuda_gemm needs for n columns of x and k rows.
size_t lutgemm_workspace_floats(int64_t n, int64_t k) {
  const int64_t launches = (n + lutgemm::kMaxBatch - 1) / lutgemm::kMaxBatch;
  return size_t(n * k + launches * lutgemm::max_row_tiles(int(k)));
}

// y[n, k] = x[n, d] · wᵀ (+ bias), all fp16, as launches of at most 8 columns on `stream`; a launch
// of at least mma_min_batch columns takes the tensor-core kernel when the groups allow it.
// ws: lutgemm_workspace_floats(n, k) zeroed floats, zero again on return. Without y (nullptr):
// ws[n, k] += x · wᵀ in fp32, bias ignored, counters untouched. overlap: programmatic dependent
// launches (grid_dependency.h; sm_90+ only). Returns the first launch error.
cudaError_t lutgemm_cuda_gemm(const void* x, int n, int d, const int* qweight, const void* alpha, const void* offset,
                              const void* bias, void* y, float* ws, int q, int W, int k, int G, int g, int mma_min_batch,
                              int blocks, bool overlap, int device, cudaStream_t stream) {
  using namespace lutgemm;
  static int sm_count[64] = {0};  // per device, asked once
  cudaError_t err = cudaSuccess;
  int sms = device >= 0 && device < 64 ? sm_count[device] : 0;
  if (sms == 0) {
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < 64) sm_count[device] = sms;
  }
  const int launches = (n + kMaxBatch - 1) / kMaxBatch, n_rt = max_row_tiles(k);
  overlap = overlap && qk::overlap_supported<lut_gemm_kernel<1>>(device);  // one build: one answer for all
  int* counters = reinterpret_cast<int*>(ws + size_t(n) * k);  // zero bits are int 0
  for (int l = 0; l < launches; ++l) {
    const int nb = n - l * kMaxBatch < kMaxBatch ? n - l * kMaxBatch : kMaxBatch;
    const LutParams p = make_lut_params(static_cast<const __half*>(x) + size_t(l) * kMaxBatch * d, nb, d,
                                        reinterpret_cast<const uint32_t*>(qweight), static_cast<const __half*>(alpha),
                                        static_cast<const __half*>(offset), static_cast<const __half*>(bias),
                                        y ? static_cast<__half*>(y) + size_t(l) * kMaxBatch * k : nullptr,
                                        ws + size_t(l) * kMaxBatch * k, counters + l * n_rt, q, W, k, G, g);
    const int bp = padded_batch(nb);
    if (nb >= mma_min_batch && mma_supported(g, G)) {
      const LutParams pm = make_mma_params(p);
      const int grid = lut_grid(pm, blocks > 0 ? blocks : sms * resident_blocks(0, pm.planes, pm.q));
      err = qk::launch_kernel(mma_kernel(pm.q), grid, kThreads, mma_smem_bytes(pm.q, pm.planes), stream, overlap, pm);
      if (err != cudaSuccess) return err;
      continue;
    }
    const int grid = lut_grid(p, blocks > 0 ? blocks : sms * resident_blocks(bp));
    if (bp == 1) err = qk::launch_kernel(lut_kernel<1>(), grid, kThreads, Cfg<1>::kSmemBytes, stream, overlap, p);
    else if (bp == 2) err = qk::launch_kernel(lut_kernel<2>(), grid, kThreads, Cfg<2>::kSmemBytes, stream, overlap, p);
    else if (bp == 4) err = qk::launch_kernel(lut_kernel<4>(), grid, kThreads, Cfg<4>::kSmemBytes, stream, overlap, p);
    else err = qk::launch_kernel(lut_kernel<8>(), grid, kThreads, Cfg<8>::kSmemBytes, stream, overlap, p);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// out[k, d] = the dense weight; out_kind 0 = fp16, 1 = bf16, 2 = fp32.
cudaError_t lutgemm_cuda_dequantize(const int* qweight, const void* alpha, const void* offset, void* out, int out_kind,
                                    int k, int d, int q, int W, int g, cudaStream_t stream) {
  using namespace lutgemm;
  DequantParams p{};
  p.qw = reinterpret_cast<const uint32_t*>(qweight);
  p.alpha = static_cast<const __half*>(alpha);
  p.offset = static_cast<const __half*>(offset);
  p.out = out;
  p.k = k, p.d = d, p.q = q, p.W = W, p.g = g;
  const dim3 grid((k + kDqRows - 1) / kDqRows, (W + kDqWords - 1) / kDqWords);
  if (out_kind == 0) dequant_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  else if (out_kind == 1) dequant_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  else dequant_kernel<float><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// ---- the PyTorch ops: argument checks (shapes, dtypes, devices) with messages that name both sides,
// then the launchers on the current stream. No allocation other than the zeroed split-K workspace
// (through the caching allocator), no synchronisation: the ops can be captured in a CUDA graph.

namespace {

const void* ptr_or_null(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// The kernels read 4 rows at a time with vector loads: tensors (views included) must start aligned.
void check_aligned(const at::Tensor& t, int bytes, const char* name) {
  QK_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, name, " must start at a ", bytes,
              "-byte aligned address (pass a fresh contiguous tensor, not an offset view)");
}

// The stored BCQ tensors of quantkit/formats/bcq.py for a [k, d] weight.
void check_bcq(const at::Tensor& qweight, const at::Tensor& alpha, const std::optional<at::Tensor>& offset,
               int64_t group_size, int64_t d) {
  QK_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.dim() == 3 && qweight.is_contiguous(),
              "qweight must be a contiguous CUDA int32 tensor [q, W, k], got ", qweight.sizes(), " ",
              qweight.scalar_type(), " on ", qweight.device());
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2);
  QK_CHECK(q >= 1 && q <= 8, "BCQ kernels take 1..8 planes, got q = ", q);
  QK_CHECK(group_size >= 1, "group_size must be positive, got ", group_size);
  QK_CHECK(W == (d + 31) / 32, "qweight has ", W, " words per row but in_features = ", d, " needs ", (d + 31) / 32);
  QK_CHECK(W < (1 << 15), "in_features = ", d, " is above the kernels' limit of 2^20 columns");
  QK_CHECK(k < (int64_t(1) << 30), "out_features = ", k, " is above the kernels' limit of 2^30 rows");
  const int64_t G = (d + group_size - 1) / group_size;
  QK_CHECK(alpha.scalar_type() == at::kHalf && alpha.is_contiguous() && alpha.sizes() == at::IntArrayRef({G, q, k}),
              "alpha must be a contiguous fp16 tensor [G, q, k] = [", G, ", ", q, ", ", k, "], got ", alpha.sizes(), " ",
              alpha.scalar_type());
  QK_CHECK(alpha.device() == qweight.device(), "alpha is on ", alpha.device(), " but qweight on ", qweight.device());
  if (offset.has_value()) {
    const at::Tensor& z = *offset;
    QK_CHECK(z.scalar_type() == at::kHalf && z.is_contiguous() && z.sizes() == at::IntArrayRef({G, k}),
                "offset must be a contiguous fp16 tensor [G, k] = [", G, ", ", k, "], got ", z.sizes(), " ",
                z.scalar_type());
    QK_CHECK(z.device() == qweight.device(), "offset is on ", z.device(), " but qweight on ", qweight.device());
  }
}

// The checks lut_gemm and lut_accumulate share: x and the BCQ tensors, and the LUT kernel's limits.
void check_lut_operands(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                        const std::optional<at::Tensor>& offset, int64_t group_size) {
  QK_CHECK(x.is_cuda() && x.scalar_type() == at::kHalf && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CUDA fp16 tensor [n, d], got ", x.sizes(), " ", x.scalar_type(), " on ", x.device());
  const int64_t d = x.size(1);
  check_bcq(qweight, alpha, offset, group_size, d);
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2), G = alpha.size(0);
  QK_CHECK(x.device() == qweight.device(), "x is on ", x.device(), " but qweight on ", qweight.device());
  QK_CHECK(k % 4 == 0, "the LUT kernel needs out_features % 4 == 0, got ", k, " (use dequantize)");
  QK_CHECK(q * W * k < (int64_t(1) << 31) && G * q * k < (int64_t(1) << 31),
           "the LUT kernel addresses a weight with 32-bit offsets: q x words x out_features = ", q * W * k,
           " must stay below 2^31 (use dequantize)");
  QK_CHECK(group_size % 32 == 0 || G == 1, "the LUT kernel needs group_size % 32 == 0 or one group per row, got g = ",
              group_size, " with in_features = ", d, " (use dequantize)");
  check_aligned(qweight, 16, "qweight");
  check_aligned(alpha, 8, "alpha");
  if (offset.has_value()) check_aligned(*offset, 8, "offset");
}

void check_workspace(const at::Tensor& ws, int64_t floats, const at::Tensor& x, const char* name) {
  QK_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.numel() >= floats && ws.device() == x.device(),
           name, " must be a contiguous fp32 tensor of at least ", floats, " elements on ", x.device(), ", got ",
           ws.sizes(), " ", ws.scalar_type(), " on ", ws.device());
  check_aligned(ws, 16, name);
}

void launch_lut_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                     const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                     int64_t group_size, void* out, float* ws, int64_t mma_min_batch, int64_t blocks, bool overlap) {
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2), G = alpha.size(0);
  const cudaError_t err = lutgemm_cuda_gemm(x.data_ptr(), int(x.size(0)), int(x.size(1)), qweight.data_ptr<int>(),
                                            alpha.data_ptr(), ptr_or_null(offset), ptr_or_null(bias), out, ws,
                                            int(q), int(W), int(k), int(G), int(group_size),
                                            int(std::min<int64_t>(mma_min_batch, lutgemm::kMaxBatch + 1)),
                                            int(std::clamp<int64_t>(blocks, 0, 1 << 20)), overlap, x.device().index(),
                                            c10::cuda::getCurrentCUDAStream());
  QK_CHECK(err == cudaSuccess, "lut_gemm launch failed for x [", x.size(0), ", ", x.size(1), "], weight ", k, "x",
              x.size(1), ", q = ", q, ", g = ", group_size, ", offset = ", offset.has_value(), ": ",
              cudaGetErrorString(err));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int64_t lutgemm_workspace_floats_op(int64_t n, int64_t k) {
  QK_CHECK(n >= 0 && k >= 0, "workspace_floats needs n, k >= 0, got ", n, ", ", k);
  return int64_t(lutgemm_workspace_floats(n, k));
}

// out[n, k] = x[n, d] @ wᵀ (+ bias), fp16 in and out, written into `out`. Launches of at least
// mma_min_batch columns (of at most 8 each) run on the tensor-core kernel when group_size % 128 == 0
// or there is one group per row; kMaxBatch + 1 keeps every launch on the LUT kernel.
void lutgemm_lut_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                      const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                      int64_t group_size, const at::Tensor& out, int64_t mma_min_batch,
                      const std::optional<at::Tensor>& workspace, int64_t blocks, bool overlap) {
  check_lut_operands(x, qweight, alpha, offset, group_size);
  const int64_t n = x.size(0), k = qweight.size(2);
  QK_CHECK(out.scalar_type() == at::kHalf && out.is_contiguous() && out.sizes() == at::IntArrayRef({n, k}) &&
                  out.device() == x.device(),
              "out must be a contiguous fp16 tensor [", n, ", ", k, "] on ", x.device(), ", got ", out.sizes(), " ",
              out.scalar_type(), " on ", out.device());
  if (bias.has_value()) {
    QK_CHECK(bias->scalar_type() == at::kHalf && bias->is_contiguous() && bias->numel() == k &&
                    bias->device() == x.device(),
                "bias must be a contiguous fp16 tensor of ", k, " elements on ", x.device(), ", got ", bias->sizes(), " ",
                bias->scalar_type(), " on ", bias->device());
    check_aligned(*bias, 8, "bias");
  }
  check_aligned(out, 8, "out");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t ws_floats = int64_t(lutgemm_workspace_floats(n, k));
  at::Tensor ws;
  if (workspace.has_value()) {  // kept by the caller, all zero: the kernels leave it zero again
    ws = *workspace;
    check_workspace(ws, ws_floats, x, "workspace");
  } else {
    ws = at::zeros({ws_floats}, x.options().dtype(at::kFloat));
  }
  launch_lut_gemm(x, qweight, alpha, offset, bias, group_size, out.data_ptr(), ws.data_ptr<float>(), mma_min_batch,
                  blocks, overlap);
}

// acc[0 : n·k] (fp32, read as [n, k]) += x[n, d] @ wᵀ: the same kernels stopping at their fp32 partial sums,
// with no tile counter, read-back or fp16 output. The next kernel reads acc and clears it (runtime.fusion).
void lutgemm_lut_accumulate(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                            const std::optional<at::Tensor>& offset, int64_t group_size, const at::Tensor& acc,
                            int64_t mma_min_batch, int64_t blocks, bool overlap) {
  check_lut_operands(x, qweight, alpha, offset, group_size);
  check_workspace(acc, x.size(0) * qweight.size(2), x, "acc");
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  launch_lut_gemm(x, qweight, alpha, offset, std::nullopt, group_size, nullptr, acc.data_ptr<float>(), mma_min_batch,
                  blocks, overlap);
}

// out[k, d] (fp16, bf16 or fp32) = the dense weight, bit-identical to BCQQuantizedTensor.dequantize(out.dtype).
void lutgemm_dequantize(const at::Tensor& qweight, const at::Tensor& alpha, const std::optional<at::Tensor>& offset,
                        int64_t group_size, const at::Tensor& out) {
  QK_CHECK(out.dim() == 2 && out.is_contiguous(), "out must be a contiguous tensor [k, d], got ", out.sizes());
  const int64_t d = out.size(1);
  check_bcq(qweight, alpha, offset, group_size, d);
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2);
  QK_CHECK(out.size(0) == k && out.device() == qweight.device(), "out must be [", k, ", ", d, "] on ",
              qweight.device(), ", got ", out.sizes(), " on ", out.device());
  int kind = 0;
  switch (out.scalar_type()) {
    case at::kHalf: kind = 0; break;
    case at::kBFloat16: kind = 1; break;
    case at::kFloat: kind = 2; break;
    default: QK_CHECK(false, "dequantize writes fp16, bf16 or fp32, not ", out.scalar_type());
  }
  if (k == 0 || d == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaError_t err = lutgemm_cuda_dequantize(qweight.data_ptr<int>(), alpha.data_ptr(), ptr_or_null(offset),
                                                  out.data_ptr(), kind, int(k), int(d), int(q), int(W),
                                                  int(group_size), c10::cuda::getCurrentCUDAStream());
  QK_CHECK(err == cudaSuccess, "dequantize launch failed for weight ", k, "x", d, ", q = ", q, ", g = ", group_size,
              ", out ", out.scalar_type(), ": ", cudaGetErrorString(err));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}


#else
// ---- host emulation driver (CPU tests): one std::thread per CUDA thread, blocks one at a time ---
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

namespace emu {
template <class Kernel>
void launch(dim3 grid, int threads, Kernel kernel) {
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> block_bar(threads);
      std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
      for (int w = 0; w < threads / 32; ++w) warp_bars.push_back(std::make_unique<std::barrier<>>(32));
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          tid = uint3{unsigned(t), 0, 0};
          bid = uint3{bx, by, 0};
          gdim = uint3{grid.x, grid.y, 1};
          bdim = uint3{unsigned(threads), 1, 1};
          bar = &block_bar;
          warp_bar = warp_bars[t / 32].get();
          kernel();
        });
      for (auto& th : ts) th.join();
    }
}

template <class T>
std::vector<T> read_file(const std::string& path, size_t count) {
  std::vector<T> v(count);
  std::ifstream f(path, std::ios::binary);
  if (!f || !f.read(reinterpret_cast<char*>(v.data()), std::streamsize(count * sizeof(T)))) {
    std::fprintf(stderr, "cannot read %zu values from %s\n", count, path.c_str());
    std::exit(2);
  }
  return v;
}

template <class T>
void write_file(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
}
}  // namespace emu

// usage: lutgemm_emu gemm DIR n d k q g has_offset has_bias max_blocks mma_min_batch
//        lutgemm_emu accumulate DIR n d k q g has_offset 0 max_blocks mma_min_batch
//        lutgemm_emu dequant DIR d k q g has_offset out_bytes(2 = fp16, 3 = bf16, 4 = fp32)
// DIR holds qweight.bin (int32 [q,W,k]), alpha.bin (fp16 [G,q,k]), offset.bin, x.bin (fp16 [n,d]),
// bias.bin; the result goes to DIR/y.bin (fp16 [n,k]), DIR/acc.bin (fp32 [n,k]: what accumulate adds to
// the zero workspace) or DIR/w.bin ([k,d]). Output buffers start as NaN so an element the kernel skips
// shows up.
int main(int argc, char** argv) {
  using namespace lutgemm;
  if (argc < 3) return 2;
  const std::string mode = argv[1], dir = std::string(argv[2]) + "/";
  auto arg = [&](int i) { return std::stoi(argv[i]); };
  if ((mode == "gemm" || mode == "accumulate") && argc == 12) {
    const bool accumulate = mode == "accumulate";
    const int n = arg(3), d = arg(4), k = arg(5), q = arg(6), g = arg(7), has_off = arg(8), has_bias = arg(9),
              max_blocks = arg(10), mma_min_batch = arg(11);
    const int W = (d + 31) / 32, G = (d + g - 1) / g;
    auto qw = emu::read_file<uint32_t>(dir + "qweight.bin", size_t(q) * W * k);
    auto al = emu::read_file<__half>(dir + "alpha.bin", size_t(G) * q * k);
    std::vector<__half> z, bias;
    if (has_off) z = emu::read_file<__half>(dir + "offset.bin", size_t(G) * k);
    if (has_bias) bias = emu::read_file<__half>(dir + "bias.bin", size_t(k));
    auto x = emu::read_file<__half>(dir + "x.bin", size_t(n) * d);
    std::vector<__half> y(size_t(n) * k, __float2half(NAN));
    const int launches = (n + kMaxBatch - 1) / kMaxBatch, n_rt = max_row_tiles(k);
    std::vector<float> ws(size_t(n) * k + size_t(launches) * n_rt, 0.f);
    int* counters = reinterpret_cast<int*>(ws.data() + size_t(n) * k);
    for (int l = 0; l < launches; ++l) {
      const int nb = std::min(kMaxBatch, n - l * kMaxBatch);
      const LutParams p = make_lut_params(x.data() + size_t(l) * kMaxBatch * d, nb, d, qw.data(), al.data(),
                                          has_off ? z.data() : nullptr, has_bias ? bias.data() : nullptr,
                                          accumulate ? nullptr : y.data() + size_t(l) * kMaxBatch * k,
                                          ws.data() + size_t(l) * kMaxBatch * k,
                                          counters + l * n_rt, q, W, k, G, g);
      if (nb >= mma_min_batch && mma_supported(g, G)) {
        const LutParams pm = make_mma_params(p);
        const dim3 grid(lut_grid(pm, max_blocks));
        switch (q <= MMA_STATIC_Q_MAX ? q : 0) {
          case 1: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<1>(pm); }); break;
          case 2: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<2>(pm); }); break;
          case 3: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<3>(pm); }); break;
          case 4: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<4>(pm); }); break;
          default: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<0>(pm); }); break;
        }
        continue;
      }
      const dim3 grid(lut_grid(p, max_blocks));
      switch (padded_batch(nb)) {
        case 1: emu::launch(grid, kThreads, [&] { lut_gemm_kernel<1>(p); }); break;
        case 2: emu::launch(grid, kThreads, [&] { lut_gemm_kernel<2>(p); }); break;
        case 4: emu::launch(grid, kThreads, [&] { lut_gemm_kernel<4>(p); }); break;
        default: emu::launch(grid, kThreads, [&] { lut_gemm_kernel<8>(p); }); break;
      }
    }
    if (accumulate) {  // the sums stay; the counters must not have moved
      for (size_t i = size_t(n) * k; i < ws.size(); ++i)
        if (ws[i] != 0.f) {
          std::fprintf(stderr, "accumulate touched counter %zu\n", i - size_t(n) * k);
          return 3;
        }
      emu::write_file(dir + "acc.bin", std::vector<float>(ws.begin(), ws.begin() + size_t(n) * k));
      return 0;
    }
    for (size_t i = 0; i < ws.size(); ++i)
      if (ws[i] != 0.f) {  // a later launch on the same workspace would add to it
        std::fprintf(stderr, "workspace not left zero at float %zu of %zu\n", i, ws.size());
        return 3;
      }
    emu::write_file(dir + "y.bin", y);
    return 0;
  }
  if (mode == "dequant" && argc == 9) {
    const int d = arg(3), k = arg(4), q = arg(5), g = arg(6), has_off = arg(7), out_bytes = arg(8);
    const int W = (d + 31) / 32, G = (d + g - 1) / g;
    auto qw = emu::read_file<uint32_t>(dir + "qweight.bin", size_t(q) * W * k);
    auto al = emu::read_file<__half>(dir + "alpha.bin", size_t(G) * q * k);
    std::vector<__half> z;
    if (has_off) z = emu::read_file<__half>(dir + "offset.bin", size_t(G) * k);
    DequantParams p{};
    p.qw = qw.data(), p.alpha = al.data(), p.offset = has_off ? z.data() : nullptr;
    p.k = k, p.d = d, p.q = q, p.W = W, p.g = g;
    const dim3 grid((k + kDqRows - 1) / kDqRows, (W + kDqWords - 1) / kDqWords);
    const size_t elems = size_t(k) * d;
    std::vector<unsigned char> out(elems * (out_bytes == 3 ? 2 : out_bytes), 0xFF);  // NaN in every format
    p.out = out.data();
    if (out_bytes == 2) emu::launch(grid, kThreads, [&] { dequant_kernel<__half>(p); });
    else if (out_bytes == 3) emu::launch(grid, kThreads, [&] { dequant_kernel<__nv_bfloat16>(p); });
    else emu::launch(grid, kThreads, [&] { dequant_kernel<float>(p); });
    emu::write_file(dir + "w.bin", out);
    return 0;
  }
  std::fprintf(stderr, "bad arguments\n");
  return 2;
}
#endif
