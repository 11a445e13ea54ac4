"""Programmatic dependent launch ("overlap") for the runtime's kernels on Hopper and newer GPUs.

A kernel launched with overlap may be scheduled while the kernel before it on the stream is still
running. It waits for that kernel's completion before it reads or writes anything another kernel
touches, but may read what no kernel writes before that: the matvec kernels (csrc/lutgemm.cu,
csrc/anyprec.cu; csrc/grid_dependency.h) start copying their weights first, so the launch and the
first weight loads hide under the previous kernel's tail. The runtime's Triton kernels (add + norm,
SiLU·mul, decode attention) wait first thing and only let the next kernel be scheduled early.
In a decode step, where every kernel depends on the one before, that is part of each launch gap.

The weights are read before that wait, so they must not come from the kernel just before: a kernel
launched without overlap only starts once everything before it has completed, but an overlapped one may
start while the previous kernel's writes are still on their way (and, behind a chain of overlapped
kernels, an earlier one's). So a module's matvec runs with overlap only once its weights are settled:
`settled()` is false on the first call with a given set of weight tensors (new storage, or written in
place since), whose launch is then an ordinary one, and true from the next call on. Weights converted,
laid out or stacked on the GPU right before their first use (uniform -> BCQ, the any-precision kernel
layout, fused projections) are covered by that first ordinary launch.

On by default where the GPU supports it (compute capability 9.0+); QUANTKIT_OVERLAP=0 turns it off
for the process, `disabled()` for a block of code (the A/B benchmarks: a CUDA graph keeps what was
set while it was captured).
"""

import contextlib
import functools
import os

import torch

ENV = "QUANTKIT_OVERLAP"
_state = {"on": os.environ.get(ENV, "1") != "0"}


def enabled():
    """Whether kernels launched now ask for overlap (the CUDA extensions check the GPU themselves)."""
    return _state["on"]


_SETTLED_ATTR = "_overlap_weights"  # on the module: (data_ptr, version) of the weights its last launch read


def settled(owner, *weights):
    """Whether `owner` (a module) may launch a kernel that reads `weights` before its wait, with overlap:
    true when its previous call read the same tensors, unchanged (the same storage, no in-place write:
    their version counters); else false, and the caller launches without overlap this once. Tensors
    that are None are skipped; inference tensors have no version counter, so for them only the storage
    counts (they cannot be written in place outside inference mode)."""
    key = tuple((w.data_ptr(), None if w.is_inference() else w._version) for w in weights if w is not None)
    if getattr(owner, _SETTLED_ATTR, None) == key:
        return True
    setattr(owner, _SETTLED_ATTR, key)
    return False


@functools.cache
def _capable(index):
    return torch.cuda.get_device_capability(index)[0] >= 9


def for_device(device):
    """Whether a kernel launched now on `device` gets overlap: enabled, CUDA, compute capability 9.0+."""
    device = torch.device(device)
    if not enabled() or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def triton_launch(device):
    """Keyword arguments of a Triton launch for `device`: GDC (the kernel's constexpr switch for its
    grid-dependency calls) and, when on, launch_pdl (Triton 3.4+). Off, nothing but GDC=False is passed,
    which Triton's interpreter accepts."""
    return {"GDC": True, "launch_pdl": True} if for_device(device) else {"GDC": False}


@contextlib.contextmanager
def disabled():
    """Launch without overlap inside the block (e.g. while capturing a CUDA graph to compare against)."""
    previous = _state["on"]
    _state["on"] = False
    try:
        yield
    finally:
        _state["on"] = previous
