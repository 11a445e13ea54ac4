"""Helpers shared by the GPTQ and OOC tests."""

import torch

# the textbook algorithm: no act-order, dynamic groups, no clipping search (the method's defaults
# turn all three on, see BENCHMARKS.md)
PLAIN = {"act_order": False, "static_groups": False, "clip_search": False}


def hessian_stats(x, nsamples=4):
    return {"xtx": x.t() @ x, "nsamples": nsamples, "ntokens": x.shape[0]}


def correlated_inputs(n, d, gen, dtype=torch.float32):
    """Tokens from a low-rank mix plus noise, with uneven channel scales (like LLM activations)."""
    rank = max(4, d // 4)
    mix = torch.randn(rank, d, generator=gen, dtype=dtype)
    x = torch.randn(n, rank, generator=gen, dtype=dtype) @ mix + 0.3 * torch.randn(n, d, generator=gen, dtype=dtype)
    return x * torch.exp(torch.randn(d, generator=gen, dtype=dtype) * 0.5)


def quantize_to_artifact(model, method, out_dir, seed=0):
    """Run the engine on `model` with random calibration ids and write the artifact.
    Returns (artifact dir, qtensors, log entries); `model` holds the dequantized weights after."""
    from quantkit.artifact import float_tensors, write_artifact
    from quantkit.engine import quantize_model
    from quantkit.models import adapter_for

    adapter = adapter_for(model)
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(seed))
    qtensors, entries = quantize_model(model, adapter, method, calib, progress=False)
    out = write_artifact(out_dir, model_config=model.config.to_dict(), tokenizer=None, qtensors=qtensors,
                         float_tensors=float_tensors(model, qtensors),
                         quantization_config={"method": method.name, **method.config(), "architecture": adapter.name},
                         quant_log={"modules": entries})
    return out, qtensors, entries
