"""Which CUDA kernel serves a QuantLinear's forward, by stored format.

Kernel modules register `forward(module, x) -> Tensor | None` for the formats they serve
(`register("bcq", fn)`); QuantLinear.forward on a CUDA input calls `kernel_forward`, and a None
answer (no kernel for this format, kernel unavailable, unsupported shape) means the PyTorch
reference path. Kernel modules are imported lazily so CPU-only use never touches them.
"""

import importlib

_FORWARDS = {}
_KERNEL_MODULES = ("quantkit.kernels.lutgemm", "quantkit.kernels.anyprec_gemm")
_imported = False


def register(format_name, forward):
    _FORWARDS[format_name] = forward


def _import_kernel_modules():
    global _imported
    if _imported:
        return
    _imported = True
    for name in _KERNEL_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a missing dependency inside a kernel module is a real error
                raise


def kernel_forward(module, x):
    """The kernel's output for QuantLinear `module` on CUDA input x, or None for the reference path."""
    if not x.is_cuda or not getattr(module, "use_kernels", True):
        return None
    _import_kernel_modules()
    forward = _FORWARDS.get(module.meta["format"])
    return None if forward is None else forward(module, x)
