// Programmatic dependent launch (sm_90+) for the matvec kernels (lutgemm_*_kernel.cuh, anyprec_matvec_kernel.cuh).
//
// A kernel launched with `overlap` may start while the kernel before it on the stream is still
// running (once every block of that one has called allow_next_grid() or exited). Until it calls
// wait_prior_grid() it must not read anything an earlier kernel writes, nor write anything: the
// matvec kernels use that window to start copying their weights, which no kernel writes, so the
// copies overlap the previous kernel's tail and this launch's own start-up. wait_prior_grid()
// returns once the previous grid has completed and its writes are visible; by then every grid
// before it has completed as well, since each waited for its own predecessor before finishing.
// Both calls are no-ops in a launch without overlap, below sm_90, and in lutgemm's host emulation
// (lutgemm_emu.h).
#pragma once

#ifndef QK_HOST_EMU
#include <atomic>

#include <cuda_runtime.h>
#endif

namespace qk {

__device__ __forceinline__ void wait_prior_grid() {
#if !defined(QK_HOST_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream be scheduled now (if it was launched with overlap); it still
// waits for this grid's completion before touching its data.
__device__ __forceinline__ void allow_next_grid() {
#if !defined(QK_HOST_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

#ifndef QK_HOST_EMU
// ask(device), a yes / no property of the device, asked once per device and kept in `known` (one array per
// question); devices from 64 on are answered no.
template <class Ask>
bool once_per_device(std::atomic<int> (&known)[64], int device, Ask ask) {
  if (device < 0 || device >= 64) return false;
  int state = known[device].load(std::memory_order_relaxed);  // 0 = not asked yet, 1 = no, 2 = yes
  if (state == 0) {
    state = ask(device) ? 2 : 1;
    known[device].store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

// Whether Kernel may be launched with overlap on `device`: the GPU is sm_90+ and the kernel was compiled
// for it (PTX 9.0+: a build for an older architecture, JIT-compiled on a Hopper, has no wait in it and
// would read x early). Asked once per kernel and device.
template <auto Kernel>
bool overlap_supported(int device) {
  static std::atomic<int> known[64];
  return once_per_device(known, device, [](int dev) {
    int major = 0;
    cudaFuncAttributes attributes{};
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    cudaFuncGetAttributes(&attributes, Kernel) == cudaSuccess;
    return ok && major >= 9 && attributes.ptxVersion >= 90;
  });
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// `overlap` (overlap_supported() must hold). A failed launch's error is returned and cleared, so the
// next CUDA call does not report it again.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool overlap, Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}
#endif

}  // namespace qk
