"""Running artifacts: QuantLinear modules and the transformers model rebuilt from an artifact (the reference
path), and the fast decoder for the Llama family (model.py, weights.py, ops.py, generate.py)."""

from quantkit.runtime.loader import load_quantized
from quantkit.runtime.quant_linear import QuantLinear

__all__ = ["load_quantized", "QuantLinear"]
