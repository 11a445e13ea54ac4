// Programmatic dependent launch (PDL, sm_90+) for the matvec kernels (lutgemm.cu, anyprec.cu).
//
// A decode step is a chain of small kernels, and a kernel normally starts only after the previous one
// on its stream has completed and flushed its writes: a gap of a microsecond or two, during which our
// kernel has not even begun loading its weights. Launched with the programmatic-serialization
// attribute, a kernel may start as soon as every block of the previous kernel has exited (none of
// ours triggers earlier), so its block launch and its first weight loads overlap the previous kernel's
// completion. The price is a contract inside the kernel: before wait_for_previous_grid() it may read
// only data that the previous kernel did not write (the weights), and it may write nothing to global
// memory (a freshly allocated output may be memory that kernel still reads).
//
// The caller asks for the overlap only when the weights were not just produced on the stream (not the
// first call after a conversion or a layout change), so the previous kernel cannot be their writer.
// Under QK_HOST_EMU (lutgemm's CPU emulation) the wait is a no-op, as it is on a plain launch.
#pragma once

#ifndef QK_HOST_EMU
#include <cuda_runtime.h>

#include <utility>
#endif

namespace qk {

// Blocks until the previous kernel on the stream has completed and its writes are visible; returns at
// once when the kernel was launched without the attribute.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#ifndef QK_HOST_EMU
// Whether `device` can overlap launches (compute capability 9.0+), asked once per device.
inline bool overlap_supported(int device) {
  static int major[64] = {0};  // 0 = not asked yet
  if (device < 0 || device >= 64) return false;
  if (major[device] == 0) {
    int m = 0;
    if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    major[device] = m;
  }
  return major[device] >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute when
// `overlap` is set (and the device supports it). Returns the launch error.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool overlap,
                   int device, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = overlap && overlap_supported(device) ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
#endif

}  // namespace qk
