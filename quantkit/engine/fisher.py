"""Diagonal Fisher sensitivity (SqueezeLLM): F[W] = Σ over calibration windows of (∂loss/∂W)²,
the squared gradient of the LM loss of each window w.r.t. each linear weight, accumulated in fp32.

One window per backward pass (the empirical Fisher squares per-sample gradients; a batch would
square their sum); a post-accumulate-grad hook squares each weight's gradient into its
accumulator as soon as autograd produces it and frees the gradient, so besides the accumulators
(one fp32 copy of the selected weights) at most about one layer's gradients are alive at a time.
Only the selected weights require grad, so no other parameter gradient is ever materialised.

The forward/backward can run on a copy of the model in another dtype (`compute_dtype`). On a CPU
that multiplies bf16 natively (AMX or AVX512-BF16) a bf16 copy with eager attention is ~2.8× faster
than fp32 (SmolLM2, 512 tokens, 2 cores: 1.42 vs 4.0 s per window); on one without, bf16 is emulated
and ~2.2× slower (9.1 vs 4.2 s on the 2-core AVX-512 development machine), so the CPU default follows
the hardware. The sensitivities are only k-means weights; the model's own weights are never modified.
"""

import copy
import time

import torch

from quantkit.errors import QuantkitError


def cpu_default_dtype():
    """bf16 where the CPU has bf16 matrix instructions, else fp32 (see the module docstring)."""
    native_bf16 = any(getattr(torch.cpu, probe, lambda: False)()
                      for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return torch.bfloat16 if native_bf16 else torch.float32


def fisher_sensitivity(model, calib_ids, names=None, device=None):
    """{module name: fp32 Σ grad² [out, in]} for the nn.Linear modules `names` (default: all but
    lm_head) of `model`, over the windows calib_ids [n, T] (labels = the window itself)."""
    device = device or next(model.parameters()).device
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and (n in names if names is not None else n != "lm_head")}
    acc = {n: torch.zeros(m.weight.shape, dtype=torch.float32, device=m.weight.device) for n, m in linears.items()}
    saved = {p: p.requires_grad for p in model.parameters()}
    handles = []
    was_training = model.training
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for name, module in linears.items():
            weight = module.weight
            weight.requires_grad_(True)

            def hook(param, name=name):
                acc[name].add_(param.grad.detach().to(torch.float32).pow(2))
                param.grad = None

            handles.append(weight.register_post_accumulate_grad_hook(hook))
        model.eval()
        for row in calib_ids:
            ids = row.reshape(1, -1).to(device)
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, flag in saved.items():
            p.requires_grad_(flag)
            p.grad = None
        model.train(was_training)
    return acc


def fisher_module_stats(model, adapter, calib_ids, device, compute_dtype=None):
    """({module name: {"fisher": cpu fp32 tensor}} for every quantized linear, seconds).
    compute_dtype: dtype of the forward/backward (default on CPU: cpu_default_dtype(); on CUDA the model's own);
    a different dtype runs on a temporary copy, so the model itself is left untouched."""
    start = time.perf_counter()
    if compute_dtype is None and not str(device).startswith("cuda"):
        compute_dtype = cpu_default_dtype()
    names = {f"{adapter.layers_path}.{i}.{n}" for i, layer in enumerate(adapter.layers(model))
             for n in adapter.linears(layer)}
    own_dtype = next(model.parameters()).dtype
    if compute_dtype is None or compute_dtype == own_dtype:
        work, original_device = model, next(model.parameters()).device
    else:
        work, original_device = copy.deepcopy(model).to(compute_dtype), None
        if not str(device).startswith("cuda"):
            work.config._attn_implementation = "eager"  # CPU sdpa backward is the slow part at these lengths
    work.to(device)
    fisher = fisher_sensitivity(work, calib_ids, names=names, device=device)
    stats = {name: {"fisher": value.to("cpu")} for name, value in fisher.items()}
    if original_device is not None:
        work.to(original_device)
    del work, fisher
    bad = [name for name, entry in stats.items() if not torch.isfinite(entry["fisher"]).all()]
    if bad:  # e.g. squared fp16 gradients that overflowed: say so here, not as NaN weights a layer later
        raise QuantkitError(f"Fisher sensitivity is not finite for {len(bad)} linear(s), first {bad[0]}; "
                            "the squared gradients overflowed; use --sensitivity activation")
    return stats, round(time.perf_counter() - start, 2)
