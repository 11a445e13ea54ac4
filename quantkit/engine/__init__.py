from quantkit.engine.driver import capture_layer_inputs, quantize_model

__all__ = ["capture_layer_inputs", "quantize_model"]
