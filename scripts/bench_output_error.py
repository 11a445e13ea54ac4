"""Output error of quantization methods on SmolLM2's real matrices, layer by layer, on the CPU.

For every linear of the chosen decoder layers of the float model, the Hessian statistics of its input over
--nsamples C4 windows (float activations: no layer is quantized first, unlike the engine's sequential
walk), then each config's relative output error tr(ΔHΔᵀ)/tr(WHWᵀ) of the stored tensor, summed over the
matrices as Σ tr(ΔHΔᵀ) / Σ tr(WHWᵀ), on the calibration windows and on --holdout held-out C4 windows (documents
calibration never draws; the held-out number is the one that can show a calibration fit overfitting). A quick direction
check that needs no perplexity run:

  python scripts/bench_output_error.py --layers 0,10,20,29 --nsamples 8 --config gptq:3 \\
      --config bcq:3:offset=true --config bcq:3:offset=true,solver=weight --json out/output_error.json
A config is METHOD:BITS[:key=value,...] (group size --group-size for all; BITS "-" for methods without it);
eval_bits=3/4 scores an any-precision tensor at each listed width.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from quantkit.data import calibration_windows, validation_windows
from quantkit.methods import make_method
from quantkit.methods.bcq_output import output_error
from quantkit.methods.gptq import prepare_hessian
from quantkit.models import load_model, load_tokenizer, resolve_source


def parse(text, group_size):
    """(method, params, eval_bits or [None])."""
    method, bits, *extra = text.split(":")
    params = {} if bits == "-" else {"bits": int(bits)}
    if method in ("rtn", "gptq", "bcq", "ooc"):
        params["group_size"] = group_size
    eval_bits = [None]
    for item in ",".join(extra).split(",") if extra else []:
        key, value = item.split("=")
        if key == "eval_bits":
            eval_bits = [int(b) for b in value.split("/")]
            continue
        value = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(value, str):
            try:
                value = float(value) if "." in value else int(value)
            except ValueError:
                pass
        params[key] = value
    return method, params, eval_bits


def gather_stats(model, names, windows):
    """{name: {"xtx", "nsamples", "ntokens"}} of every named linear's input over the windows."""
    stats, hooks = {}, []
    for name in names:
        def hook(module, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            s = stats.setdefault(name, {"xtx": 0, "nsamples": 0, "ntokens": 0})
            s["xtx"] = s["xtx"] + x.t() @ x
            s["nsamples"] += 1
            s["ntokens"] += x.shape[0]
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    with torch.no_grad():
        for row in windows:
            model(row[None])
    for h in hooks:
        h.remove()
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", default="0,10,20,29")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--holdout", type=int, default=4, help="held-out C4 windows for the second error")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    source = resolve_source(args.model)
    model, tokenizer = load_model(source), load_tokenizer(source)
    windows, _ = calibration_windows("c4", tokenizer, args.nsamples, args.seqlen, 0, args.data_dir)
    layers = [int(x) for x in args.layers.split(",")]
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and any(f".layers.{i}." in name for i in layers)]
    stats = gather_stats(model, names, windows)
    held = gather_stats(model, names, validation_windows("c4", tokenizer, args.holdout, args.seqlen,
                                                         args.data_dir)[0]) if args.holdout else None
    rows = {}
    for text in args.config:
        method_name, params, eval_bits = parse(text, args.group_size)
        method = make_method(method_name, **params)
        sums = {(b, key): [0.0, 0.0] for b in eval_bits for key in ("calibration", "held_out")}
        seconds = 0.0
        for name in names:
            weight = model.get_submodule(name).weight.detach().float()
            start = time.perf_counter()
            qt, _ = method.quantize(weight, stats[name])
            seconds += time.perf_counter() - start
            for b in eval_bits:
                w_hat = qt.dequantize() if b is None else qt.dequantize(bits=b)
                for key, source in (("calibration", stats), ("held_out", held)):
                    if source is None:
                        continue
                    h, w = prepare_hessian(source[name]["xtx"], source[name]["nsamples"], weight)
                    sums[b, key][0] += output_error(w, w_hat, h).sum().item()
                    sums[b, key][1] += output_error(w, torch.zeros_like(w), h).sum().item()
        for b in eval_bits:
            label = text if b is None else f"{text} @{b}b"
            errors = {key: num / den for (bb, key), (num, den) in sums.items() if bb == b and den}
            rows[label] = {"relative_output_error": errors, "seconds": round(seconds, 1)}
            print(f"{label}: relative output error " + ", ".join(f"{k} {v:.5f}" for k, v in errors.items())
                  + f", {seconds:.1f} s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"layers": layers, "nsamples": args.nsamples, "holdout": args.holdout,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
