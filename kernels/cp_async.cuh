// The shared-memory ring of the matvec kernels (lutgemm_*_kernel.cuh, anyprec_matvec_kernel.cuh):
// asynchronous global -> shared copies (cp.async, sm_80+). A thread's copies are ordered before its own later reads by
// cp.async.wait_group; reads by other threads need a barrier after that wait as well.
// Under QK_HOST_EMU (lutgemm's CPU emulation, lutgemm_emu.h) a copy is a plain memcpy and the waits are no-ops.
#pragma once

#include <cstdint>
#include <cstring>

namespace qk {

// N = 16 or 8 bytes, zeros when !valid (src is then not read). By default 16-byte copies skip L1
// (.cg: data read once) and 8-byte ones, which cannot, go through it (.ca: data reused by
// neighbouring threads); kL1 = true sends a 16-byte copy through L1 as well.
template <int N, bool kL1 = (N == 8)>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  static_assert(N == 16 || N == 8, "copy_async moves 16 or 8 bytes");
  static_assert(N == 16 || kL1, "8-byte copies always go through L1");
#ifdef QK_HOST_EMU
  if (valid) std::memcpy(dst, src, N); else std::memset(dst, 0, N);
#else
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (!kL1)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(N), "r"(valid ? N : 0)
                 : "memory");
#endif
}

// Close the group of copies issued since the last commit.
__device__ __forceinline__ void commit_async() {
#ifndef QK_HOST_EMU
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_async() {
#ifndef QK_HOST_EMU
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

}  // namespace qk
