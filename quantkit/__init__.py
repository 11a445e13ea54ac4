"""quantkit: offline post-training weight quantization for Hugging Face causal LMs."""

__version__ = "0.1.0"


def _register_with_transformers():
    """`AutoModelForCausalLM.from_pretrained(artifact)` works once quantkit is imported (see
    quantkit/integrations/transformers.py); registration waits until transformers is imported."""
    from quantkit.integrations import register_with_transformers

    register_with_transformers()


_register_with_transformers()


def load(path, device="cpu", dtype=None, verify=True, bits=None, runtime="transformers"):
    """Load a quantkit artifact directory as a transformers model whose quantized linears are QuantLinear
    modules (CUDA kernels on CUDA inputs, the dequantize reference elsewhere), in eval mode; or, with
    runtime="fast", as quantkit's own Llama-family decoder (quantkit.runtime.model.Decoder: stacked
    projections, static KV cache; generate with quantkit.runtime.generate.generate or FastGenerator).

    device: "cpu", "cuda[:N]", or None for cuda when available. dtype: compute dtype, a torch.dtype or
    its name ("float16", "bfloat16", "float32"), or "auto" [auto: on cuda the dtype of the checkpoint it was
    made from when bfloat16 or float16, else float16; float32 on cpu]. verify: check the
    shards' checksums. bits: serve this width of an any-precision artifact (None: its parent width;
    `QuantLinear.set_bits` switches it later). The config keeps use_cache=False for perplexity;
    `model.generate` uses the KV cache anyway when called with use_cache=True
    (quantkit.runtime.generate.generate does).
    """
    from quantkit.errors import QuantkitError
    from quantkit.models.loading import Source, checkpoint_dtype
    from quantkit.pipeline import resolve_device, resolve_dtype
    from quantkit.runtime.loader import load_quantized
    from quantkit.runtime.weights import load_decoder

    device = resolve_device(device)
    native = checkpoint_dtype(Source("artifact", str(path)))
    dtype = resolve_dtype(dtype, device, native)
    if runtime == "fast":
        return load_decoder(path, device=device, dtype=dtype, verify=verify, bits=bits)
    if runtime != "transformers":
        raise QuantkitError(f"runtime must be 'transformers' or 'fast', not {runtime!r}")
    return load_quantized(path, device=device, dtype=dtype, verify=verify, bits=bits)
