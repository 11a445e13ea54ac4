"""SiLU(gate)·up read straight from a stacked gate/up projection's fp32 accumulator, which it clears.

`fusion` runs a quantized MLP's stacked gate/up matvec with QuantLinear.accumulate: the LUT kernel
leaves its split-K sums in its workspace instead of finishing them into an fp16 output. This kernel
is the step that finishes them: it rounds each sum as the matvec's fp16 output would be rounded (then
to the model's dtype), computes SiLU(gate)·up as transformers' Llama MLP does eagerly (the SiLU rounded
to the dtype before the product), and writes zeros back so the workspace is ready for the next call.
"""

import torch

from quantkit.kernels import overlap
from quantkit.runtime.quant_linear import QuantLinear
from quantkit.runtime.triton_kernel import lazy_kernel

BLOCK = 1024  # columns per program: a 7B MLP row (11008) is 11 programs


@lazy_kernel
def _kernel(triton, tl):
    """The kernel, compiled by Triton on first launch."""

    @triton.jit
    def silu_mul_kernel(acc_ptr, out_ptr, width, acc_stride, BLOCK: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # overlap (kernels/overlap.py): let the next kernel be scheduled, wait for the previous
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        gate_ptrs = acc_ptr + row * acc_stride + cols
        gate = tl.load(gate_ptrs, mask=inside, other=0.0)
        up = tl.load(gate_ptrs + width, mask=inside, other=0.0)
        dtype = out_ptr.dtype.element_ty
        gate = gate.to(tl.float16).to(dtype).to(tl.float32)
        up = up.to(tl.float16).to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (silu * up).to(dtype), mask=inside)
        # Clear only after a barrier, which the output's store (it needs every load's value) precedes:
        # stored right after the loads, zeros overtook some of them on an H100 (docs/decode-runtime.md).
        tl.debug_barrier()
        zero = tl.zeros([BLOCK], tl.float32)
        tl.store(gate_ptrs, zero, mask=inside)
        tl.store(gate_ptrs + width, zero, mask=inside)

    return silu_mul_kernel


def supported(acc, dtype):
    """Whether `silu_mul_consuming` serves an accumulator [..., 2·width] for a model in `dtype`."""
    return (acc.is_cuda and _kernel() is not None and acc.dtype == torch.float32 and acc.is_contiguous()
            and acc.shape[-1] % 2 == 0 and dtype in (torch.float16, torch.bfloat16))


def silu_mul_consuming(acc, dtype):
    """SiLU(gate)·up in `dtype` [..., width] from acc = [..., gate | up] (fp32 sums of a stacked gate/up
    matvec, QuantLinear.accumulate), each rounded as the matvec's fp16 output; acc is left zero."""
    width = acc.shape[-1] // 2
    rows = acc.reshape(-1, 2 * width)
    out = torch.empty(*acc.shape[:-1], width, dtype=dtype, device=acc.device)
    if rows.shape[0] and width:
        grid = (rows.shape[0], -(-width // BLOCK))
        _kernel()[grid](rows, out, width, rows.stride(0), BLOCK=BLOCK, num_warps=4, **overlap.triton_launch(acc.device))
    return out


def silu_mul_consuming_torch(acc, dtype):
    """What `silu_mul_consuming` computes, in PyTorch (its reference, and the path where it does not serve)."""
    gate, up = QuantLinear.finish(acc, dtype).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
