"""The engine's statistics passes end each window's forward after the step's last hooked linear: the same
statistics (so the same artifact) as full forwards, with fewer modules run. Half-precision activations on
CUDA are summed into the Gram by a tensor-core GEMM with an fp32 result."""

import pytest
import torch

from factories import tiny_causal_lm
from quantkit.engine import driver, stats
from quantkit.engine.stats import add_gram
from quantkit.methods import make_method
from quantkit.models import adapter_for


def _quantize(model, calib, monkeypatch, early):
    if not early:  # the hook still records, but never ends the forward
        monkeypatch.setattr(driver._StopAfter, "_hook", lambda self, module, inputs, output: None)
    down_calls = []
    handles = [layer.mlp.down_proj.register_forward_hook(lambda *a: down_calls.append(1))
               for layer in model.model.layers]
    try:
        method = make_method("gptq", bits=3, group_size=32)
        qtensors, entries = driver.quantize_model(model, adapter_for(model), method, calib, progress=False)
    finally:
        for handle in handles:
            handle.remove()
        monkeypatch.undo()
    return qtensors, entries, len(down_calls)


def test_early_stop_gives_the_full_forward_statistics(monkeypatch):
    layers, windows = 2, 3
    calib = torch.randint(0, 128, (windows, 16), generator=torch.Generator().manual_seed(0))
    early = _quantize(tiny_causal_lm(layers=layers, seed=1), calib, monkeypatch, early=True)
    full = _quantize(tiny_causal_lm(layers=layers, seed=1), calib, monkeypatch, early=False)
    assert early[0].keys() == full[0].keys()
    for name in early[0]:
        a, b = early[0][name].state_dict(), full[0][name].state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), name
    assert [e["gptq_loss"] for e in early[1]] == [e["gptq_loss"] for e in full[1]]
    # down_proj runs in its own pass and in the output pass (the last layer has none), plus the plan's one
    # observed window; the q/k/v, o and gate/up passes stop before it
    assert early[2] == windows * (2 * layers - 1) + 1
    assert full[2] == windows * (5 * layers - 1) + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the half-precision Gram path runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activation_gram_is_an_fp32_sum_of_exact_products(dtype):
    tokens, width = 1024, 384
    x = (torch.randn(tokens, width, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 4).to(dtype)
    total = torch.zeros(width, width, device="cuda")
    add_gram(total, x)
    add_gram(total, x)  # accumulates onto what is there
    assert stats.half_gemm_fp32_out(dtype)  # the tensor-core path ran, not the fp32 fallback
    exact = 2 * (x.double().t() @ x.double())
    # fp32 sums of 2·tokens exact products: |error| ≤ n·2⁻²⁴·Σ|xᵢxⱼ|; a half-precision result would be ~2⁻⁸ off
    bound = 2 * tokens * 2.0**-24 * 2 * (x.double().abs().t() @ x.double().abs())
    assert ((total.double() - exact).abs() <= bound).all()
