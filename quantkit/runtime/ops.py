"""The fast decoder's kernels as torch custom operators (namespace `quantkit`), and which one serves a projection.

Each kernel runtime.model calls in a decode step is an operator with a fake (meta) implementation, so a CUDA
graph captures it and torch.compile traces it like any ATen op:

  quantkit::rms_norm(x, weight, eps)                          Triton (runtime/add_norm.py)
  quantkit::add_rms_norm(residual, delta, weight, eps, consume) -> (residual + delta, its norm)   Triton
  quantkit::silu_mul(gate_up, dtype, consume)                 Triton (runtime/silu_mul.py)
  quantkit::decode_attention(qkv, keys, values, positions, cos, sin, counters, heads, scale, consume,
                             cache_settled)
                                                              Triton (runtime/decode_attention.py)
  quantkit::lut_matvec(x, qweight, alpha, offset, bias, group_size, workspace, overlap)   CUDA (LUT-GEMM)
  quantkit::lut_accumulate(x, qweight, alpha, offset, group_size, acc, overlap)         CUDA (LUT-GEMM)
  quantkit::anyprec_matvec(x, planes, lut, bits, bias, overlap)                          CUDA (any-precision)
  quantkit::dense_accumulate(x, weight, acc)                  Triton (runtime/dense_matvec.py): fp16 weights

The Triton operators run their kernel where it serves (CUDA, Triton installed, shapes it handles) and
otherwise the PyTorch expression the kernel is tested against, on any device: the CPU path of the decoder
is the same code. `consume` means the input is a LUT matvec's fp32 split-K sums (QuantLinear.accumulate):
the operator rounds them as the matvec's fp16 output would be rounded and leaves them zero, so the matvec
skips its own finishing step (docs/decode-runtime.md). The fp16 projections leave such sums too, through the
split-K dense matvec. The CUDA operators exist on CUDA only; `project`
and `project_sums` below decide, per call, whether one of them serves a projection or the module runs
its own forward (prefill: dequantize + cuBLAS; the CPU: the dequantized reference).
"""

from typing import Optional

import torch
from torch import Tensor, nn

from quantkit.kernels import build, lutgemm, overlap
from quantkit.runtime import add_norm, decode_attention, dense_matvec, silu_mul
from quantkit.runtime.quant_linear import QuantLinear

MATVEC_MAX_ROWS = 8  # rows of x one LUT or any-precision matvec launch serves (the kernels' batch)

# --- Triton kernels ------------------------------------------------------------------------------------


@torch.library.custom_op("quantkit::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * rmsnorm(x) over the last dimension, in x's dtype."""
    if add_norm.supported(x, None, weight):
        return add_norm.rms_norm(x, weight, eps)
    return add_norm.rms_norm_torch(x, weight, eps).contiguous()


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("quantkit::add_rms_norm", mutates_args=("delta",))
def add_rms_norm(residual: Tensor, delta: Tensor, weight: Tensor, eps: float, consume: bool) -> tuple[Tensor, Tensor]:
    """(residual + delta, weight * rmsnorm(residual + delta)); consume: delta is fp32 sums, cleared."""
    if add_norm.supported(residual, delta, weight, consume):
        return add_norm.add_rms_norm(residual, delta, weight, eps, consume=consume)
    if consume:
        delta = QuantLinear.finish(delta, residual.dtype)
    hidden, normed = add_norm.add_rms_norm_torch(residual, delta, weight, eps)
    return hidden.contiguous(), normed.contiguous()


@add_rms_norm.register_fake
def _(residual, delta, weight, eps, consume):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


@torch.library.custom_op("quantkit::silu_mul", mutates_args=("gate_up",))
def silu_mul_op(gate_up: Tensor, dtype: torch.dtype, consume: bool) -> Tensor:
    """SiLU(gate)·up in `dtype` from [..., gate | up]; consume: fp32 sums, cleared."""
    if silu_mul.supported(gate_up, dtype, consume):
        return silu_mul.silu_mul(gate_up, dtype, consume=consume)
    return silu_mul.silu_mul_torch(gate_up, dtype, consume=consume)


@silu_mul_op.register_fake
def _(gate_up, dtype, consume):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=dtype)


@torch.library.custom_op("quantkit::decode_attention", mutates_args=("qkv", "keys", "values", "counters"))
def attend(qkv: Tensor, keys: Tensor, values: Tensor, positions: Tensor, cos: Optional[Tensor], sin: Optional[Tensor],
           counters: Tensor, heads: int, scale: float, consume: bool, cache_settled: bool = False) -> Tensor:
    """One decode step's attention of B rows. qkv [B, (H + 2·Hkv)·D]: the stacked q/k/v projection's output
    (consume: its fp32 sums), keys/values [B, Hkv, L, D] the layer's cache, positions [B] each row's
    position, (cos, sin) rope tables [L', D] or None, counters from decode_attention.counters(B, H).
    cache_settled: no kernel still running may write the cache, positions or tables (decode_attention.decode).
    Writes each row's key and value at its position -> [B, H·D] in the cache's dtype."""
    b, (kv_heads, d) = qkv.shape[0], (keys.shape[1], keys.shape[3])
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = q.view(b, 1, heads, d).transpose(1, 2)
    k, v = (t.view(b, 1, kv_heads, d).transpose(1, 2) for t in (k, v))
    rope = None if cos is None else (cos, sin)
    if (decode_attention.supported(q, keys, values, consume) and decode_attention.new_kv_fits((k, v), keys, consume)
            and (rope is None or decode_attention.rope_fits(rope, keys))):
        out = decode_attention.decode(q, keys, values, positions, scale, counters, new_kv=(k, v), rope=rope,
                                      consume=consume, cache_settled=cache_settled)
    else:
        out = decode_attention.reference_step(q, keys, values, positions, scale, (k, v), rope, consume)
    return out.reshape(b, heads * d)


@attend.register_fake
def _(qkv, keys, values, positions, cos, sin, counters, heads, scale, consume, cache_settled=False):
    return keys.new_empty(qkv.shape[0], heads * keys.shape[3])


@torch.library.custom_op("quantkit::dense_accumulate", mutates_args=("acc",), device_types="cuda")
def dense_accumulate(x: Tensor, weight: Tensor, acc: Tensor) -> None:
    """acc[: n·k] += x [n <= 8, d] @ weight [k, d]ᵀ in fp32 (fp16 inputs), not finished: the next operator
    consumes the sums."""
    dense_matvec.accumulate(x.contiguous(), weight, acc)


@dense_accumulate.register_fake
def _(x, weight, acc):
    return None


# --- CUDA matvec kernels -------------------------------------------------------------------------------


@torch.library.custom_op("quantkit::lut_matvec", mutates_args=("workspace",), device_types="cuda")
def lut_matvec(x: Tensor, qweight: Tensor, alpha: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
               group_size: int, workspace: Optional[Tensor], overlap: bool) -> Tensor:
    """x [n <= 8, d] @ BCQ weightᵀ (+ bias) -> fp16 [n, k] on the LUT kernels (kernels/lutgemm.py). alpha: [G, q, k],
    or plane 0's [G, 1, k] for n <= 2 where the planes are powers of two (lutgemm.matvec_alpha). workspace:
    the module's zero fp32 split-K buffer, left zero (None: the launch zeroes its own)."""
    t = lutgemm.BCQTensors(qweight, alpha, offset, group_size, x.shape[-1])
    return lutgemm.lut_matmul(x, t, bias, workspace=workspace, overlapped=overlap)


@lut_matvec.register_fake
def _(x, qweight, alpha, offset, bias, group_size, workspace, overlap):
    return x.new_empty(x.shape[0], qweight.shape[2], dtype=torch.float16)


@torch.library.custom_op("quantkit::lut_accumulate", mutates_args=("acc",), device_types="cuda")
def lut_accumulate(x: Tensor, qweight: Tensor, alpha: Tensor, offset: Optional[Tensor], group_size: int, acc: Tensor,
                   overlap: bool) -> None:
    """acc[: n·k] += x [n <= 8, d] @ BCQ weightᵀ in fp32, not finished: the next operator consumes the sums."""
    lutgemm.kernels().lut_accumulate(x.to(torch.float16).contiguous(), qweight, alpha, offset, group_size, acc,
                                     lutgemm.MMA_MIN_BATCH, overlap=overlap)


@lut_accumulate.register_fake
def _(x, qweight, alpha, offset, group_size, acc, overlap):
    return None


@torch.library.custom_op("quantkit::anyprec_matvec", mutates_args=(), device_types="cuda")
def anyprec_matvec(x: Tensor, planes: Tensor, lut: Tensor, bits: int, bias: Optional[Tensor], overlap: bool) -> Tensor:
    """x [n <= 8, d] (fp16/bf16) @ the bits-wide any-precision weightᵀ (+ bias) -> [n, k] in x's dtype;
    planes in the kernel layout (kernels/anyprec_gemm.py prepared_planes), lut fp16 [k, 2^bits]."""
    from quantkit.kernels import anyprec_gemm

    return anyprec_gemm.matvec(x, planes, lut, bits, -(-x.shape[-1] // 32), bias, overlapped=overlap)


@anyprec_matvec.register_fake
def _(x, planes, lut, bits, bias, overlap):
    return x.new_empty(x.shape[0], lut.shape[0])


# --- which operator serves a projection ----------------------------------------------------------------


def _lut_served(module, x):
    """The LUT kernels' extension when they serve `module` (a BCQ QuantLinear) for x [n, d] on CUDA."""
    if module.meta["format"] != "bcq" or not module.use_kernels:
        return None
    ops = lutgemm.kernels()
    if ops is None or not lutgemm.use_matvec(x.shape[0], module.out_features, module.in_features,
                                             module.meta["group_size"]):
        return None
    return ops


def _offset(module):
    return module.offset if module.meta["offset"] else None


def _anyprec_served(module, x):
    """(kernel-layout planes, table, bits) when the any-precision kernel serves `module` for x, else None."""
    if module.meta["format"] != "anyprec" or not module.use_kernels or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    bits = module.bits if module.bits is not None else module.meta["parent_bits"]
    lut = getattr(module, f"lut_{bits}", None)
    if lut is None or lut.dtype != torch.float16 or build.load("anyprec") is None:
        return None
    from quantkit.kernels import anyprec_gemm

    return anyprec_gemm.prepared_planes(module), lut, bits


def project(module, x):
    """module(x) for x [..., in_features]: a CUDA matvec operator for up to MATVEC_MAX_ROWS rows where one
    serves the module's format (BCQ: LUT-GEMM; any-precision), else the module's own forward (nn.Linear:
    cuBLAS; QuantLinear: dequantize + cuBLAS on CUDA, the dequantized reference on the CPU)."""
    if isinstance(module, QuantLinear) and x.is_cuda:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= MATVEC_MAX_ROWS:
            ops = _lut_served(module, x2)
            if ops is not None:
                offset = _offset(module)
                alpha = lutgemm.matvec_alpha(module, module.alpha, x2.shape[0])
                workspace = lutgemm.kept_workspace(module, x.device, module.out_features, ops)
                overlapped = overlap.enabled() and overlap.settled(module, module.qweight, alpha, offset)
                y = lut_matvec(x2, module.qweight, alpha, offset, module.bias, module.meta["group_size"],
                               workspace, overlapped)
                return y.to(x.dtype).view(*x.shape[:-1], module.out_features)
            served = _anyprec_served(module, x2)
            if served is not None:
                planes, lut, bits = served
                overlapped = overlap.enabled() and overlap.settled(module, planes, lut)
                bias = None if module.bias is None else module.bias.to(x.dtype)
                y = anyprec_matvec(x2, planes, lut, bits, bias, overlapped)
                return y.view(*x.shape[:-1], module.out_features)
    return module(x)


def project_sums(module, x):
    """The fp32 sums of module(x) left unfinished in the module's workspace ([..., out_features] view, to be
    consumed and cleared by the next operator) where the LUT kernels serve a bias-free BCQ module, or the
    split-K dense matvec a bias-free fp16 nn.Linear, for x on CUDA; None otherwise (nothing ran; call
    `project`)."""
    if not x.is_cuda or getattr(module, "bias", None) is not None:  # (a Concat has none)
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(module, nn.Linear) and dense_matvec.serves(module.weight, x2):
        workspace = dense_matvec.kept_workspace(module, x.device, module.out_features)
        if workspace is None:  # first use inside a CUDA-graph capture
            return None
        dense_accumulate(x2, module.weight, workspace)
        return workspace[: x2.shape[0] * module.out_features].view(*x.shape[:-1], module.out_features)
    if not isinstance(module, QuantLinear):
        return None
    ops = _lut_served(module, x2) if x2.shape[0] <= MATVEC_MAX_ROWS else None
    if ops is None:
        return None
    workspace = lutgemm.kept_workspace(module, x.device, module.out_features, ops)
    if workspace is None:  # first use inside a CUDA-graph capture: no kept buffer to leave the sums in
        return None
    offset = _offset(module)
    alpha = lutgemm.matvec_alpha(module, module.alpha, x2.shape[0])
    overlapped = overlap.enabled() and overlap.settled(module, module.qweight, alpha, offset)
    lut_accumulate(x2, module.qweight, alpha, offset, module.meta["group_size"], workspace, overlapped)
    return workspace[: x2.shape[0] * module.out_features].view(*x.shape[:-1], module.out_features)


def project_for_consumer(module, x):
    """(sums, True) from `project_sums` where the LUT kernels leave them, else (project(module, x), False):
    what the consuming operator's `consume` argument says."""
    sums = project_sums(module, x)
    return (sums, True) if sums is not None else (project(module, x), False)
