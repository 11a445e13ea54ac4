"""The compressed-tensors `pack-quantized` format (what llm-compressor writes; vLLM, SGLang and
transformers load it).

Per linear of a [k, d] weight with b-bit codes and G groups:
  weight_packed      int32 [k, ceil(d·b/32)]  signed codes q − 2^(b−1), stored offset by 2^(b−1):
                                              the same LSB-first bitstream per row as quantkit's qweight
  weight_scale       fp16  [k, G]
  weight_zero_point  int32 [ceil(k·b/32), G]  asymmetric only: signed zero points z − 2^(b−1), packed
                                              along the output dimension (quantkit's qzeros transposed)
  weight_shape       int64 [2]                (k, d)
Groups are contiguous columns: current compressed-tensors has no per-column group index, so
act-order artifacts without static groups (which store g_idx) are refused; with static groups
(quantkit's default) act-order needs none.
Dequantization: w = (q_signed − z_signed) · s, identical to quantkit's (q − z) · s.
"""

import torch

from quantkit.errors import QuantkitError


def check(settings: dict, checkpoint_format=None):
    """Refuse what the format cannot represent (whole groups are checked for every target by the caller)."""
    if settings["act_order_g_idx"]:
        raise QuantkitError("act-order without static groups stores a column -> group index, which "
                            "compressed-tensors no longer represents; use --to gptq, or re-quantize with "
                            "--static-groups (the default)")


def module_tensors(qt, checkpoint_format=None) -> dict:
    k, d = qt.shape
    tensors = {"weight_packed": qt.qweight.contiguous(), "weight_scale": qt.scales.to(torch.float16).contiguous(),
               "weight_shape": torch.tensor([k, d], dtype=torch.int64)}
    if not qt.sym:
        tensors["weight_zero_point"] = qt.qzeros.t().contiguous()
    return tensors


def quantization_config(settings: dict, checkpoint_format=None, float_linears=list) -> dict:
    """config.json's quantization_config; float_linears() names the nn.Linear modules kept in float."""
    per_channel = settings["group_size"] == -1
    weights = {
        "num_bits": settings["bits"],
        "type": "int",
        "symmetric": settings["sym"],
        "strategy": "channel" if per_channel else "group",
        "group_size": None if per_channel else settings["group_size"],
        "actorder": None,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": float_linears(),
        "kv_cache_scheme": None,
    }
