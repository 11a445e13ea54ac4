"""The GPTQ checkpoint format (AutoGPTQ / GPTQModel; what vLLM's and transformers' GPTQ loaders read).

Per linear of a [k, d] weight with b-bit codes, G = d / g groups:
  qweight  int32 [d·b/32, k]   codes packed along the input dimension: for each output column an
                               LSB-first bitstream over the inputs (b = 3 straddles words, as the
                               GPTQ reference packs it). This is quantkit's qweight transposed.
  qzeros   int32 [G, k·b/32]   zero points packed along the output dimension; checkpoint_format
                               "gptq" (v1) stores z − 1, "gptq_v2" stores z.
  scales   fp16  [G, k]
  g_idx    int32 [d]           column -> group (act-order without static groups), else column // g
Dequantization: w[c, r] = (q[c, r] − z[g_idx[c], r]) · s[g_idx[c], r].
"""

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.packing import pack_rows

BITS = (2, 3, 4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def check(settings: dict, checkpoint_format: str):
    """Refuse what the GPTQ format or vLLM's GPTQ loaders cannot take, naming what can (whole groups are
    checked for every target by the caller)."""
    bits = settings["bits"]
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise QuantkitError(f"--checkpoint-format must be one of {', '.join(CHECKPOINT_FORMATS)}, "
                            f"got {checkpoint_format!r}")
    if bits not in BITS:
        raise QuantkitError(f"the GPTQ format packs {'/'.join(map(str, BITS))}-bit codes, not {bits}-bit; "
                            "--to compressed-tensors stores any width from 1 to 8")
    if not settings["sym"] and checkpoint_format == "gptq":
        raise QuantkitError("asymmetric weights: vLLM's GPTQ kernels assume symmetric zero points and would "
                            "decode them wrongly; use --to compressed-tensors (zero points kept), or "
                            "--checkpoint-format gptq_v2 for GPTQModel")
    for d in settings["in_features"]:
        if d * bits % 32:
            raise QuantkitError(f"input width {d} at {bits} bits does not fill whole int32 words; the GPTQ "
                                "format packs whole words (--to compressed-tensors pads them)")
    for k in settings["out_features"]:
        if k * bits % 32:
            raise QuantkitError(f"output width {k} at {bits} bits does not fill whole int32 words of qzeros")


def module_tensors(qt, checkpoint_format: str) -> dict:
    """The GPTQ tensors of one UniformQuantizedTensor (checked beforehand with check())."""
    k, d = qt.shape
    zeros = qt.zeros().to(torch.int64)  # [k, G]
    if checkpoint_format == "gptq":
        zeros = zeros - 1  # v1 convention; check() admits only symmetric weights here, so z - 1 >= 0
    return {
        "qweight": qt.qweight.t().contiguous(),
        "qzeros": pack_rows(zeros.t().contiguous(), qt.bits),
        "scales": qt.scales.t().contiguous().to(torch.float16),
        "g_idx": qt.column_groups().to(torch.int32).contiguous(),
    }


def quantization_config(settings: dict, checkpoint_format: str, float_linears=None) -> dict:
    """config.json's quantization_config and quantize_config.json (float linears are implied: lm_head)."""
    return {
        "quant_method": "gptq",
        "bits": settings["bits"],
        "group_size": settings["group_size"],
        "desc_act": settings["act_order_g_idx"],
        "sym": settings["sym"],
        "static_groups": False,
        "true_sequential": True,
        "lm_head": False,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "meta": {"quantizer": ["quantkit"]},
    }
