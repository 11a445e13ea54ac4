// Per-device kernel attributes of the matvec kernels (lutgemm.cu, anyprec.cu launch them): more than the default
// 48 KB of dynamic shared memory, and the shared-memory carveout. Function attributes belong to the
// current device's context, so a process that serves two GPUs must set them on each; set once per
// kernel and device (not stream operations: safe inside a CUDA-graph capture).
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

namespace qk {

// Kernel: the __global__ function; smem: its dynamic shared memory in bytes (its static shared memory counts
// toward the same 48 KB default); carveout: percent of the unified L1 / shared memory to make shared, or -1 to
// leave the driver's choice.
template <auto Kernel>
cudaError_t configure_once(int smem, int carveout) {
  static std::atomic<uint64_t> done{0};  // one bit per device below 64; devices beyond: every call
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  // the 48 KB default bounds static plus dynamic shared memory: a kernel with static tables needs the raise
  // before its dynamic part alone passes 48 KB
  cudaFuncAttributes attrs{};
  err = cudaFuncGetAttributes(&attrs, Kernel);
  if (err == cudaSuccess && attrs.sharedSizeBytes + size_t(smem) > 48 * 1024)
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess && carveout >= 0)
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

}  // namespace qk
