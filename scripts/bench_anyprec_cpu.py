"""Any-precision seed + upscaling (3 -> 8 bits) on the CPU for every linear of SmolLM2: time per stage
and weighted SSE per width, for the native (C++/OpenMP) path with the split upscaling rule (exact
2-means splits of every cluster, bit by bit), against the torch path of kmeans.py on the first
--torch-layers decoder layers.

  python scripts/bench_anyprec_cpu.py --json out/anyprec_cpu.json          # ~1-2 min on 2 cores
  python scripts/bench_anyprec_cpu.py --quick                               # 4 layers, no torch path
  python scripts/bench_anyprec_cpu.py --fresh-build ...                     # also time a first compile

The linears come from a safetensors file of {module name: fp32 [out, in]} (--linears; dump one with
--dump-from smollm2). Sensitivity: "random" (one U(0.05, 2.05) weight per input column, seeded) or
"activation" (diag XᵀX of each linear's input in the float model over --nsamples C4 windows: the
statistic the engine gathers; its time is the sensitivity stage).

Stages: compile (the extension's first build, cached afterwards; a cached load is timed otherwise),
sensitivity, sort (sort + merge equal values + fp64 prefix sums), seed (exact k-means), upscale (split,
tables and codes). Every row runs its stages in one go, so each stage is measured in thread-seconds
(summed over threads) and given its share of the wall time; the CPU may be shared with other jobs, so the
load average is printed too.
Quality: Σ weighted SSE at each width relative to the exact independent k-means at that width, on
every --indep-stride-th row of every matrix. Prints a table, writes JSON with --json.
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

LINEARS = "/tmp/smollm2_linears.safetensors"


def load_avg():
    return [round(v, 2) for v in os.getloadavg()]


def dump_linears(model_src, path):
    """Write {module name: fp32 weight} of every decoder-layer linear of the float model."""
    from safetensors.torch import save_file

    from quantkit.models import load_model, resolve_source

    model = load_model(resolve_source(model_src))
    tensors = {name: module.weight.detach().float().contiguous() for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and ".layers." in name}
    save_file(tensors, path)
    return len(tensors)


def activation_sensitivity(model_src, names, nsamples, seqlen, data_dir):
    """{name: diag Σ xᵀx of the linear's input} over nsamples C4 windows of the float model, and the seconds."""
    from quantkit.data import calibration_windows
    from quantkit.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(model_src)
    model, tokenizer = load_model(source), load_tokenizer(source)
    windows = calibration_windows("c4", tokenizer, nsamples, seqlen, data_dir=data_dir)[0]
    diag, hooks = {}, []
    for name in names:
        def hook(module, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            diag[name] = diag.get(name, 0) + (x * x).sum(0)
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    start = time.perf_counter()
    with torch.no_grad():
        for row in windows:
            model(row[None])
    seconds = time.perf_counter() - start
    for h in hooks:
        h.remove()
    # as squeezellm.sensitivity_weights: a column no token activates keeps a tiny weight
    return {n: d + 1e-6 * d.mean().clamp_min(1e-30) for n, d in diag.items()}, seconds


def stage_sums(results):
    """Seconds per table stage summed over matrices: "<stage>_thread_s" (summed over threads) and "<stage>"
    (the calls' wall time shared out in proportion to the thread-seconds)."""
    groups = {"sort": ("prepare",), "seed": ("seed",), "upscale": ("split", "finish")}
    out = {key + "_thread_s": 0.0 for key in groups}
    out.update({key: 0.0 for key in groups})
    for r in results:
        busy = {key: sum(r.seconds.get(part, 0.0) for part in parts) for key, parts in groups.items()}
        total = sum(busy.values()) or 1.0
        for key, value in busy.items():
            out[key + "_thread_s"] += value
            out[key] += r.seconds["wall"] * value / total
    return out


def run_torch(mats, sens, seed_bits, parent_bits):
    """The torch path (kmeans.py) on the given matrices: seconds per stage and Σ SSE per width."""
    from quantkit.methods.anyprec import upscale
    from quantkit.methods.kmeans import SortedRows, kmeans_runs

    secs = {"sort": 0.0, "seed": 0.0, "upscale": 0.0}
    sse = torch.zeros(parent_bits - seed_bits + 1, dtype=torch.float64)
    for name, w in mats.items():
        t0 = time.perf_counter()
        sr = SortedRows(w, sens[name].expand_as(w))
        t1 = time.perf_counter()
        starts, centroids = kmeans_runs(sr, 2**seed_bits)
        t2 = time.perf_counter()
        starts, _ = upscale(sr, starts, centroids, seed_bits, parent_bits)
        codes = sr.codes(starts)  # the torch path's last step before packing, as the native finish stage
        t3 = time.perf_counter()
        secs["sort"] += t1 - t0
        secs["seed"] += t2 - t1
        secs["upscale"] += t3 - t2
        del codes
        for i, b in enumerate(range(seed_bits, parent_bits + 1)):
            sse[i] += sr.run_sse(starts[:, :: 2 ** (parent_bits - b)]).sum()
    return secs, sse


def main():
    from quantkit.methods.kmeans_native import ISAS, UPSCALE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--linears", default=LINEARS, help="safetensors of {module name: weight} [%(default)s]")
    ap.add_argument("--dump-from", default=None, help="write --linears from this model first (e.g. smollm2)")
    ap.add_argument("--model", default="smollm2", help="model for --sensitivity activation [%(default)s]")
    ap.add_argument("--sensitivity", choices=["random", "activation"], default="random")
    ap.add_argument("--nsamples", type=int, default=8, help="C4 windows for --sensitivity activation")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--data-dir", default=None, help="calibration texts (layout of shared/data) [$QUANTKIT_DATA]")
    ap.add_argument("--seed-bits", type=int, default=3)
    ap.add_argument("--parent-bits", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads [torch.get_num_threads()]")
    ap.add_argument("--isa", default="auto", choices=ISAS,
                    help="instruction set of the extension's scans (the same results) [%(default)s]")
    ap.add_argument("--layers", type=int, default=None, help="only the first N decoder layers")
    ap.add_argument("--torch-layers", type=int, default=1, help="decoder layers also run on the torch path (0: none)")
    ap.add_argument("--indep-stride", type=int, default=16, help="rows sampled for the independent k-means (0: skip)")
    ap.add_argument("--fresh-build", action="store_true", help="compile the extension in an empty cache and time it")
    ap.add_argument("--quick", action="store_true", help="4 layers, no torch path, independent on every 64th row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.layers = args.layers or 4
        args.torch_layers = 0
        args.indep_stride = 64
    if args.fresh_build:
        os.environ["QUANTKIT_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="quantkit-kernels-")

    from safetensors import safe_open

    from quantkit.kernels.build import load_cpu
    from quantkit.methods.kmeans_native import native_anyprec, native_isa, native_kmeans_exact

    s, p = args.seed_bits, args.parent_bits
    start = time.perf_counter()
    ext = load_cpu("anyprec_cpu")
    compile_s = time.perf_counter() - start
    if ext is None:
        raise SystemExit("the anyprec_cpu extension did not build (see the warning above)")

    if args.dump_from:
        print(f"wrote {dump_linears(args.dump_from, args.linears)} linears to {args.linears}")
    with safe_open(args.linears, "pt") as f:
        names = sorted(f.keys(), key=lambda k: (int(k.split(".layers.")[1].split(".")[0]), k))
        if args.layers is not None:
            names = [k for k in names if int(k.split(".layers.")[1].split(".")[0]) < args.layers]
        mats = {k: f.get_tensor(k).float().contiguous() for k in names}
    weights = sum(w.numel() for w in mats.values())
    rows = sum(w.shape[0] for w in mats.values())

    sens_s = 0.0
    if args.sensitivity == "activation":
        sens, sens_s = activation_sensitivity(args.model, names, args.nsamples, args.seqlen, args.data_dir)
    else:
        gen = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        sens = {k: torch.rand(w.shape[1], generator=gen, dtype=torch.float64) * 2 + 0.05 for k, w in mats.items()}
        sens_s = time.perf_counter() - start

    threads = args.threads or torch.get_num_threads()
    report = {"linears": args.linears, "matrices": len(mats), "weights": weights, "rows": rows,
              "sensitivity": args.sensitivity, "seed_bits": s, "parent_bits": p, "threads": threads,
              "upscale": UPSCALE, "cpu": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "isa": native_isa(args.isa), "torch": torch.__version__,
              "load_avg_start": load_avg(),
              "compile_seconds": compile_s, "compile_fresh": args.fresh_build, "sensitivity_seconds": sens_s,
              "rules": {}}
    print(f"{len(mats)} linears, {rows:,} rows, {weights:,} weights; sensitivity {args.sensitivity}; "
          f"{threads} threads ({report['isa']}); load average {report['load_avg_start']}")
    print(f"extension load: {compile_s:.1f} s ({'fresh compile' if args.fresh_build else 'cached or first build'})"
          f"; sensitivity stage {sens_s:.2f} s")

    per_row = {}
    for rule in (UPSCALE,):  # the one rule; "rules" keeps the report's shape
        results, cpu0, start = [], time.process_time(), time.perf_counter()
        for k, w in mats.items():
            results.append(native_anyprec(w, sens[k], s, p, threads=threads, isa=args.isa))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        sums = stage_sums(results)
        sse = [sum(r.sse[b].sum().item() for r in results) for b in range(s, p + 1)]
        per_row[rule] = results
        report["rules"][rule] = {"wall_seconds": wall, "process_cpu_seconds": cpu, "stages": sums,
                                 "weighted_sse": sse, "load_avg_end": load_avg()}

    if args.indep_stride:
        start = time.perf_counter()
        indep = torch.zeros(p - s + 1, dtype=torch.float64)
        sampled = {rule: torch.zeros(p - s + 1, dtype=torch.float64) for rule in per_row}
        for i, (k, w) in enumerate(mats.items()):
            sub = w[:: args.indep_stride].contiguous()
            for j, b in enumerate(range(s, p + 1)):
                indep[j] += native_kmeans_exact(sub, sens[k], 2**b, threads, isa=args.isa).sum()
                for rule, results in per_row.items():
                    sampled[rule][j] += results[i].sse[b][:: args.indep_stride].sum()
        report["independent"] = {"row_stride": args.indep_stride, "weighted_sse": indep.tolist(),
                                 "seconds": time.perf_counter() - start,
                                 "ratio": {rule: (v / indep).tolist() for rule, v in sampled.items()}}

    if args.torch_layers:
        tmats = {k: w for k, w in mats.items() if int(k.split(".layers.")[1].split(".")[0]) < args.torch_layers}
        torch_secs, torch_sse = run_torch(tmats, sens, s, p)
        native = {}
        for rule, results in per_row.items():
            picked = [r for k, r in zip(mats, results) if k in tmats]
            native[rule] = {"stages": stage_sums(picked),
                            "weighted_sse": [sum(r.sse[b].sum().item() for r in picked) for b in range(s, p + 1)]}
        report["torch_subset"] = {"layers": args.torch_layers, "matrices": len(tmats), "torch_seconds": torch_secs,
                                  "torch_weighted_sse": torch_sse.tolist(), "native": native}
    report["load_avg_end"] = load_avg()

    print_report(report, s, p)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


def print_report(report, s, p):
    rules = list(report["rules"])
    print("\nseconds      " + "".join(f"{r + ' wall':>13}{r + ' thread-s':>16}" for r in rules))
    for stage in ("sort", "seed", "upscale"):
        print(f"{stage:12s} " + "".join(f"{report['rules'][r]['stages'][stage]:13.2f}"
                                         f"{report['rules'][r]['stages'][stage + '_thread_s']:16.2f}" for r in rules))

    def total(rule, suffix):
        return sum(report["rules"][rule]["stages"][x + suffix] for x in ("sort", "seed", "upscale"))

    print(f"{'total':12s} " + "".join(f"{total(r, ''):13.2f}{total(r, '_thread_s'):16.2f}" for r in rules))
    print(f"{'python call':12s} " + "".join(f"{report['rules'][r]['wall_seconds']:13.2f}"
                                            f"{report['rules'][r]['process_cpu_seconds']:16.2f}" for r in rules)
          + "   (wall, process CPU)")
    bits = list(range(s, p + 1))
    if "independent" in report:
        ind = report["independent"]
        print(f"\nweighted SSE / exact independent k-means at that width (every {ind['row_stride']}th row)")
        print("bits     " + "".join(f"{b:>9d}" for b in bits))
        for rule, ratio in ind["ratio"].items():
            print(f"{rule:8s} " + "".join(f"{v:9.4f}" for v in ratio))
    if "torch_subset" in report:
        t = report["torch_subset"]
        print(f"\ntorch path (kmeans.py) vs native on the first {t['layers']} layer(s), {t['matrices']} matrices")
        print(f"{'':12s}{'sort':>9}{'seed':>9}{'upscale':>9}   SSE / torch at bits {bits}")
        print(f"{'torch':12s}" + "".join(f"{t['torch_seconds'][k]:9.2f}" for k in ("sort", "seed", "upscale")))
        for rule, nat in t["native"].items():
            print(f"{rule:12s}" + "".join(f"{nat['stages'][k]:9.2f}" for k in ("sort", "seed", "upscale"))
                  + "   " + " ".join(f"{x / y:.4f}" for x, y in zip(nat["weighted_sse"], t["torch_weighted_sse"])))


if __name__ == "__main__":
    main()
