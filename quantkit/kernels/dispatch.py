"""Which CUDA kernel serves a QuantLinear's forward, by stored format.

Kernel modules register `forward(module, x) -> Tensor | None` for the formats they serve
(`register("bcq", fn)`); QuantLinear.forward on a CUDA input calls `kernel_forward`, and a None
answer (no kernel for this format, kernel unavailable, unsupported shape) means the PyTorch
reference path. A format may also register `accumulate(module, x)`, the same product left as fp32
partial sums for the next kernel to consume (QuantLinear.accumulate). Kernel modules are imported
lazily so CPU-only use never touches them.
"""

import importlib

import torch

_FORWARDS = {}
_ACCUMULATES = {}
_KERNEL_MODULES = ("quantkit.kernels.lutgemm", "quantkit.kernels.anyprec_gemm")
_imported = False


def register(format_name, forward, accumulate=None):
    _FORWARDS[format_name] = forward
    if accumulate is not None:
        _ACCUMULATES[format_name] = accumulate


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


def _served(table, module, x):
    if not x.is_cuda or not getattr(module, "use_kernels", True):
        return None
    _import_kernel_modules()
    return table.get(module.meta["format"])


def kernel_forward(module, x):
    """The kernel's output for QuantLinear `module` on CUDA input x, or None for the reference path."""
    forward = _served(_FORWARDS, module, x)
    return None if forward is None else forward(module, x)


def kernel_accumulate(module, x):
    """The kernel's fp32 partial sums of `module`'s product with x (see QuantLinear.accumulate), or None."""
    accumulate = _served(_ACCUMULATES, module, x)
    return None if accumulate is None else accumulate(module, x)


def kept_zero_buffer(module, attr, device, numel):
    """The fp32 buffer `module.<attr>` on `device`, made zero on first use, for kernels that leave partial sums
    in it and consumers that finish them and leave it zero again (so calls need no memset: a CUDA-graph decode
    step has one node less per linear). Not made while a CUDA graph is being captured (its zeroing would only be
    recorded, not run): None then. Made outside inference mode, so a consumer's PyTorch fallback may clear it
    in place anywhere. One module's launches must not run on two streams at once."""
    buf = getattr(module, attr, None)
    if buf is not None and buf.device == device:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    with torch.inference_mode(False):
        buf = torch.zeros(numel, dtype=torch.float32, device=device)
    setattr(module, attr, buf)
    return buf
