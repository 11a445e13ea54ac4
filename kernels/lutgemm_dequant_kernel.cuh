// The dequantize kernel of LUT-GEMM: the dense weight [k, d] (fp16, bf16 or fp32) from the BCQ tensors,
// bit-identical to BCQQuantizedTensor.dequantize; large batches then run through cuBLAS.
//
//   block tile: 32 rows × 8 words (256 columns); grid (ceil(k / 32), ceil(W / 8)); 8 warps
//
//              word 0    word 1          word 7
//            ┌─────────┬─────────┬─────┬─────────┐
//   row 0    │ w0 l0   │ w1 l0   │ ... │ w7 l0   │   thread (lane l, warp w) = (row l, word w): it
//   row 1    │ w0 l1   │ w1 l1   │     │ w7 l1   │   expands the 32 columns of word w of row l, so
//   ...      │ ...     │         │     │         │   sign and α reads are coalesced over rows
//   row 31   │ w0 l31  │ w1 l31  │ ... │ w7 l31  │
//            └─────────┴─────────┴─────┴─────────┘
//   The tile goes through shared memory; then warp w writes rows 4w..4w+3 with 16-byte stores along the row.
#pragma once

#include "lutgemm_common.cuh"

namespace lutgemm {

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

}  // namespace lutgemm
