// What the LUT-GEMM kernels share: the BCQ operands, the launch parameters, loads, and the split-K
// completion of a row tile. Included by the kernel headers (lutgemm_lut_kernel.cuh, lutgemm_mma_kernel.cuh,
// lutgemm_dequant_kernel.cuh); compiles under nvcc and, with -DLUTGEMM_HOST_EMU, as plain C++ for the CPU
// emulation (lutgemm_emu.h / lutgemm_emu.cpp).
//
// The kernels compute y[b, r] = Σ_c w[r, c]·x[b, c] (+ bias[r]) for a BCQ weight (quantkit/formats/bcq.py)
//   w[r, c] = Σ_i alpha[c/g, i, r]·(2·bit_i[r, c] − 1) + offset[c/g, r]
// straight from the packed planes: qweight int32 [q, W, k] (rows fastest; byte m of word w holds the
// 8-column sub-vector 32w+8m..32w+8m+7), alpha fp16 [G, q, k], offset fp16 [G, k]. Where α_i = 2^i·α_0 for every
// group and row (a uniform weight's BCQ form: α_i = 2^(i−1)·s), the LUT kernel also takes alpha as [G, 1, k] for
// up to kCompactAlphaMaxBatch columns and makes α_i from α_0: 3 of 4 planes' scales not read at q = 4 (compact
// α; the tensor-core kernel and dequantize read the full tensor).
//
// The matvec kernels split the work over blocks "stream-K": every block runs a contiguous range of the
// matrix's pipeline steps, so a row tile's columns may be spread over several blocks. Each block adds
// its fp32 partial sums of a row tile to a workspace with atomics; the block that completes the tile
// (complete_tile below) converts the sums to fp16, adds the bias and clears the workspace again. With no
// output ("accumulate") the sums stay in the workspace for the next kernel to read and clear.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifdef LUTGEMM_HOST_EMU
#include "lutgemm_emu.h"
#define QK_HOST_EMU
#else
#include <cuda_runtime.h>
#endif
#include "cp_async.cuh"
#include "grid_dependency.cuh"
#include "lutgemm_tuning.h"

namespace lutgemm {

constexpr int kThreads = 256;  // 8 warps; the table builder relies on 8 warps = 8 values of key bits 5..7
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerLane = 4;
constexpr int kRowsPerWarp = 32 * kRowsPerLane;
constexpr int kTileRows = kWarps * kRowsPerWarp;  // 1024
constexpr int kLutBytes = 256 * 128;              // 256 keys × (NT tables × E bytes = 128)
constexpr int kMaxBatch = 8;
constexpr int kCompactAlphaMaxBatch = 2;  // columns per launch that compact α serves (its COMPACT_ALPHA instances)

struct LutParams {
  const __half* x;       // [nb, d] fp16, row stride d
  const uint32_t* qw;    // [q, W, k] sign planes
  const __half* alpha;   // [G, q, k], or [G, 1, k] (compact α, LUT kernel only)
  const __half* offset;  // [G, k] or nullptr
  const __half* bias;    // [k] or nullptr
  __half* y;             // [nb, k] output, or nullptr: accumulate, the sums stay in ws (bias not applied)
  float* ws;             // [nb, k] fp32 partial sums, zero on entry and left zero (see lut_gemm_kernel)
  int* counters;         // [n_rt] steps finished per row tile, zero on entry and left zero; unused without y
  int nb, d, k, q, W;
  int x_vec;             // x rows start 16-byte aligned (d % 8 == 0 and an aligned base): vector loads
  uint32_t group_magic;  // group of word w = umulhi(2w+1, magic), see group_magic() below; 0 if one group
  uint32_t pow2[32];     // pow2[i] = 2^i: shifts done as multiplies by a value the compiler cannot see (lut_gemm_kernel)
  int n_rt, n_ch;        // row tiles, chunks
  int planes;            // q, plus one "offset plane" when there is an offset
  long long steps;       // n_rt · n_ch · (q · NH + offset steps): the pipeline steps of the whole matrix
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

// ---- the shared-memory ring (cp_async.cuh) -------------------------------------------------------
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
// This is cheaper than a __threadfence in every thread, or a fence.acq_rel.gpu in thread 0, before the
// count (bench_lutgemm.py, up to 22016x4096).
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

}  // namespace lutgemm
