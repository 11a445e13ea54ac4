"""The layer-by-layer quantization engine: calibration inputs, statistics, the driver."""

from quantkit.engine.driver import capture_layer_inputs, quantize_model

__all__ = ["capture_layer_inputs", "quantize_model"]
