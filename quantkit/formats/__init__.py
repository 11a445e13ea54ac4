"""Stored layouts of quantized weights: pack, unpack, dequantize and count bits exactly."""

from quantkit.formats import (
    anyprec,  # noqa: F401  (registers the "anyprec" format)
    bcq,  # noqa: F401  (registers the "bcq" format)
    ooc,  # noqa: F401  (registers the "ooc" format)
)
from quantkit.formats.base import FORMATS, QuantizedTensor, quantized_tensor_from_state_dict
from quantkit.formats.uniform import UniformQuantizedTensor

__all__ = ["FORMATS", "QuantizedTensor", "quantized_tensor_from_state_dict", "UniformQuantizedTensor"]
