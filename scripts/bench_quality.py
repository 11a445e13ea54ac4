"""Quality table: perplexity of the float model and of quantized artifacts, full GPTQ protocol.

Loads the float model once; for each configuration it quantizes a copy through the engine,
writes the artifact, reloads it through the runtime (the path users take) and evaluates it on
every dataset. Prints a table and writes JSON (settings, protocol, wall times).

  python scripts/bench_quality.py --model smollm2 --device cuda \
      --config rtn:4:128 --config rtn:3:128 --config rtn:4:-1 --json out/quality.json
A config is METHOD:BITS:GROUP[:key=value,...], e.g. gptq:4:128:act_order=true,static_groups=true.
BITS/GROUP of "-" leave the method's own defaults (ooc and anyprec name their bits differently):
  ooc:-:128:high_bits=3,scan=0.5          anyprec:-:-:sensitivity=fisher,eval_bits=4/5/6/7/8
eval_bits (any-precision) evaluates the one artifact at every listed width. --val-windows N also
scores every model on N held-out windows of the calibration set and adds the OOC two-flow
ensemble rows: each ooc row against the GPTQ(l) row with its inner GPTQ's settings, lower loss kept.
"""

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch

from quantkit.artifact import float_tensors, write_artifact
from quantkit.bitfamily import measured_bits
from quantkit.data import calibration_windows, eval_tokens, validation_windows
from quantkit.engine import quantize_model
from quantkit.engine.fisher import fisher_module_stats
from quantkit.ensemble import validation_nll
from quantkit.eval import perplexity
from quantkit.methods import make_method
from quantkit.models import adapter_for, load_model, load_tokenizer, resolve_source
from quantkit.pipeline import resolve_device, resolve_dtype
from quantkit.runtime import load_quantized


def parse_config(text):
    """(method, params, eval_bits or None)."""
    method, bits, group, *extra = text.split(":")
    params = {}
    if bits != "-":
        params["bits"] = int(bits)
    if group != "-":
        params["group_size"] = int(group)
    eval_bits = None
    for item in ",".join(extra).split(",") if extra else []:
        key, value = item.split("=")
        if key == "eval_bits":
            eval_bits = [int(b) for b in value.split("/")]
            continue
        params[key] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(params[key], str):  # a number, else a choice (sensitivity=fisher, solver=weight)
            try:
                params[key] = float(value) if "." in value else int(value)
            except ValueError:
                pass
    return method, params, eval_bits


def evaluate(model, tokenizer, datasets, seqlen, device, max_windows, data_dir, batch_size=1):
    out = {}
    for name in datasets:
        ids, protocol = eval_tokens(name, tokenizer, seqlen, data_dir)
        out[name] = {**perplexity(model, ids, seqlen, max_windows, device, batch_size, progress=False), **protocol}
    return out


def write_json(path, meta, rows):
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def ensemble_rows(rows):
    """The two-flow OOC(h,l,p,s) of every ooc row: it and the plain GPTQ(l) row of the same group size
    and symmetry (both quantized as independent flows), the lower validation loss kept."""
    out = []
    for row in rows:
        cfg = row.get("settings") or {}
        if row.get("method") != "ooc":
            continue
        inner = ("group_size", "sym", "act_order", "static_groups", "clip_search")  # the OOC row's inner GPTQ
        low = [r for r in rows if r.get("method") == "gptq" and r["settings"]["bits"] == cfg["low_bits"]
               and all(r["settings"][key] == cfg.get(key, False) for key in inner)]
        if not low:
            continue
        chosen = min([low[0], row], key=lambda r: r["validation_nll"])
        out.append({**chosen, "config": f"ensemble[{low[0]['config']} | {row['config']}]",
                    "ensemble_of": [low[0]["config"], row["config"]], "ensemble_chosen": chosen["config"],
                    "quantize_seconds": round(low[0]["quantize_seconds"] + row["quantize_seconds"], 1),
                    "flow_validation_nll": {low[0]["config"]: low[0]["validation_nll"],
                                            row["config"]: row["validation_nll"]}})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--datasets", default="wikitext2,c4,ptb")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--calib", default="c4")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--workdir", default="out/bench-quality")
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch-size", type=int, default=1, help="windows per forward pass during evaluation")
    ap.add_argument("--val-windows", type=int, default=0,
                    help="held-out windows of --calib scored for every model (OOC ensemble rows need them)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="only merge the JSON files of several runs (one float row kept), add the ensemble rows, print")
    ap.add_argument("--no-float", action="store_true",
                    help="skip the float model's row (parallel runs merged with --merge need it from one of them)")
    ap.add_argument("--output-error", action="store_true",
                    help="calibrate every config (RTN too) so each logs its per-module output error")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.json)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    datasets = args.datasets.split(",")
    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    float_model = load_model(source, dtype=dtype)
    adapter = adapter_for(float_model)
    rows = []
    meta = {"model": source.display,
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
            "dtype": str(dtype), "torch": torch.__version__, "seqlen": args.seqlen, "date": time.strftime("%Y-%m-%d"),
            "windows": args.max_windows or "all", "eval_batch_size": args.batch_size}

    val_ids = None
    if args.val_windows:
        val_ids, meta["validation"] = validation_windows(args.calib, tokenizer, args.val_windows, args.seqlen,
                                                         args.data_dir)
    if not args.no_float:
        t0 = time.perf_counter()
        scores = evaluate(float_model.to(device), tokenizer, datasets, args.seqlen, device, args.max_windows,
                          args.data_dir, args.batch_size)
        val_nll = None if val_ids is None else validation_nll(float_model, val_ids, device)
        float_model.to("cpu")
        rows.append({"config": "float", "eval_seconds": round(time.perf_counter() - t0, 1), "results": scores,
                     "validation_nll": val_nll})

    calib_cache = {}
    for text in args.config:
        method_name, params, eval_bits = parse_config(text)
        method = make_method(method_name, **params)
        calib_ids, calib_protocol = None, None
        if method.stats or args.output_error:
            key = (args.calib, args.nsamples, args.seqlen, args.seed)
            if key not in calib_cache:
                calib_cache[key] = calibration_windows(args.calib, tokenizer, args.nsamples, args.seqlen, args.seed,
                                                       args.data_dir)
            calib_ids, calib_protocol = calib_cache[key]
        model = copy.deepcopy(float_model)
        module_stats, sensitivity_seconds = None, None
        if "fisher" in method.stats:
            module_stats, sensitivity_seconds = fisher_module_stats(model, adapter, calib_ids, device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        qtensors, entries = quantize_model(model, adapter, method, calib_ids, device=device, progress=False,
                                           module_stats=module_stats)
        quant_seconds = time.perf_counter() - t0
        out_dir = Path(args.workdir) / text.replace(":", "_").replace(",", "_").replace("=", "-")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        write_artifact(out_dir, model_config=config, tokenizer=tokenizer, qtensors=qtensors,
                       float_tensors=float_tensors(model, qtensors), quantization_config={"method": method_name,
                       **method.config()}, quant_log={"modules": entries, "calibration": calib_protocol},
                       overwrite=True)
        del model
        bits_report = measured_bits(out_dir)
        for bits in eval_bits or [None]:
            t0 = time.perf_counter()
            qmodel = load_quantized(out_dir, device=device, dtype=dtype, bits=bits)
            scores = evaluate(qmodel, tokenizer, datasets, args.seqlen, device, args.max_windows, args.data_dir,
                              args.batch_size)
            val_nll = None if val_ids is None else validation_nll(qmodel, val_ids, device)
            del qmodel
            label = text if bits is None else f"{text} @{bits}b"
            rows.append({"config": label, "method": method_name, "settings": method.config(), "served_bits": bits,
                         "calibration": calib_protocol, "quantize_seconds": round(quant_seconds, 1),
                         "sensitivity_seconds": sensitivity_seconds,
                         "eval_seconds": round(time.perf_counter() - t0, 1),
                         "bits_per_weight": bits_report["bits_per_weight"],
                         "read_bits_per_weight": bits_report.get("read_bits_per_weight", {}).get(bits),
                         "results": scores, "validation_nll": val_nll,
                         "output_mse_sum": sum(e["output_mse"] for e in entries) if calib_ids is not None else None})
            print(f"done {label}: " + ", ".join(f"{d}={scores[d]['ppl']:.3f}" for d in datasets), flush=True)
            write_json(args.json, meta, rows)  # after every config, so a cut-off run keeps what it measured
    if val_ids is not None:
        rows.extend(ensemble_rows(rows))

    print_table(rows, datasets)
    write_json(args.json, meta, rows)


def print_table(rows, datasets):
    header = ["config", "bits/w"] + datasets + ["val nll", "quantize s", "eval s", "Σ output mse"]
    print(" | ".join(header))
    for row in rows:
        bpw = f"{row['bits_per_weight']:.3f}" if "bits_per_weight" in row else "16/32"
        if row.get("read_bits_per_weight"):
            bpw += f" (reads {row['read_bits_per_weight']:.3f})"
        val = f"{row['validation_nll']:.4f}" if row.get("validation_nll") is not None else "-"
        print(" | ".join([row["config"], bpw] + [f"{row['results'][d]['ppl']:.3f}" for d in datasets]
                         + [val, str(row.get("quantize_seconds", "-")), str(row["eval_seconds"]),
                            f"{row['output_mse_sum']:.4g}" if row.get("output_mse_sum") is not None else "-"]))


def merge(paths, out_path):
    """One table from several runs' JSON files: their rows (the first of each config) + ensemble rows."""
    meta, rows = None, []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = meta or data["meta"]
        for row in data["rows"]:
            if any(r["config"] == row["config"] for r in rows):  # a config measured twice: keep the first
                continue
            if "ensemble_of" not in row:
                rows.append(row)
    if all(r.get("validation_nll") is not None for r in rows):
        rows.extend(ensemble_rows(rows))
    datasets = list(rows[0]["results"])
    meta = {**meta, "merged_from": [str(p) for p in paths]}
    print_table(rows, datasets)
    write_json(out_path, meta, rows)


if __name__ == "__main__":
    main()
