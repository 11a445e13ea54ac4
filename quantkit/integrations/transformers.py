"""`AutoModelForCausalLM.from_pretrained(artifact)` once quantkit is imported: a quantization config
class and an HfQuantizer registered under quant_method "quantkit".

Before the weights load, every quantized linear becomes a shell module whose parameters carry the
names, shapes and dtypes of the artifact's stored tensors (read from the safetensors headers), so
transformers fills them like any checkpoint tensor; after loading, each shell becomes the QuantLinear
that quantkit.load builds from the same tensors. Checksums are not verified on this path
(transformers reads the files itself): `quantkit.load` verifies them.
"""

from pathlib import Path

import torch

from quantkit.artifact import read_header
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.runtime.experts import replace_fused_experts
from quantkit.runtime.quant_linear import QuantLinear

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
           "I64": torch.int64, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _StoredTensors(torch.nn.Module):
    """Placeholder for one quantized linear: a frozen parameter per stored tensor, filled by the loader."""

    def __init__(self, specs: dict, bias):
        super().__init__()
        for name, (dtype, shape) in specs.items():
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                                             requires_grad=False))
        self.bias = bias
        self.stored_dtypes = {name: dtype for name, (dtype, _) in specs.items()}


def _stored_specs(checkpoint_files, modules) -> dict:
    """{module: {tensor name: (dtype, shape)}} from the tensor files' headers."""
    specs = {name: {} for name in modules}
    for path in checkpoint_files or ():
        for key, entry in read_header(Path(path)).items():
            if key == "__metadata__":
                continue
            module, _, short = key.rpartition(".")
            if module in specs and short != "bias":
                specs[module][short] = (_DTYPES[entry["dtype"]], entry["shape"])
    return specs


def register() -> bool:
    """Register with transformers' quantizer registry; False where this transformers has none."""
    try:
        from transformers.quantizers.auto import (
            AUTO_QUANTIZATION_CONFIG_MAPPING,
            register_quantization_config,
            register_quantizer,
        )
        from transformers.quantizers.base import HfQuantizer  # the package itself may still be importing
        from transformers.utils.quantization_config import QuantizationConfigMixin
    except ImportError:
        return False
    if "quantkit" in AUTO_QUANTIZATION_CONFIG_MAPPING:
        return True

    @register_quantization_config("quantkit")
    class QuantkitConfig(QuantizationConfigMixin):
        """The artifact's quantization_config, kept whole (method settings, per-module formats, files)."""

        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)
            self.quant_method = "quantkit"

        def to_dict(self):
            # The tensor files' checksums describe the artifact as quantkit wrote it; a save_pretrained
            # copy is other files, so it is written unsealed (no checksums) and quantkit.load says so.
            out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
            out["files"] = {}
            return out

    @register_quantizer("quantkit")
    class QuantkitHfQuantizer(HfQuantizer):
        requires_calibration = True  # an artifact is made by `quantkit quantize`, not at load time

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            modules = self.quantization_config.modules
            specs = _stored_specs(checkpoint_files, modules)
            replace_fused_experts(model, copy_weights=False)  # the artifact stores one matrix per expert
            for name in modules:
                linear = model.get_submodule(name)
                model.set_submodule(name, _StoredTensors(specs[name], linear.bias))
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            dtype = model.dtype
            for name, meta in self.quantization_config.modules.items():
                shell = model.get_submodule(name)
                tensors = {key: getattr(shell, key).data.to(stored) for key, stored in shell.stored_dtypes.items()}
                qtensor = quantized_tensor_from_state_dict(meta, tensors)
                model.set_submodule(name, QuantLinear(qtensor, shell.bias, compute_dtype=dtype).to(
                    next(iter(tensors.values())).device))
            return model

        def is_serializable(self):
            return True

        @property
        def is_trainable(self):
            return False

    return True
