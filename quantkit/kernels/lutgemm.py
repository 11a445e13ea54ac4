"""LUT-GEMM on CUDA for BCQ QuantLinear layers, and for uniform (RTN/GPTQ) ones through the BCQ
conversion (LUT-GEMM appendix C, formats.bcq.bcq_from_uniform).

Two paths, chosen by the number of tokens (rows of x):
  * tokens <= MATVEC_MAX_TOKENS: the LUT kernel (kernels/lutgemm_lut_kernel.cuh) reads the packed sign
    planes directly: fp16 activations, fp32 accumulation, fp16 output (converted to x.dtype). It runs 8
    tokens per launch; launches of MMA_MIN_BATCH..8 tokens go to the tensor-core kernel instead
    (kernels/lutgemm_mma_kernel.cuh: sign bits turned into fp16 mma operands in registers, one AND per
    pair of weights, mma.sync), where the groups allow it, because at 8 columns a LUT read moves 16 bytes
    of shared memory per 8 weights.
  * more tokens (prefill, perplexity): the dequantize kernel writes the dense weight in x.dtype
    (bit-identical to the reference dequantization) and cuBLAS does the GEMM; the weight goes into
    QuantLinear's own cache when module.cache_weight is true.
The LUT kernel needs out_features % 4 == 0 and whole 32-column words per group (group_size % 32
== 0, or one group per row); other layers always take the dequantize path. For 2..8 columns of x
its tables hold fp16 sums of 8 activations and a word's 4 lookups are added in fp16, so sums of 32
consecutive |x| must stay below 65504 (one column uses fp32 tables).

Uniform layers run on their converted BCQ tensors in both paths; the converted weight differs from
the uniform dequantization only by the fp16 rounding of the offset z (formats.bcq.bcq_from_uniform),
and it is what lands in the weight cache.

The matvec kernels split a row tile's columns over several blocks and add their fp32 partial sums
with atomics, in whatever order the blocks finish, so repeated calls can differ in the last bits of
the fp16 output (docs/lutgemm-kernel.md: 21-50 distinct outputs in 50 calls, at most 0.004 apart).
Greedy decoding of a model whose logits nearly tie can therefore differ between runs. Under
torch.use_deterministic_algorithms(True) every call takes the dequantize path instead, whose kernel
writes each weight once (cuBLAS then needs CUBLAS_WORKSPACE_CONFIG, as torch says).

`accumulate` is the matvec path stopped one step early: the kernels add x @ weightᵀ into the module's
fp32 split-K workspace and leave it there, without the tile counter, the read-back and the fp16
store that finish a call (~1.1-1.4 µs of a 10-20 µs call at the Llama-2-7B decode shapes). Whoever
asks for it reads the sums and zeroes them (the fast decoder does, in the kernel that consumes them:
runtime/ops.py).

A uniform layer's BCQ form has power-of-two planes, α_i = 2^(i−1)·s. For up to COMPACT_ALPHA_MAX_TOKENS
tokens the LUT kernel then reads only plane 0's α and makes the others (`matvec_alpha`): at q = 4, 4.25
instead of 4.625 bits read per weight; the fp32 sums agree with the full α's to rounding (docs/lutgemm-kernel.md).

On sm_90+ the matvec launches use programmatic dependent launch (kernels/overlap.py): each starts
copying its weights while the kernel before it is still running, and reads x only after it has ended;
a module's first call with new weights launches without it (overlap.settled).

Importing this module registers `forward` and `accumulate` for "bcq" and "uniform" with
quantkit.kernels.dispatch; both return None (-> PyTorch reference, or the caller's ordinary path) when
the extension cannot be built or the input is not one they serve.
"""

import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from quantkit.formats.bcq import bcq_from_uniform
from quantkit.formats.uniform import num_groups
from quantkit.kernels import build, overlap
from quantkit.kernels.dispatch import kept_zero_buffer, register

# Largest token count served by the LUT kernel, chosen by benchmarks/bench_lutgemm.py "crossover" (H100):
# against a cached fp16 weight the LUT kernel loses from 12 tokens on 4096x4096, 11008x4096 and
# 49152x12288 q3 g128 (against dequantize + cuBLAS only from 48-64), so 8 = one launch.
MATVEC_MAX_TOKENS = 8

# Smallest launch (columns of x, at most 8) served by the tensor-core kernel instead of the LUT one,
# when group_size % 128 == 0 or one group per row; chosen by bench_lutgemm.py "batch sweep" (H100,
# 49152x12288 q3 g128): the LUT kernel wins up to 4 columns (103-128 us), then its padded 8-column
# tables cost 212-218 us against 150-157 us on tensor cores. 9 would turn the tensor-core kernel off.
MMA_MIN_BATCH = 5

# Most tokens for which the LUT kernel takes a compact α (kCompactAlphaMaxBatch in kernels/lutgemm_common.cuh: its
# compact instances serve 1-2 columns, where the decode measured them; from 5 the tensor-core kernel reads every
# plane's α).
COMPACT_ALPHA_MAX_TOKENS = 2

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the dequantize kernel writes

_CONVERTED_ATTR = "_lutgemm_bcq"  # uniform modules: (device, BCQTensors), a plain attribute
_WORKSPACE_ATTR = "_lutgemm_workspace"  # fp32 partial sums + tile counters, all zero between launches
_COMPACT_ALPHA_ATTR = "_lutgemm_compact_alpha"  # (key of alpha, alpha[:, :1] or None), a plain attribute


@dataclass(frozen=True)
class BCQTensors:
    """The stored BCQ tensors of one weight on one device (layout in formats/bcq.py)."""

    qweight: torch.Tensor  # int32 [q, W, k]
    alpha: torch.Tensor  # fp16 [G, q, k]
    offset: torch.Tensor  # fp16 [G, k] or None
    group_size: int
    in_features: int

    @property
    def out_features(self):
        return self.qweight.shape[2]


def kernels():
    """The compiled extension, or None (CUDA absent, QUANTKIT_NO_KERNELS=1, build failed)."""
    return build.load("lutgemm")


def matvec_supported(out_features, in_features, group_size):
    """Whether the LUT kernel can serve this weight (see the module docstring)."""
    whole_words = group_size % 32 == 0 or num_groups(in_features, group_size) == 1
    # the kernel addresses planes and scales with 32-bit element offsets: q·words·k < 2^31 for q <= 8
    # (groups <= words whenever whole_words holds)
    small = 8 * ((in_features + 31) // 32) * out_features < 2**31
    return out_features % 4 == 0 and whole_words and small


def use_matvec(tokens, out_features, in_features, group_size):
    """The switch rule: LUT kernel for few tokens, dequantize + cuBLAS beyond MATVEC_MAX_TOKENS, and
    always the latter under torch.use_deterministic_algorithms(True), since the matvec kernels' atomics
    do not add in a fixed order (see the module docstring)."""
    return (0 < tokens <= MATVEC_MAX_TOKENS and matvec_supported(out_features, in_features, group_size)
            and not torch.are_deterministic_algorithms_enabled())


def lut_matmul(x, t: BCQTensors, bias=None, ops=None, mma_min_batch=None, workspace=None, overlapped=False):
    """x [n, d] (any float dtype, CUDA) @ weightᵀ (+ bias) with the LUT kernel (launches of at least
    mma_min_batch columns, default MMA_MIN_BATCH, on the tensor-core kernel) -> fp16 [n, k].
    workspace: a zero fp32 tensor of at least ops.workspace_floats(n, k) elements, which the kernels
    leave zero (None: a fresh zeroed one per call, i.e. one memset more). overlapped: launch with
    overlap (kernels/overlap.py; the weights must not be written by the kernels just before)."""
    ops = ops or kernels()
    x = x.to(torch.float16).contiguous()
    out = torch.empty(x.shape[0], t.out_features, dtype=torch.float16, device=x.device)
    if bias is not None:
        bias = bias.to(torch.float16).contiguous()
    ops.lut_gemm(x, t.qweight, t.alpha, t.offset, bias, t.group_size, out,
                 MMA_MIN_BATCH if mma_min_batch is None else mma_min_batch, workspace, overlap=overlapped)
    return out


def kept_workspace(module, device, out_features, ops):
    """The module's LUT workspace on `device` for up to MATVEC_MAX_TOKENS columns (dispatch.kept_zero_buffer;
    None inside a capture, and that launch zeroes its own)."""
    return kept_zero_buffer(module, _WORKSPACE_ATTR, device, ops.workspace_floats(MATVEC_MAX_TOKENS, out_features))


def power_of_two_planes(alpha):
    """alpha [G, q, k][:, :1] (contiguous) when every plane is plane 0 times 2^i exactly, as in a uniform
    weight's BCQ form; else None (q = 1 included)."""
    q = alpha.shape[1]
    if q < 2:
        return None
    scales = torch.exp2(torch.arange(q, device=alpha.device, dtype=torch.float32)).view(1, q, 1)
    if not torch.equal(alpha.float(), alpha[:, :1].float() * scales):
        return None
    return alpha[:, :1].contiguous()


def _alpha_key(alpha):
    return alpha.data_ptr(), tuple(alpha.shape), overlap.version(alpha)


def matvec_alpha(module, alpha, tokens):
    """The α the matvec kernels read for `tokens` rows of x: the compact alpha[:, :1] where the planes are
    powers of two (`power_of_two_planes`) and tokens <= COMPACT_ALPHA_MAX_TOKENS, else `alpha`. Decided
    once per module and α tensor (its storage, shape and version); not first decided while a CUDA graph is
    being captured or torch.compile traces (the check reads the GPU's values), which then read `alpha`.
    Not seen, as for overlap.settled: writes that bypass the version counter (through `.data`, into an
    inference tensor); after one, delete the module's `_lutgemm_compact_alpha`. A captured graph reads the
    compact copy it was captured with."""
    if tokens > COMPACT_ALPHA_MAX_TOKENS:
        return alpha
    cached = getattr(module, _COMPACT_ALPHA_ATTR, None)
    if cached is None or cached[0][0]() is not alpha or cached[0][1] != _alpha_key(alpha):
        if torch.compiler.is_compiling() or (alpha.is_cuda and torch.cuda.is_current_stream_capturing()):
            return alpha
        cached = ((weakref.ref(alpha), _alpha_key(alpha)), power_of_two_planes(alpha))
        setattr(module, _COMPACT_ALPHA_ATTR, cached)
    return alpha if cached[1] is None else cached[1]


def dequantize(t: BCQTensors, dtype=torch.float16, ops=None):
    """The dense weight [k, d] in `dtype`, equal to BCQQuantizedTensor.dequantize(dtype) bit for bit."""
    ops = ops or kernels()
    out = torch.empty(t.out_features, t.in_features, dtype=dtype, device=t.qweight.device)
    ops.dequantize(t.qweight, t.alpha, t.offset, t.group_size, out)
    return out


def _stored(module) -> BCQTensors:
    meta = module.meta
    return BCQTensors(module.qweight, module.alpha, getattr(module, "offset", None) if meta["offset"] else None,
                      meta["group_size"], meta["in_features"])


def converted(module) -> BCQTensors:
    """A uniform module's weight as BCQ tensors, converted once per device and kept on the module."""
    device = module.qweight.device
    cached = getattr(module, _CONVERTED_ATTR, None)
    if cached is None or cached[0] != device:
        bt = bcq_from_uniform(module.qtensor())
        cached = (device, BCQTensors(bt.qweight, bt.alpha, bt.offset, bt.group_size, bt.in_features))
        setattr(module, _CONVERTED_ATTR, cached)
    return cached[1]


def _dense_weight(module, t, x, ops):
    # the same cache slot and key as QuantLinear's reference path, so either path reuses the other's weight
    key = (x.device, x.dtype, module.bits)
    if module._cached is not None and module._cached[0] == key:
        return module._cached[1]
    weight = dequantize(t, x.dtype, ops)
    if module.cache_weight:
        module._cached = (key, weight)
    return weight


def _overlapped(module, t: BCQTensors):
    """Launch with overlap: enabled, and the module's weights settled (overlap.settled)."""
    return overlap.enabled() and overlap.settled(module, t.qweight, t.alpha, t.offset)


def linear(module, x, t: BCQTensors, ops):
    """QuantLinear forward on the kernels: y [..., k] in x.dtype, bias included."""
    if x.dtype not in DENSE_DTYPES or x.shape[-1] != t.in_features:
        return None
    k = t.out_features
    x2 = x.reshape(-1, t.in_features)
    tokens = x2.shape[0]
    if tokens == 0:
        return x.new_empty(*x.shape[:-1], k)
    if use_matvec(tokens, k, t.in_features, t.group_size):
        tm = replace(t, alpha=matvec_alpha(module, t.alpha, tokens))
        y = lut_matmul(x2, tm, module.bias, ops, workspace=kept_workspace(module, x.device, k, ops),
                       overlapped=_overlapped(module, tm)).to(x.dtype)
    else:
        bias = None if module.bias is None else module.bias.to(x.dtype)
        y = F.linear(x2, _dense_weight(module, t, x, ops), bias)
    return y.reshape(*x.shape[:-1], k)


def accumulate_into_workspace(module, x, t: BCQTensors, ops):
    """x @ weightᵀ (no bias) added into the module's zero workspace, returned as its fp32 [..., k] view;
    None where the LUT kernels do not serve the call (then nothing ran). Rounding the view to fp16 gives
    what `linear` returns. The caller must read the view and zero it before the module runs again."""
    if x.dtype not in DENSE_DTYPES or x.shape[-1] != t.in_features or module.bias is not None:
        return None
    k = t.out_features
    x2 = x.reshape(-1, t.in_features)
    tokens = x2.shape[0]
    if not use_matvec(tokens, k, t.in_features, t.group_size):
        return None
    ws = kept_workspace(module, x.device, k, ops)
    if ws is None:
        return None
    tm = replace(t, alpha=matvec_alpha(module, t.alpha, tokens))
    ops.lut_accumulate(x2.to(torch.float16).contiguous(), tm.qweight, tm.alpha, tm.offset, tm.group_size, ws,
                       MMA_MIN_BATCH, overlap=_overlapped(module, tm))
    return ws[: tokens * k].view(*x.shape[:-1], k)


def _tensors(module):
    """The module's BCQ tensors for the kernels, or None (act-order uniform layouts are not served)."""
    if module.meta["format"] == "uniform":
        return None if module.meta.get("has_g_idx") else converted(module)
    return _stored(module)


def forward(module, x):
    """dispatch hook for formats "bcq" and "uniform" (on its BCQ form)."""
    ops = kernels()
    t = None if ops is None else _tensors(module)
    return None if t is None else linear(module, x, t, ops)


def accumulate(module, x):
    """dispatch accumulate hook for formats "bcq" and "uniform": see accumulate_into_workspace."""
    ops = kernels()
    t = None if ops is None else _tensors(module)
    return None if t is None else accumulate_into_workspace(module, x, t, ops)


register("bcq", forward, accumulate)
register("uniform", forward, accumulate)
