// Launch of one compiled matvec instance (anyprec.cu and anyprec_variants.cu share it): the instance's
// shared-memory limit and carveout set once per device, one block per 16 * TILES rows, overlap where the
// device and the instance allow it.
#pragma once

#include <algorithm>
#include <type_traits>

#include "kernel_attrs.h"

#include "anyprec_matvec_kernel.cuh"

namespace anyprec {

// Where a matvec launches: the stream, whether with overlap (grid_dependency.h) where the device and
// the instance allow it, and the launch's error when it failed.
struct Launch {
  cudaStream_t stream;
  bool overlap;
  int device;
  mutable cudaError_t error = cudaSuccess;
};

template <typename T, int K, int TILES, int FLAGS>
int launch_instance(const MatvecArgs& a, const Launch& on) {
  if constexpr (!compiled_rule(std::is_same<T, __half>::value, K, TILES, FLAGS)) {
    return kUnsupported;
  } else {
    using C = Config<K, TILES, FLAGS>;
    auto kernel = matvec_kernel<K, T, TILES, FLAGS>;
    // a carveout that holds MIN_BLOCKS blocks (the driver's default may keep more L1)
    const int carveout = std::min(100, (100 * C::MIN_BLOCKS * (C::SMEM_BYTES + 1024) + 228 * 1024 - 1) / (228 * 1024));
    if (qk::configure_once<matvec_kernel<K, T, TILES, FLAGS>>(C::SMEM_BYTES, carveout) != cudaSuccess) return kLaunchFailed;
    const int blocks = (a.M + 16 * TILES - 1) / (16 * TILES);
    const bool overlap = on.overlap && qk::overlap_supported<matvec_kernel<K, T, TILES, FLAGS>>(on.device);
    on.error = qk::launch_kernel(kernel, blocks, C::THREADS, C::SMEM_BYTES, on.stream, overlap, a);
    return on.error == cudaSuccess ? kOk : kLaunchFailed;
  }
}

template <typename T, int TILES, int FLAGS>
int launch_k(int k, const MatvecArgs& a, const Launch& s) {
  switch (k) {
    case 1: return launch_instance<T, 1, TILES, FLAGS>(a, s);
    case 2: return launch_instance<T, 2, TILES, FLAGS>(a, s);
    case 3: return launch_instance<T, 3, TILES, FLAGS>(a, s);
    case 4: return launch_instance<T, 4, TILES, FLAGS>(a, s);
    case 5: return launch_instance<T, 5, TILES, FLAGS>(a, s);
    case 6: return launch_instance<T, 6, TILES, FLAGS>(a, s);
    case 7: return launch_instance<T, 7, TILES, FLAGS>(a, s);
    case 8: return launch_instance<T, 8, TILES, FLAGS>(a, s);
    default: return kUnsupported;
  }
}

}  // namespace anyprec
