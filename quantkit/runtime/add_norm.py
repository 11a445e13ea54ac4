"""Residual add and the RMSNorm after it, one Triton program per row: (residual + delta, norm of it).

runtime.model adds every residual in the kernel of the norm that follows it (the next layer's input
norm, the post-attention norm, the final norm), through the custom operator quantkit::add_rms_norm
(runtime/ops.py); without a delta the same kernel is the plain RMSNorm (quantkit::rms_norm: the first
layer's input norm). At batch 1 a row is one hidden state of a few thousand values, so the call is all
launch and latency: on an H100 in a CUDA graph this kernel takes 1.7 µs against 2.6-2.8 µs for
inductor's compiled version of the same expression and 1.3 µs for an empty kernel
(docs/decode-runtime.md). It computes what a Llama RMSNorm computes eagerly: the sum rounded to the
input dtype, its mean square and rsqrt in fp32, the normed values rounded to the input dtype before the
weight multiplies them (in fp32, rounded once: the same as an fp16 product).

The delta may also be a LUT kernel's fp32 accumulator (QuantLinear.accumulate, `consume=True`): the
kernel rounds it as the matvec's own fp16 output would be rounded, and zeroes it for the next call.
"""

import torch

from quantkit.kernels import overlap
from quantkit.runtime.triton_kernel import lazy_kernel, runs_on

MAX_WIDTH = 16384  # one program holds a whole row in registers


@lazy_kernel
def _kernel(triton, tl):
    """The kernel, compiled by Triton on first launch."""

    @triton.jit
    def add_rms_norm_kernel(res_ptr, delta_ptr, weight_ptr, hidden_ptr, normed_ptr, eps, width,
                            res_stride, delta_stride, BLOCK: tl.constexpr, CONSUME: tl.constexpr,
                            HAS_DELTA: tl.constexpr, GDC: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        if GDC:  # overlap (kernels/overlap.py): let the next kernel be scheduled
            tl.extra.cuda.gdc_launch_dependents()
        # the weight before the wait: no kernel writes it, so its read hides under the previous kernel's tail
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if GDC:  # the residual and delta come from earlier kernels
            tl.extra.cuda.gdc_wait()
        res = tl.load(res_ptr + row * res_stride + cols, mask=inside, other=0.0)
        hidden = res
        if HAS_DELTA:
            delta = tl.load(delta_ptr + row * delta_stride + cols, mask=inside, other=0.0)
            if CONSUME:  # fp32 sums of a matvec: its fp16 output, in the model's dtype (cleared below)
                delta = delta.to(tl.float16).to(res.dtype)
            hidden = (res.to(tl.float32) + delta.to(tl.float32)).to(res.dtype)
            tl.store(hidden_ptr + row * width + cols, hidden, mask=inside)
        h = hidden.to(tl.float32)
        scale = tl.rsqrt(tl.sum(h * h, axis=0) / width + eps)
        normed = (h * scale).to(res.dtype).to(tl.float32)
        tl.store(normed_ptr + row * width + cols, (weight * normed).to(res.dtype), mask=inside)
        if CONSUME:  # after a barrier, which the stores above (they need every load's value) precede
            tl.debug_barrier()  # (stored right after its load, a zero overtook the load: silu_mul.py)
            tl.store(delta_ptr + row * delta_stride + cols, tl.zeros([BLOCK], tl.float32), mask=inside)

    return add_rms_norm_kernel


def available():
    """Whether Triton is importable (the kernel compiles on first launch)."""
    return _kernel() is not None


def supported(residual, delta, weight, consume=False):
    """Whether `add_rms_norm` (delta None: `rms_norm`) serves these tensors (else the PyTorch expression)."""
    delta_fits = delta is None or (delta.dtype == (torch.float32 if consume else residual.dtype)
                                   and delta.shape == residual.shape and delta.device == residual.device
                                   and delta.stride(-1) == 1)
    return (runs_on(residual) and available() and residual.dtype in (torch.float16, torch.bfloat16) and delta_fits
            and weight.dtype == residual.dtype and weight.shape == residual.shape[-1:]
            and residual.shape[-1] <= MAX_WIDTH and residual.device == weight.device and weight.is_contiguous()
            and residual.stride(-1) == 1)


def add_rms_norm(residual, delta, weight, eps, consume=False):
    """(residual + delta, weight * rmsnorm(residual + delta)) as new contiguous tensors of residual's shape;
    rows may be strided (e.g. views of a stacked output), the last dimension must be contiguous.
    consume: delta is a matvec's fp32 accumulator (QuantLinear.accumulate), added as the matvec's fp16
    output would be and left zero."""
    return _launch(residual, delta, weight, eps, consume)


def rms_norm(x, weight, eps):
    """weight * rmsnorm(x) as a new contiguous tensor of x's shape (the kernel without the add)."""
    return _launch(x, None, weight, eps, False)[1]


def _launch(residual, delta, weight, eps, consume):
    width = residual.shape[-1]
    res2 = residual.reshape(-1, width)
    delta2 = res2 if delta is None else delta.reshape(-1, width)  # an unused pointer without a delta
    hidden = res2 if delta is None else torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    normed = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    rows = res2.shape[0]
    if rows:
        block = 1 << (width - 1).bit_length()
        _kernel()[(rows,)](res2, delta2, weight, hidden, normed, eps, width, res2.stride(0), delta2.stride(0),
                           BLOCK=block, CONSUME=consume, HAS_DELTA=delta is not None,
                           num_warps=8 if block >= 4096 else 4, **overlap.triton_launch(residual.device))
    return hidden, normed


def rms_norm_torch(hidden, weight, eps):
    """A Llama-family RMSNorm's expression: the norm in fp32, rounded to the input dtype, times the weight."""
    dtype = hidden.dtype
    h = hidden.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_torch(residual, delta, weight, eps):
    """What `add_rms_norm` computes, in PyTorch, as a Llama decoder layer does it (its reference, and the
    path where the kernel does not serve)."""
    hidden = residual + delta
    return hidden, rms_norm_torch(hidden, weight, eps)
