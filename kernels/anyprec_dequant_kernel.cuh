// The any-precision dequantize kernel: the k-bit weight [M, N] (fp16, bf16 or fp32) from the natural-layout
// planes, for batches the matvec kernel does not serve (then cuBLAS runs the product).
//
//   grid (M rows, ceil(W / 128) word blocks); block = 128 threads:
//     the block loads row `blockIdx.x`'s 2^k centroids into shared memory (in the output type),
//     thread i expands word 128·blockIdx.y + i of that row: its k plane words -> 32 codes -> 32 values,
//     written with 16-byte stores where the row allows it.
#pragma once

#include "anyprec_bits.cuh"

namespace anyprec {

// bits of the stored fp16 centroid in the output type
template <typename OutT>
__device__ __forceinline__ uint32_t centroid_out_bits(uint16_t h) {
  if constexpr (std::is_same<OutT, float>::value) return half_to_float_bits(h);
  else return centroid_bits<OutT>(h);
}

// Dequantize k bits from natural-layout planes into out [M, N] (row-major). One block per
// (row, 128 words): the row's table goes to shared memory, each thread expands one word.
template <typename OutT>
__global__ void __launch_bounds__(128) dequant_kernel(const uint32_t* __restrict__ planes, int M, int W, int wstride,
                                                      int N, const uint16_t* __restrict__ lut, int K,
                                                      OutT* __restrict__ out) {
  constexpr int EB = sizeof(OutT);  // 2 or 4 bytes per element
  __shared__ uint32_t table[256];
  const int row = blockIdx.x;
  for (int i = threadIdx.x; i < (1 << K); i += blockDim.x) table[i] = centroid_out_bits<OutT>(lut[size_t(row) * (1 << K) + i]);
  __syncthreads();
  const int w = blockIdx.y * blockDim.x + threadIdx.x;
  if (w >= W) return;
  uint32_t R[8];
#pragma unroll
  for (int p = 0; p < 8; ++p) R[p] = p < K ? __ldg(planes + (size_t(p) * M + row) * wstride + w) : 0u;
  uint32_t vals[32];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // byte i of m = code of column 8i + j (stored order: plane p is code bit K-1-p)
    uint32_t m = 0;
#pragma unroll
    for (int p = 0; p < 8; ++p)
      if (p < K) m |= ((R[p] >> j) & 0x01010101u) << (K - 1 - p);
#pragma unroll
    for (int i = 0; i < 4; ++i) vals[8 * i + j] = table[(m >> (8 * i)) & 0xFF];
  }
  OutT* dst = out + size_t(row) * N + 32 * w;
  if (32 * w + 32 <= N && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    constexpr int PER = 16 / EB;  // elements per 16-byte store
#pragma unroll
    for (int i = 0; i < 32; i += PER) {
      uint32_t u[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) u[q] = EB == 4 ? vals[i + q] : (vals[i + 2 * q] | (vals[i + 2 * q + 1] << 16));
      *reinterpret_cast<uint4*>(dst + i) = make_uint4(u[0], u[1], u[2], u[3]);
    }
  } else {
    for (int i = 0; i < 32 && 32 * w + i < N; ++i) {
      if constexpr (EB == 4) reinterpret_cast<uint32_t*>(dst)[i] = vals[i];
      else reinterpret_cast<uint16_t*>(dst)[i] = uint16_t(vals[i]);
    }
  }
}

}  // namespace anyprec
