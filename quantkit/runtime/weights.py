"""Give a fast Decoder (runtime/model.py) its weights: from a quantkit artifact, or from a transformers model
(float, or with QuantLinear modules as `quantkit.load` makes it).

Tensors are found by the Llama family's checkpoint names (model.embed_tokens, model.layers.N.self_attn.q_proj,
..., lm_head); a tensor the decoder would not use is refused rather than ignored. Projections that read the
same input are stacked along their output rows at load time, in their stored format:
  float                 weights concatenated: one nn.Linear
  uniform (RTN, GPTQ)   packed rows and scales concatenated, zero points unpacked and packed again (they
                        are packed across rows); act-order column maps must be equal (q/k/v share one
                        input, so GPTQ gives them the same order)
  BCQ                   sign planes, α and offsets concatenated along their row axis
  any-precision         bitplanes and every width's tables concatenated along rows
  other formats, or parts that differ (bits, groups, offsets, widths): kept apart (model.Concat)
Missing biases of a stacked group are zeros. On CUDA every uniform projection without an act-order map is
converted to BCQ once, on the GPU (LUT-GEMM appendix C; what the LUT kernels run anyway, so its dense
weight is the one the kernels' dequantize gives), and the kernel-served formats keep no dequantized copy
(prefill dequantizes per call): memory stays at the packed size.
"""

from pathlib import Path

import torch
from torch import nn

from quantkit.artifact import read_config, read_quantized_tensors
from quantkit.errors import QuantkitError
from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.formats.bcq import BCQQuantizedTensor, bcq_from_uniform
from quantkit.formats.packing import pack_rows
from quantkit.formats.uniform import UniformQuantizedTensor
from quantkit.runtime.model import Concat, Decoder, DecoderConfig, UnsupportedModel
from quantkit.runtime.quant_linear import QuantLinear

KERNEL_FORMATS = ("bcq", "anyprec")  # served by matvec kernels on CUDA (runtime/ops.py)
GROUPS = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
          "w13": ("mlp.gate_proj", "mlp.up_proj"), "w2": ("mlp.down_proj",)}
NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q_norm": "self_attn.q_norm",
         "k_norm": "self_attn.k_norm"}


def stack_quantized(tensors):
    """One QuantizedTensor whose output rows are those of `tensors` in order, or None when they cannot be
    stacked (see the module docstring)."""
    first = tensors[0]
    if len({type(t) for t in tensors}) != 1 or len({t.in_features for t in tensors}) != 1:
        return None
    if isinstance(first, BCQQuantizedTensor):
        if len({(t.bits, t.group_size, t.offset is None) for t in tensors}) != 1:
            return None
        offset = None if first.offset is None else torch.cat([t.offset for t in tensors], dim=1)
        return BCQQuantizedTensor(qweight=torch.cat([t.qweight for t in tensors], dim=2),
                                  alpha=torch.cat([t.alpha for t in tensors], dim=2), offset=offset,
                                  bits=first.bits, group_size=first.group_size, in_features=first.in_features)
    if isinstance(first, UniformQuantizedTensor):
        if len({(t.bits, t.group_size, t.sym, t.g_idx is None) for t in tensors}) != 1:
            return None
        if first.g_idx is not None and not all(torch.equal(t.g_idx, first.g_idx) for t in tensors):
            return None
        qzeros = None
        if not first.sym:  # packed along rows, so a part's zeros may start mid-word: unpack, join, pack again
            zeros = torch.cat([t.zeros() for t in tensors]).to(torch.int64)  # [k, G]
            qzeros = pack_rows(zeros.t().contiguous(), first.bits)
        return UniformQuantizedTensor(qweight=torch.cat([t.qweight for t in tensors]),
                                      scales=torch.cat([t.scales for t in tensors]), qzeros=qzeros, bits=first.bits,
                                      group_size=first.group_size, in_features=first.in_features, sym=first.sym,
                                      g_idx=first.g_idx)
    if isinstance(first, AnyPrecisionTensor):
        if len({(t.seed_bits, t.parent_bits) for t in tensors}) != 1:
            return None
        return AnyPrecisionTensor(planes=torch.cat([t.planes for t in tensors], dim=1),
                                  luts={b: torch.cat([t.luts[b] for t in tensors]) for b in first.luts},
                                  seed_bits=first.seed_bits, parent_bits=first.parent_bits,
                                  in_features=first.in_features)
    return None


def _quant_linear(qtensor, bias, device, dtype, bits):
    qtensor = qtensor.to(device)
    if device.type == "cuda" and isinstance(qtensor, UniformQuantizedTensor) and qtensor.g_idx is None:
        qtensor = bcq_from_uniform(qtensor)
    kernel_served = device.type == "cuda" and qtensor.format_name in KERNEL_FORMATS
    return QuantLinear(qtensor, None if bias is None else bias.to(device), compute_dtype=dtype,
                       cache_weight=not kernel_served, bits=bits)


def _dense_linear(weight, bias, device, dtype):
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(device, dtype), requires_grad=False)
    return linear


def projection(parts, device, dtype, bits):
    """One module for the projections `parts` [(weight Tensor or QuantizedTensor, bias or None)], stacked
    along their output rows when they can be, else a Concat of one module each."""
    weights = [w for w, _ in parts]
    biases = [b for _, b in parts]
    if any(b is not None for b in biases):
        biases = [torch.zeros(w.shape[0]) if b is None else b.float() for w, b in zip(weights, biases)]
        bias = torch.cat(biases)
    else:
        bias = None
    if all(isinstance(w, torch.Tensor) for w in weights):
        return _dense_linear(torch.cat(weights), bias, device, dtype)
    stacked = None
    if not any(isinstance(w, torch.Tensor) for w in weights):
        stacked = stack_quantized([w.to(device) for w in weights]) if len(weights) > 1 else weights[0]
    if stacked is not None:
        return _quant_linear(stacked, bias, device, dtype, bits if stacked.format_name == "anyprec" else None)
    return Concat([projection([part], device, dtype, bits) for part in parts])


class _Tensors:
    """The checkpoint's tensors by name, each taken at most once; what is left at the end is refused."""

    def __init__(self, floats, quantized, where):
        self.floats, self.quantized, self.where = dict(floats), dict(quantized), where

    def float(self, name, required=True):
        if name not in self.floats:
            if required:
                raise QuantkitError(f"{self.where}: no tensor {name}")
            return None
        return self.floats.pop(name)

    def linear(self, name):
        """(weight Tensor or QuantizedTensor, bias or None) of linear `name`."""
        weight = self.quantized.pop(name, None)
        if weight is None:
            weight = self.float(f"{name}.weight")
        return weight, self.float(f"{name}.bias", required=False)

    def check_all_used(self):
        left = sorted(n for n in [*self.floats, *self.quantized] if not n.endswith("rotary_emb.inv_freq"))
        if left:
            raise UnsupportedModel(f"{self.where}: tensors the fast decoder has no place for: {', '.join(left[:4])}")


def build_decoder(cfg: DecoderConfig, floats: dict, quantized: dict, device="cpu", dtype=None, bits=None, where=""):
    """A Decoder on `device` in `dtype` from checkpoint tensors: `floats` {name: Tensor} and `quantized`
    {linear name: QuantizedTensor}. `bits` serves that width of any-precision projections."""
    device = torch.device(device)
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    tensors = _Tensors(floats, quantized, where or "checkpoint")
    if bits is not None and not any(isinstance(q, AnyPrecisionTensor) for q in quantized.values()):
        raise QuantkitError(f"{where}: --bits applies only to any-precision artifacts")
    with torch.device("meta"):
        model = Decoder(cfg)
    model.embed.weight = nn.Parameter(tensors.float("model.embed_tokens.weight").to(device, dtype), requires_grad=False)
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for attr, names in GROUPS.items():
            parts = [tensors.linear(prefix + n) for n in names]
            if attr == "wqkv" and any(b is not None for _, b in parts) != cfg.attention_bias:
                raise QuantkitError(f"{where}: layer {i} has {'no ' if cfg.attention_bias else ''}q/k/v biases, "
                                    f"but its config says attention_bias={cfg.attention_bias}")
            setattr(block, attr, projection(parts, device, dtype, bits))
        for attr, name in NORMS.items():
            if hasattr(block, attr):
                norm = getattr(block, attr)
                norm.weight = nn.Parameter(tensors.float(f"{prefix}{name}.weight").to(device, dtype),
                                           requires_grad=False)
    model.norm.weight = nn.Parameter(tensors.float("model.norm.weight").to(device, dtype), requires_grad=False)
    head = tensors.float("lm_head.weight", required=not cfg.tie_word_embeddings)
    model.lm_head = model.embed.weight if head is None else nn.Parameter(head.to(device, dtype), requires_grad=False)
    tensors.check_all_used()
    return model.eval()


def load_decoder(path, device="cpu", dtype=None, verify=True, bits=None):
    """The fast Decoder of the quantkit artifact at `path` (UnsupportedModel for architectures it does not serve)."""
    from quantkit.runtime.loader import _model_config

    path = Path(path)
    config_dict = read_config(path)
    cfg = DecoderConfig.from_transformers(_model_config(config_dict))  # refuse before reading the tensors
    quantized, floats = read_quantized_tensors(path, config_dict["quantization_config"]["modules"], verify=verify)
    return build_decoder(cfg, floats, quantized, device, dtype, bits, where=str(path))


def decoder_from_transformers(model, device=None, dtype=None):
    """The fast Decoder holding the weights of a transformers Llama-family model (float, or with QuantLinear
    modules; any-precision ones keep their served width). The model's tensors are shared, not copied,
    except where projections are stacked."""
    cfg = DecoderConfig.from_transformers(model.config)
    quantized, bits = {}, set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            quantized[name] = module.qtensor()
            bits.add(module.bits)
    skip = tuple(f"{name}." for name in quantized)
    floats = {n: t for n, t in model.state_dict().items() if not n.startswith(skip) or n.endswith(".bias")}
    if len(bits) > 1:
        raise QuantkitError(f"the model's any-precision projections serve different widths: {sorted(bits, key=str)}")
    param = next(model.parameters())
    return build_decoder(cfg, floats, quantized, device or param.device, dtype or param.dtype,
                         next(iter(bits)) if bits else None, where=type(model).__name__)
