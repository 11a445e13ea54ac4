"""quantkit: offline post-training weight quantization for Hugging Face causal LMs."""

__version__ = "0.1.0"


def load(path, device="cpu", dtype=None, verify=True):
    """Load a quantkit artifact directory as a transformers model with QuantLinear modules."""
    from quantkit.runtime.loader import load_quantized

    return load_quantized(path, device=device, dtype=dtype, verify=verify)
