"""Which CUDA kernel serves a QuantLinear's forward, by stored format.

Kernel modules register `forward(module, x) -> Tensor | None` for the formats they serve
(`register("bcq", fn)`); QuantLinear.forward on a CUDA input calls `kernel_forward`, and a None
answer (no kernel for this format, kernel unavailable, unsupported shape) means the PyTorch
reference path. Kernel modules are imported lazily so CPU-only use never touches them.
"""

import importlib
import os

# Matvec launches may overlap the end of the previous kernel on their stream (programmatic dependent
# launch, sm_90+: kernels/csrc/pdl.h) when may_overlap says their weights are settled. False turns it
# off everywhere: the benchmarks A/B it, and QUANTKIT_NO_OVERLAP=1 does it for a whole process.
overlap_launches = os.environ.get("QUANTKIT_NO_OVERLAP", "") != "1"

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


def may_overlap(module, tensors):
    """Whether a kernel call of `module` reading `tensors` (its kernel-side weights) may be launched to
    overlap the previous kernel on the stream. It may read the weights before that kernel has finished,
    so they must not be its output: true when the same tensor objects, not written in place since (their
    version counters), served this module's previous call, which ran after whatever wrote them. The
    module keeps references to them until its next call, so their memory cannot be reused meanwhile.
    Inference tensors (made under torch.inference_mode, e.g. the BCQ form of a uniform weight converted
    on first use) have no version counter: for them the object alone counts."""
    state = tuple((t, None if t.is_inference() else t._version) for t in tensors)
    previous = getattr(module, "_kernel_weights", ())
    settled = len(previous) == len(state) and all(
        old is new and old_version == new_version for (old, old_version), (new, new_version) in zip(previous, state))
    module._kernel_weights = state
    return overlap_launches and settled
