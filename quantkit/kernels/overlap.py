"""Programmatic dependent launch ("overlap") for the runtime's kernels on Hopper and newer GPUs.

A kernel launched with overlap may be scheduled while the kernel before it on the stream is still
running. It waits for that kernel's completion before it reads or writes anything another kernel
touches, but may read what no kernel writes before that: the matvec kernels (csrc/lutgemm.cu,
csrc/anyprec.cu; csrc/grid_dependency.h) start copying their weights first, so the launch and the
first weight loads hide under the previous kernel's tail. The runtime's Triton kernels (add + norm,
SiLU·mul, decode attention) wait first thing and only let the next kernel be scheduled early.
In a decode step, where every kernel depends on the one before, that is part of each launch gap.

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
