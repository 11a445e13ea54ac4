"""Split-K matvec of a dense fp16 weight for 1..8 rows of x (Triton): fp32 sums added into a buffer.

At decode shapes one row of x against a [N, K] weight is a pure weight stream, and a library GEMV spreads
it over the card only as far as its row tiles go: a 4096-row weight makes too few tiles to keep every SM
streaming. Here each program reads a BLOCK_N x (K / split) slice of the weight and adds its partial dot
products into fp32 sums with atomics, so the grid has as many programs as the card needs whatever N is.
Batch 1 multiplies on the CUDA cores; batch 2..8 pads x to 16 rows for one tensor-core dot per chunk.

The sums are left in `acc` as the LUT kernels leave theirs (runtime/ops.py, project_sums): the consuming
operator finishes and clears them. The atomics add in no fixed order, so the fp32 sums may differ in their
last bits between runs (as the LUT kernels' do). With overlap (kernels/overlap.py) the kernel lets the next
one be scheduled at its start and waits for the previous one before its first read.

On by default for the fast decoder's fp16 projections on Hopper and newer GPUs; QUANTKIT_DENSE_MATVEC=0 (or
`disabled()` around a capture) leaves them to cuBLAS.
"""

import functools
from dataclasses import dataclass

import torch

from quantkit.kernels import overlap
from quantkit.kernels.dispatch import kept_zero_buffer
from quantkit.runtime.triton_kernel import lazy_kernel
from quantkit.settings import ProcessSwitch

MAX_ROWS = 8  # rows of x this kernel serves (the decode's batches)
ENV = "QUANTKIT_DENSE_MATVEC"
SWITCH = ProcessSwitch(ENV)
enabled = SWITCH.enabled  # whether the fast decoder's fp16 projections take this kernel (else cuBLAS)
disabled = SWITCH.disabled  # cuBLAS for the fp16 projections inside the block
_WORKSPACE_ATTR = "_quantkit_dense_sums"


@dataclass(frozen=True)
class SplitPlan:
    """How one weight shape is cut: BLOCK_N rows x BLOCK_K columns per chunk, `split` programs per row
    block, each `chunks` chunks long."""

    block_n: int
    block_k: int
    split: int
    chunks: int
    warps: int = 4
    stages: int = 4


def plan(n, k, rows, sms, target_programs=None, block_n=None, block_k=None, warps=4, stages=4):
    """The split for a [n, k] weight and `rows` rows of x on a card of `sms` SMs: enough programs for
    about 8 per SM (a few waves, so no SM idles for long at the tail) unless `target_programs` says."""
    block_n = block_n or (32 if rows == 1 else 64)
    block_k = block_k or (256 if rows == 1 else 128)
    total_chunks = -(-k // block_k)
    row_blocks = -(-n // block_n)
    target = target_programs or 8 * sms
    split = max(1, min(total_chunks, round(target / row_blocks)))
    chunks = -(-total_chunks // split)
    split = -(-total_chunks // chunks)  # no empty programs
    return SplitPlan(block_n, block_k, split, chunks, warps, stages)


@lazy_kernel
def _kernel(triton, tl):
    @triton.jit
    def dense_accumulate_kernel(x_ptr, w_ptr, acc_ptr, B, N, K, stride_x, stride_w, CHUNKS,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_PAD: tl.constexpr,
                                EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # overlap: the next kernel may be scheduled now; x and acc belong to earlier kernels
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        k_begin = pid_k * CHUNKS * BLOCK_K
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        row_ok = rows < N
        if B_PAD == 1:  # products summed across the chunk's columns once, after the loop
            part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            batch = tl.arange(0, B_PAD)
            part = tl.zeros([BLOCK_N, B_PAD], dtype=tl.float32)
        for c in range(0, CHUNKS):
            kk = k_begin + c * BLOCK_K + cols
            if EVEN_K and EVEN_N:
                w = tl.load(w_rows + kk[None, :])
            else:
                w = tl.load(w_rows + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
            if B_PAD == 1:
                if EVEN_K:
                    xv = tl.load(x_ptr + kk)
                else:
                    xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
                part += w.to(tl.float32) * xv.to(tl.float32)[None, :]
            else:
                xt = tl.load(x_ptr + batch[None, :] * stride_x + kk[:, None],
                             mask=(batch < B)[None, :] & (kk < K)[:, None], other=0.0)
                part = tl.dot(w, xt, part)
        if B_PAD == 1:
            tl.atomic_add(acc_ptr + rows, tl.sum(part, axis=1), mask=row_ok, sem="relaxed")
        else:
            tl.atomic_add(acc_ptr + batch[None, :] * N + rows[:, None], part,
                          mask=row_ok[:, None] & (batch < B)[None, :], sem="relaxed")

    return dense_accumulate_kernel


def available():
    """Whether Triton is importable (the kernel compiles on first launch)."""
    return _kernel() is not None


def serves(weight, x):
    """Whether the kernel serves x [B, K] against `weight` (an nn.Linear's) here: enabled, Triton, a Hopper or
    newer GPU (where it was measured against cuBLAS; older cards keep cuBLAS), both fp16 (the consumers round the
    sums to fp16, as the matvec's own output would be), B <= 8, and not under
    torch.use_deterministic_algorithms(True) (its atomics add in no fixed order; cuBLAS then)."""
    return (enabled() and x.is_cuda and x.dtype == torch.float16 and weight.dtype == torch.float16
            and 1 <= x.shape[0] <= MAX_ROWS and weight.stride(-1) == 1
            and not torch.are_deterministic_algorithms_enabled() and overlap.hopper_or_newer(x.device)
            and available())


def kept_workspace(module, device, out_features):
    """The module's fp32 sums for up to MAX_ROWS rows (dispatch.kept_zero_buffer; None inside a capture, and
    the caller takes cuBLAS for that call)."""
    return kept_zero_buffer(module, _WORKSPACE_ATTR, device, MAX_ROWS * out_features)


@functools.cache
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device):
    if device.type != "cuda":
        return 132  # the interpreter: plans as for an H100
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def accumulate(x, weight, acc, split_plan=None):
    """acc[:B * N] (fp32, viewed [B, N]) += x @ weight.T for x [B, K] (B <= 8) and weight [N, K], both fp16,
    contiguous rows. (bf16 would compile, but is neither served nor tested.)"""
    kernel = _kernel()
    b, k = x.shape
    n = weight.shape[0]
    if kernel is None:
        raise RuntimeError("the dense matvec needs Triton")
    if not 1 <= b <= MAX_ROWS or weight.shape[1] != k or x.dtype != torch.float16 or weight.dtype != torch.float16:
        raise ValueError(f"dense matvec: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or acc.dtype != torch.float32 or acc.numel() < b * n:
        raise ValueError("dense matvec: rows must be contiguous and acc an fp32 buffer of at least B * N")
    p = split_plan or plan(n, k, b, _sms(x.device))
    even_k = p.split * p.chunks * p.block_k == k  # every program's chunks lie inside the row
    grid = (-(-n // p.block_n), p.split)
    kernel[grid](x, weight, acc, b, n, k, x.stride(0), weight.stride(0), p.chunks,
                 BLOCK_N=p.block_n, BLOCK_K=p.block_k, B_PAD=1 if b == 1 else 16,
                 EVEN_K=even_k, EVEN_N=n % p.block_n == 0, num_warps=p.warps, num_stages=p.stages,
                 **overlap.triton_launch(x.device))
    return acc


def matvec(x, weight, split_plan=None):
    """x @ weight.T in x's dtype through the split-K kernel (a fresh fp32 buffer; for tests and benchmarks)."""
    acc = torch.zeros(x.shape[0] * weight.shape[0], dtype=torch.float32, device=x.device)
    accumulate(x, weight, acc, split_plan)
    return acc.view(x.shape[0], weight.shape[0]).to(x.dtype)
