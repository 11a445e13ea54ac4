"""The two-flow ensemble OOC(h,l,p,s) (k-OOC §3.2, fig. 2a): quantize the model once with GPTQ(l)
and once with GPTQ(h,l,p,s), each flow propagating its *own* quantized activations through the
layers, score both on held-out validation windows, keep the flow with the lower validation loss
and report both.

The flows run one after the other rather than interleaved layer by layer: each flow's layer
inputs depend only on its own earlier layers, so the result is the same, and only one flow's
activations are alive at a time. Every flow except the last works on a copy of the float model,
so the host holds at most two copies of the model while an ensemble runs.
"""

import copy
import math
import time

from quantkit.engine import quantize_model
from quantkit.eval import perplexity
from quantkit.methods import make_method


def ooc_flows(ooc_method):
    """[(label, method)]: GPTQ(l) with the settings of the OOC method's inner GPTQ (group, symmetry, damping,
    act-order, static groups, clip search), then GPTQ(h,l,p,s) itself."""
    m = ooc_method
    low = make_method("gptq", bits=m.low_bits, group_size=m.group_size, sym=m.sym, damp=m.damp, act_order=m.act_order,
                      static_groups=m.static_groups, clip_search=m.clip_search, block_size=m.block_size)
    label = f"GPTQ({m.high_bits},{m.low_bits},{m.clear_fraction:g},{m.scan:g})" + (" per-row" if m.per_row else "")
    return [(f"GPTQ({m.low_bits})", low), (label, m)]


def validation_nll(model, val_ids, device):
    """Mean token NLL of `model` over the validation windows [n, T]."""
    flat = val_ids.reshape(-1)
    return perplexity(model, flat, val_ids.shape[1], None, device, 1, progress=False)["nll"]


def run_flows(model, adapter, flows, calib_ids, val_ids, device="cpu", progress=True, module_stats=None):
    """Quantize `model` with every flow and keep the one with the lowest validation NLL.

    Returns (winner index, [{"flow", "settings", "validation_nll", "validation_ppl", "quantize_seconds",
    "chosen"}], qtensors, entries) where qtensors/entries are the winner's. `model` ends up holding the
    last flow's dequantized weights; float tensors outside the quantized linears are never changed."""
    reports, results = [], []
    for k, (label, method) in enumerate(flows):
        work = model if k == len(flows) - 1 else copy.deepcopy(model)
        start = time.perf_counter()
        qtensors, entries = quantize_model(work, adapter, method, calib_ids, device=device, progress=progress,
                                           module_stats=module_stats)
        seconds = time.perf_counter() - start
        work.to(device)
        nll = validation_nll(work, val_ids, device)
        work.to("cpu")
        if work is not model:
            del work
        reports.append({"flow": label, "method": method.name, "settings": method.config(), "validation_nll": nll,
                        "validation_ppl": math.exp(nll), "quantize_seconds": round(seconds, 2)})
        results.append((qtensors, entries))
    best = min(range(len(flows)), key=lambda k: reports[k]["validation_nll"])
    for k, report in enumerate(reports):
        report["chosen"] = k == best
    return best, reports, results[best][0], results[best][1]
