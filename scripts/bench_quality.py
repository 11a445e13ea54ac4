"""Quality table: perplexity of the float model and of quantized artifacts, full GPTQ protocol.

Loads the float model once; for each configuration it quantizes a copy through the engine,
writes the artifact, reloads it through the runtime (the path users take) and evaluates it on
every dataset. Prints a table and writes JSON (settings, protocol, wall times).

  python scripts/bench_quality.py --model smollm2 --device cuda \
      --config rtn:4:128 --config rtn:3:128 --config rtn:4:-1 --json out/quality.json
A config is METHOD:BITS:GROUP[:key=value,...], e.g. gptq:4:128:act_order=true,static_groups=true.
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
from quantkit.data import calibration_windows, eval_tokens
from quantkit.engine import quantize_model
from quantkit.eval import perplexity
from quantkit.methods import make_method
from quantkit.models import adapter_for, load_model, load_tokenizer, resolve_source
from quantkit.pipeline import resolve_device, resolve_dtype
from quantkit.runtime import load_quantized


def parse_config(text):
    method, bits, group, *extra = text.split(":")
    params = {"bits": int(bits), "group_size": int(group)}
    for item in ",".join(extra).split(",") if extra else []:
        key, value = item.split("=")
        params[key] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(params[key], str):
            params[key] = float(value) if "." in value else int(value)
    return method, params


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
    ap.add_argument("--output-error", action="store_true",
                    help="calibrate every config (RTN too) so each logs its per-module output error")
    args = ap.parse_args()

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    datasets = args.datasets.split(",")
    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    float_model = load_model(source, dtype=dtype)
    adapter = adapter_for(float_model.config)
    rows = []
    meta = {"model": source.display, "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
            "dtype": str(dtype), "torch": torch.__version__, "seqlen": args.seqlen, "date": time.strftime("%Y-%m-%d"),
            "windows": args.max_windows or "all", "eval_batch_size": args.batch_size}

    t0 = time.perf_counter()
    scores = evaluate(float_model.to(device), tokenizer, datasets, args.seqlen, device, args.max_windows, args.data_dir,
                      args.batch_size)
    float_model.to("cpu")
    rows.append({"config": "float", "eval_seconds": round(time.perf_counter() - t0, 1), "results": scores})

    calib_cache = {}
    for text in args.config:
        method_name, params = parse_config(text)
        method = make_method(method_name, **params)
        calib_ids, calib_protocol = None, None
        if method.stats or args.output_error:
            key = (args.calib, args.nsamples, args.seqlen, args.seed)
            if key not in calib_cache:
                calib_cache[key] = calibration_windows(args.calib, tokenizer, args.nsamples, args.seqlen, args.seed,
                                                       args.data_dir)
            calib_ids, calib_protocol = calib_cache[key]
        model = copy.deepcopy(float_model)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        qtensors, entries = quantize_model(model, adapter, method, calib_ids, device=device, progress=False)
        quant_seconds = time.perf_counter() - t0
        out_dir = Path(args.workdir) / text.replace(":", "_").replace(",", "_").replace("=", "-")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        write_artifact(out_dir, model_config=config, tokenizer=tokenizer, qtensors=qtensors,
                       float_tensors=float_tensors(model, qtensors), quantization_config={"method": method_name,
                       **method.config()}, quant_log={"modules": entries, "calibration": calib_protocol},
                       overwrite=True)
        del model
        t0 = time.perf_counter()
        qmodel = load_quantized(out_dir, device=device, dtype=dtype)
        scores = evaluate(qmodel, tokenizer, datasets, args.seqlen, device, args.max_windows, args.data_dir,
                          args.batch_size)
        del qmodel
        rows.append({"config": text, "settings": method.config(), "calibration": calib_protocol,
                     "quantize_seconds": round(quant_seconds, 1), "eval_seconds": round(time.perf_counter() - t0, 1),
                     "bits_per_weight": measured_bits(out_dir)["bits_per_weight"], "results": scores,
                     "output_mse_sum": sum(e["output_mse"] for e in entries) if calib_ids is not None else None})
        print(f"done {text}: " + ", ".join(f"{d}={scores[d]['ppl']:.3f}" for d in datasets), flush=True)
        write_json(args.json, meta, rows)  # after every config, so a cut-off run keeps what it measured

    header = ["config", "bits/w"] + datasets + ["quantize s", "eval s", "Σ output mse"]
    print(" | ".join(header))
    for row in rows:
        bpw = f"{row['bits_per_weight']:.3f}" if "bits_per_weight" in row else "16/32"
        print(" | ".join([row["config"], bpw] + [f"{row['results'][d]['ppl']:.3f}" for d in datasets]
                         + [str(row.get("quantize_seconds", "-")), str(row["eval_seconds"]),
                            f"{row['output_mse_sum']:.4g}" if row.get("output_mse_sum") is not None else "-"]))
    write_json(args.json, meta, rows)


if __name__ == "__main__":
    main()
