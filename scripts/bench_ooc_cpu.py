"""OOC quantization time per variant on the CPU: the solver time of GPTQ(2) and of OOC(h,2,0.1,s).

Every linear of a few SmolLM2 decoder layers, with real Hessians. The naive rows run the candidates one
after another (p-OOC-Naive, benchmarks/ooc_naive.py), the others batched as quantkit does (p-OOC-Batch).

The Grams come from one float forward pass of the calibration windows (timed apart: the engine
repeats such passes per layer for every method alike); each variant then quantizes the same
matrices, so the table isolates what the scan costs. Whole-model solver time is extrapolated
from the measured layers (SmolLM2's 30 layers have identical shapes) and labelled as such.

  python scripts/bench_ooc_cpu.py --layers 0,15,29 --nsamples 8 --json out/ooc_cpu.json
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from quantkit.data import calibration_windows
from quantkit.engine.stats import InputGramCollector
from quantkit.methods import make_method
from quantkit.models import adapter_for, load_model, load_tokenizer, resolve_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ooc_naive import NaiveOOC  # noqa: E402

PLAIN = {"act_order": False, "static_groups": False, "clip_search": False}
# (label, method name or "ooc-naive", settings)
VARIANTS = [("GPTQ(2)", "gptq", {"bits": 2, "group_size": 128, **PLAIN})] + [
    (f"OOC(2,2,0.1,{s}){' per-row' if per_row else ''}", "ooc", {"scan": s, "per_row": per_row})
    for s in (0.1, 0.2, 0.5, 1.0) for per_row in (False, True)
] + [("OOC(3,2,0.1,0.2)", "ooc", {"high_bits": 3, "scan": 0.2}),
     ("OOC(2,2,0.1,0.2) naive", "ooc-naive", {"scan": 0.2}),
     ("OOC(2,2,0.1,1.0) naive", "ooc-naive", {"scan": 1.0})]


def gather_grams(model, adapter, layer_ids, calib_ids):
    collectors = {}
    for i in layer_ids:
        layer = adapter.layers(model)[i]
        for name in adapter.linears(layer):
            collectors[(i, name)] = InputGramCollector(layer.get_submodule(name))
    with torch.no_grad():
        for row in calib_ids:
            model(row[None], use_cache=False)
    stats = {}
    for key, col in collectors.items():
        col.handle.remove()
        stats[key] = {"xtx": col.xtx, "nsamples": col.nsamples, "ntokens": col.ntokens}
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", default="0,15,29")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--only", default=None, help="comma-separated variant labels to run (default all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    source = resolve_source(args.model)
    model = load_model(source, dtype=torch.float32)
    adapter = adapter_for(model)
    layer_ids = [int(x) for x in args.layers.split(",")]
    calib_ids, protocol = calibration_windows("c4", load_tokenizer(source), args.nsamples, args.seqlen, 0)
    t0 = time.perf_counter()
    stats = gather_grams(model, adapter, layer_ids, calib_ids)
    gram_seconds = time.perf_counter() - t0
    weights = {(i, n): adapter.layers(model)[i].get_submodule(n).weight.detach() for i, n in stats}
    total_layers = len(adapter.layers(model))

    rows = []
    wanted = None if args.only is None else set(args.only.split(","))
    for label, method_name, params in VARIANTS:
        if wanted is not None and label not in wanted:
            continue
        method = NaiveOOC(**params) if method_name == "ooc-naive" else make_method(method_name, **params)
        t0 = time.perf_counter()
        for key, st in stats.items():
            method.quantize(weights[key], st)
        seconds = time.perf_counter() - t0
        per_layer = seconds / len(layer_ids)
        rows.append({"variant": label, "method": method.name, "settings": method.config(),
                     "seconds_measured_layers": round(seconds, 2), "seconds_per_layer": round(per_layer, 2),
                     "whole_model_solver_seconds_extrapolated": round(per_layer * total_layers, 1)})
        print(f"{label:32s} {per_layer:8.2f} s/layer   ~{per_layer * total_layers:7.1f} s for {total_layers} layers",
              flush=True)
    meta = {"model": source.display, "layers": layer_ids, "calibration": protocol, "threads": torch.get_num_threads(),
            "gram_forward_seconds": round(gram_seconds, 1), "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
