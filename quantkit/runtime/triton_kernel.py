"""The runtime's Triton kernels are built on first use, and only where Triton is installed."""

import functools
import os


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


def runs_on(tensor):
    """Whether the kernels can take `tensor`: a CUDA tensor, or any tensor under Triton's interpreter
    (TRITON_INTERPRET=1, how the tests run the kernels' code on the CPU)."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
