"""GPTQ w4g128 seconds per layer on the CPU with all cores idle and with one core kept busy by another
process (a spinning loop this script starts), under quantkit's thread choice and under torch's
default of one thread per core.

  python scripts/bench_cpu_contention.py --layers 1 --json benchmarks/results/cpu_contention.json

The model is SmolLM2 cut to its first --layers decoder layers (written to a temporary directory), so
a row takes one layer's calibration forwards and solver; 8 x 512 calibration windows from C4 as in
quantkit's CPU defaults. Each row runs `quantkit quantize` in a fresh process.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SPIN = "while True:\n    pass\n"


def truncated_model(layers: int, out: Path) -> Path:
    from quantkit.models import load_model, load_tokenizer, resolve_source

    source = resolve_source("smollm2")
    model = load_model(source)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.config.layer_types = None if getattr(model.config, "layer_types", None) is None else \
        model.config.layer_types[:layers]
    model.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    return out


def run_quantize(model_dir: Path, out: Path, threads_env: dict, busy: bool):
    """(seconds of layer work as the run reports it, wall seconds of the whole command)."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        time.sleep(0.5 if busy else 0)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update(threads_env)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "quantkit", "quantize", "--model", str(model_dir), "--method",
                               "gptq", "--bits", "4", "--group-size", "128", "--nsamples", "8", "--seqlen", "512",
                               "--device", "cpu", "--no-checkpoint", "--out", str(out), "--overwrite",
                               "--json", str(out) + ".json"], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    finally:
        if spinner is not None:
            spinner.kill()
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(Path(str(out) + ".json").read_text())["quantize_seconds"], wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = truncated_model(args.layers, Path(tmp) / "model")
        for busy in (False, True):
            for label, env in (("quantkit choice", {}),
                               (f"torch default ({cores} threads)", {"QUANTKIT_THREADS": str(cores)})):
                seconds, wall = run_quantize(model_dir, Path(tmp) / "out", env, busy)
                rows.append({"load": "one core busy" if busy else "idle", "threads": label,
                             "wall_seconds": round(wall, 1),
                             "seconds": round(seconds, 1), "seconds_per_layer": round(seconds / args.layers, 1)})
                print(f"{rows[-1]['load']:14s} {label:28s} {seconds / args.layers:8.1f} s/layer", flush=True)
    idle = next(r for r in rows if r["load"] == "idle" and r["threads"] == "quantkit choice")
    busy = next(r for r in rows if r["load"] == "one core busy" and r["threads"] == "quantkit choice")
    summary = {"busy_over_idle": round(busy["seconds"] / idle["seconds"], 2)}
    print(f"busy / idle with quantkit's choice: {summary['busy_over_idle']}x (goal <= 2.5x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, **summary, "cores": cores, "layers": args.layers,
                                         "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                                         "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
