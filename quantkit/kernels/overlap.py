"""Programmatic dependent launch ("overlap") for the runtime's kernels on Hopper and newer GPUs.

A kernel launched with overlap may be scheduled while the kernel before it on the stream is still
running. It waits for that kernel's completion before it reads or writes anything a kernel that may
still be running touches, but may read what no such kernel writes before that: the matvec kernels
(kernels/lutgemm_*_kernel.cuh, kernels/anyprec_matvec_kernel.cuh; kernels/grid_dependency.cuh) start
copying their weights first, so the launch and the first weight loads hide under the previous kernel's
tail. The runtime's Triton kernels (add + norm, SiLU·mul, decode attention) let the next kernel be
scheduled early and wait before their first read of what the kernel before wrote (the decode attention
reads its cache first: runtime/decode_attention.py, cache_settled).
In a decode step, where every kernel depends on the one before, that is part of each launch gap.

The weights are read before that wait, so they must not come from the kernel just before: a kernel
launched without overlap only starts once everything before it has completed, but an overlapped one may
start while the previous kernel's writes are still on their way (and, behind a chain of overlapped
kernels, an earlier one's). So a module's matvec runs with overlap only once its weights are settled:
`settled()` is false on the first call with a given set of weight tensors (other tensor objects, or
written in place since: their version counters), whose launch is then an ordinary one, and true from
the next call on. Weights converted, laid out or stacked on the GPU right before their first use
(uniform -> BCQ, the any-precision kernel layout, fused projections) are covered by that first
ordinary launch. Not seen: writes that bypass the version counter (through `.data`, into an
inference tensor inside inference mode, by an extension's `out=` argument); after such a write,
launch once with `disabled()`.

On by default where the GPU supports it (compute capability 9.0+); QUANTKIT_OVERLAP=0 turns it off
for the process, `disabled()` for a block of code (the A/B benchmarks: a CUDA graph keeps what was
set while it was captured).
"""

import functools
import weakref

import torch

from quantkit.settings import ProcessSwitch

ENV = "QUANTKIT_OVERLAP"
SWITCH = ProcessSwitch(ENV)
enabled = SWITCH.enabled  # whether kernels launched now ask for overlap (the CUDA extensions check the GPU themselves)
disabled = SWITCH.disabled  # launch without overlap inside the block (e.g. while capturing a graph to compare against)


# per module, (weak reference, version) of each weight its last call read; kept here rather than on the
# module, which then still pickles
_last_weights = weakref.WeakKeyDictionary()


def version(tensor):
    """The tensor's version counter (bumped by in-place writes), or None for an inference tensor, which keeps none."""
    return None if tensor.is_inference() else tensor._version


def settled(owner, *weights):
    """Whether `owner` (a module) may launch a kernel that reads `weights` before its wait, with overlap:
    true when its previous call read the same tensor objects, not written in place since (their
    version counters); else false, and the caller launches without overlap this once. Tensors that are
    None are skipped. Weak references: a tensor freed and another made at its address is not the same."""
    weights = [w for w in weights if w is not None]
    last = _last_weights.get(owner)
    if last is not None and len(last) == len(weights) and all(
            ref() is w and seen == version(w) for (ref, seen), w in zip(last, weights)):
        return True
    _last_weights[owner] = tuple((weakref.ref(w), version(w)) for w in weights)
    return False


@functools.cache
def _capable(index):
    return torch.cuda.get_device_capability(index)[0] >= 9


def hopper_or_newer(device):
    """Whether `device` is a CUDA GPU of compute capability 9.0 or newer."""
    device = torch.device(device)
    return device.type == "cuda" and _capable(device.index if device.index is not None else torch.cuda.current_device())


def for_device(device):
    """Whether a kernel launched now on `device` gets overlap: enabled, CUDA, compute capability 9.0+."""
    return enabled() and hopper_or_newer(device)


@functools.cache
def _triton_has_gdc():
    """Whether the installed Triton has the grid-dependency calls and the launch_pdl option (3.4+)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def triton_launch(device):
    """Keyword arguments of a Triton launch for `device`: GDC (the kernel's constexpr switch for its
    grid-dependency calls) and, when on, launch_pdl. Off (or with a Triton older than 3.4), nothing but
    GDC=False is passed, which Triton's interpreter accepts."""
    return {"GDC": True, "launch_pdl": True} if for_device(device) and _triton_has_gdc() else {"GDC": False}
