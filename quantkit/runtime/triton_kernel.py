"""The runtime's Triton kernels are built on first use, and only where Triton is installed."""

import functools


def lazy_kernel(build):
    """Decorator: `build(triton, tl)` defines and returns a kernel; the decorated function returns it,
    built once, or None without Triton (callers then take their PyTorch path)."""

    @functools.cache
    @functools.wraps(build)
    def kernel():
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    return kernel
