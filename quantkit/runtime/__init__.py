"""Running artifacts: QuantLinear modules and the model rebuilt from an artifact."""

from quantkit.runtime.loader import load_quantized
from quantkit.runtime.quant_linear import QuantLinear

__all__ = ["load_quantized", "QuantLinear"]
