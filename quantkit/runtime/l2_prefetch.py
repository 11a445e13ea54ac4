"""Warming L2 with the next projection's weights while the small kernels between the matvecs run.

In a decode step at batch 1 the kernels between two matvecs (attention, add + RMSNorm, SiLU·mul) are bound by
latency: a few µs each in which HBM, which the matvecs keep busy, idles. Each of those kernels can take a byte
range of the weight the next matvec streams and, in a few extra programs of its grid, ask L2 to fetch it
(`cp.async.bulk.prefetch.L2`, sm_90+: one instruction per lane, nothing waited for, the programs exit at once).
The matvec then finds the first part of its weight in L2. The real programs of the kernel are unchanged, and a
prefetch is only a hint: L2 is the point of coherence, so it can neither break a result nor read stale data.

How much each kernel asks for is the HBM time it covers: `BUDGETS` (bytes per call site), measured end to end
in benchmarks/bench_l2_prefetch.py (docs/decode-runtime.md). QUANTKIT_L2_PREFETCH=0 turns it off for the
process, `disabled()` for a block of code (a CUDA graph keeps what was set while it was captured).
"""

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

ENV = "QUANTKIT_L2_PREFETCH"
_state = {"on": os.environ.get(ENV, "1") != "0"}

PROGRAMS = 32  # extra programs per launch that issue the prefetch, spread over that many SMs
# bytes asked for by each call site: what HBM moves in about the kernel's time at ~3 TB/s
BUDGETS = {"attention": 8 << 20, "norm": 4 << 20, "silu_mul": 4 << 20}


@dataclass(frozen=True)
class Prefetch:
    """The first `nbytes` of `tensor` (a flat uint8 view), asked for in pieces of `piece` bytes by `programs`
    programs of `lanes` lanes each (piece a multiple of 16: each piece starts 16-byte aligned)."""

    tensor: torch.Tensor
    nbytes: int
    piece: int
    programs: int
    lanes: int


def enabled():
    return _state["on"]


@contextlib.contextmanager
def disabled():
    """No prefetch for the kernels launched (or captured) inside the block."""
    before = _state["on"]
    _state["on"] = False
    try:
        yield
    finally:
        _state["on"] = before


@functools.cache
def _capable(index):
    return torch.cuda.get_device_capability(index)[0] >= 9


def piece_bytes(nbytes, programs, lanes):
    """Bytes per lane so that `programs` x `lanes` lanes cover nbytes (a multiple of 16) in pieces that are
    multiples of 16 (the prefetch's size operand)."""
    per_lane = -(-nbytes // (programs * lanes))
    return -(-per_lane // 16) * 16


def plan(tensor, nbytes, lanes, programs=PROGRAMS):
    """The Prefetch of the first `nbytes` of `tensor` (contiguous, on a CUDA device of compute capability 9.0+,
    16-byte aligned; rounded down to 16 bytes, never past its end) for kernels of `lanes` lanes per program;
    None where it does not apply (off, no tensor, nothing to fetch, another device)."""
    if not enabled() or tensor is None or not tensor.is_cuda or not tensor.is_contiguous() or tensor.data_ptr() % 16:
        return None
    flat = tensor.reshape(-1).view(torch.uint8)
    nbytes = min(nbytes, flat.numel()) // 16 * 16
    if nbytes <= 0 or not _capable(tensor.device.index if tensor.device.index is not None
                                   else torch.cuda.current_device()):
        return None
    return Prefetch(flat, nbytes, piece_bytes(nbytes, programs, lanes), programs, lanes)


def extra_rows(prefetch, inner):
    """Rows added to a grid's first axis so that, with `inner` programs per row, at least prefetch.programs
    programs prefetch (0 without a prefetch)."""
    return 0 if prefetch is None else -(-prefetch.programs // inner)


def launch_args(prefetch, like):
    """(tensor, nbytes, piece) kernel arguments: `like` (any tensor) and zeros without a prefetch."""
    if prefetch is None:
        return like, 0, 0
    return prefetch.tensor, prefetch.nbytes, prefetch.piece


@functools.cache
def jit_helper():
    """The Triton function a kernel calls from its prefetching programs (None without Triton):
    prefetch_l2(base, nbytes, piece, lane0, LANES) asks for pieces lane0 .. lane0 + LANES - 1."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def prefetch_l2(base, nbytes, piece, lane0, LANES: tl.constexpr):
        start = (lane0 + tl.arange(0, LANES)).to(tl.int64) * piece
        size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
        # a lane whose piece is empty issues nothing (the size operand must be a positive multiple of 16)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False, pack=1)

    return prefetch_l2
