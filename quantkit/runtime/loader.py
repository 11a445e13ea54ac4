"""Rebuild a transformers model from a quantkit artifact, with QuantLinear modules."""

import logging
from pathlib import Path

import torch

from quantkit.artifact import read_config, read_tensors, split_module_tensors
from quantkit.errors import QuantkitError
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.runtime.experts import replace_fused_experts
from quantkit.runtime.quant_linear import QuantLinear

log = logging.getLogger(__name__)


def _model_config(config_dict: dict):
    from transformers import AutoConfig

    plain = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    model_type = plain.pop("model_type", None)
    if model_type is None:
        raise QuantkitError("artifact config.json has no model_type")
    return AutoConfig.for_model(model_type, **plain)


def load_quantized(path, device="cpu", dtype=None, verify=True, bits=None):
    """Return a causal LM whose quantized linears are QuantLinear modules, in eval mode. `bits`
    serves that width of an any-precision artifact (None: its parent width)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config_dict = read_config(path)
    qcfg = config_dict["quantization_config"]
    dtype = dtype or (torch.float16 if str(device).startswith("cuda") else torch.float32)
    config = _model_config(config_dict)
    tensors = read_tensors(path, verify=verify)
    per_module, rest = split_module_tensors(tensors, qcfg["modules"])
    if bits is not None and any(meta.get("format") != "anyprec" for meta in qcfg["modules"].values()):
        raise QuantkitError(f"{path}: --bits applies only to any-precision artifacts (method anyprec/squeezellm)")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    replace_fused_experts(model, copy_weights=False)  # the artifact stores one matrix per expert
    for name, meta in qcfg["modules"].items():
        qtensor = quantized_tensor_from_state_dict(meta, per_module[name])
        bias = rest.pop(f"{name}.bias", None)
        model.set_submodule(name, QuantLinear(qtensor, bias, compute_dtype=dtype, bits=bits))
    rest = {k: v.to(dtype) if v.is_floating_point() else v for k, v in rest.items()}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    if unexpected:
        raise QuantkitError(f"{path}: unexpected tensors in artifact: {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise QuantkitError(f"{path}: artifact lacks tensors for {still_meta[:5]}")
    model.config.use_cache = False
    model.eval()
    return model.to(device)
