"""SiLU(gate)·up of a stacked gate/up projection's output [..., gate | up], one Triton kernel.

runtime.model calls it through the custom operator quantkit::silu_mul (runtime/ops.py). Where the
stacked gate/up matvec runs on the LUT kernels, the model asks for QuantLinear.accumulate: the kernel
leaves its split-K sums in its workspace instead of finishing them into an fp16 output, and this
kernel is the step that finishes them (consume): it rounds each sum as the matvec's fp16 output would
be rounded (then to the model's dtype) and writes zeros back so the workspace is ready for the next
call. Either way it computes SiLU(gate)·up as a Llama MLP does eagerly (the SiLU rounded to the dtype
before the product).
"""

import torch

from quantkit.kernels import overlap
from quantkit.runtime.quant_linear import QuantLinear
from quantkit.runtime.triton_kernel import lazy_kernel, runs_on

BLOCK = 1024  # columns per program: a 7B MLP row (11008) is 11 programs


@lazy_kernel
def _kernel(triton, tl):
    """The kernel, compiled by Triton on first launch."""

    @triton.jit
    def silu_mul_kernel(acc_ptr, out_ptr, width, acc_stride, BLOCK: tl.constexpr, CONSUME: tl.constexpr,
                        GDC: tl.constexpr):
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
        if CONSUME:  # fp32 sums: the matvec's fp16 output, in the model's dtype
            gate = gate.to(tl.float16)
            up = up.to(tl.float16)
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (silu * up).to(dtype), mask=inside)
        if CONSUME:
            # Clear only after a barrier, which the output's store (it needs every load's value) precedes:
            # stored right after the loads, zeros overtook some of them on an H100 (docs/decode-runtime.md).
            tl.debug_barrier()
            zero = tl.zeros([BLOCK], tl.float32)
            tl.store(gate_ptrs, zero, mask=inside)
            tl.store(gate_ptrs + width, zero, mask=inside)

    return silu_mul_kernel


def supported(gate_up, dtype, consume=True):
    """Whether the kernel serves gate_up [..., 2·width] (fp32 sums with consume, else in `dtype`) for a
    model in `dtype`."""
    return (runs_on(gate_up) and _kernel() is not None and gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0
            and gate_up.dtype == (torch.float32 if consume else dtype) and dtype in (torch.float16, torch.bfloat16))


def silu_mul(gate_up, dtype=None, consume=False):
    """SiLU(gate)·up in `dtype` [..., width] from gate_up = [..., gate | up] (contiguous). consume: gate_up
    holds a stacked gate/up matvec's fp32 sums (QuantLinear.accumulate), each rounded as the matvec's
    fp16 output, and is left zero; else it is the output, in `dtype` (default its own)."""
    dtype = dtype or gate_up.dtype
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    out = torch.empty(*gate_up.shape[:-1], width, dtype=dtype, device=gate_up.device)
    if rows.shape[0] and width:
        grid = (rows.shape[0], -(-width // BLOCK))
        _kernel()[grid](rows, out, width, rows.stride(0), BLOCK=BLOCK, CONSUME=consume, num_warps=4,
                        **overlap.triton_launch(gate_up.device))
    return out


def silu_mul_torch(gate_up, dtype=None, consume=False):
    """What `silu_mul` computes, in PyTorch (its reference, and the path where the kernel does not serve)."""
    dtype = dtype or gate_up.dtype
    gate, up = (QuantLinear.finish(gate_up, dtype) if consume else gate_up.to(dtype)).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
