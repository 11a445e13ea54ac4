"""The dense fp16 matvec at decode shapes: cuBLAS (torch.mm) against quantkit's split-K kernel
(quantkit/runtime/dense_matvec.py), in one process: µs per call, GB/s of weight bytes, fraction of the card's
copy rate (a 2 GiB device copy, read + write, measured here), and a sweep of split plans.

  python benchmarks/bench_dense_matvec.py --json $OUT/dense_matvec.json
  python benchmarks/bench_dense_matvec.py --quick

Shapes are out_features x in_features of Llama-2-7B's decode as quantkit's decoder runs it: stacked q/k/v,
o, stacked gate/up, down, and the head. Timing as in bench_lutgemm.py: a CUDA graph of calls cycling through
enough weight copies that none is served from L2, replayed and timed with CUDA events (median). The split
kernel's calls add into one fp32 buffer that is not cleared between calls (in the decoder the next operator
clears it, inside its own work). Every plan is checked against the fp32 product before it is timed.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e_decode import copy_rate  # noqa: E402
from bench_lutgemm import time_calls, weight_copies  # noqa: E402

from quantkit.runtime import dense_matvec  # noqa: E402

SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]
QUICK_SHAPES = [(4096, 4096), (4096, 11008)]
MAX_REL_ERR = 2e-3


def candidate_plans(n, k, batch, sms, quick):
    """The default plan first, then variants of program count and tile."""
    plans = [dense_matvec.plan(n, k, batch, sms)]
    if quick:
        return plans
    for per_sm in (2, 4, 8, 16):
        for block_n, block_k in ((32, 256), (64, 128), (16, 512), (64, 256)):
            p = dense_matvec.plan(n, k, batch, sms, target_programs=per_sm * sms, block_n=block_n, block_k=block_k)
            if p not in plans:
                plans.append(p)
    return plans


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def bench_case(n, k, batch, sms, args, l2):
    nbytes = n * k * 2
    copies = weight_copies(nbytes, l2)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
    x = torch.randn(batch, k, device="cuda", dtype=torch.float16)
    ref = (x.double() @ weights[0].double().t())
    out = torch.empty(batch, n, device="cuda", dtype=torch.float16)
    cublas_s = time_calls([lambda w=w: torch.mm(x, w.t(), out=out) for w in weights], args.iters)
    assert rel_err(F.linear(x, weights[0]), ref) < MAX_REL_ERR
    acc = torch.zeros(batch * n, device="cuda", dtype=torch.float32)
    results = []
    for p in candidate_plans(n, k, batch, sms, args.quick):
        err = rel_err(dense_matvec.matvec(x, weights[0], p), ref)
        if not err < MAX_REL_ERR:
            results.append({"plan": vars(p), "error": f"relative error {err:.2e}"})
            continue
        s = time_calls([lambda w=w: dense_matvec.accumulate(x, w, acc, p) for w in weights], args.iters)
        results.append({"plan": vars(p), "us": s * 1e6, "rel_err": err})
    del weights
    torch.cuda.empty_cache()
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    return {"shape": [n, k], "batch": batch, "weight_bytes": nbytes, "cublas_us": cublas_s * 1e6,
            "split_default_us": timed[0]["us"] if timed and timed[0] is results[0] else None,
            "split_best": best, "plans": results}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 shapes, the default plan only")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    rate = copy_rate()
    rows = []
    for n, k in QUICK_SHAPES if args.quick else SHAPES:
        for batch in [int(b) for b in args.batches.split(",")]:
            r = bench_case(n, k, batch, sms, args, l2)
            rows.append(r)
            gbs = lambda us: r["weight_bytes"] / (us * 1e-6) / 1e9  # noqa: E731
            best = r["split_best"]
            line = (f"{n}x{k} b{batch}: cuBLAS {r['cublas_us']:.1f} us ({gbs(r['cublas_us']):.0f} GB/s, "
                    f"{gbs(r['cublas_us']) / rate:.2f} of copy)")
            if r["split_default_us"] is not None:
                line += f" | split default {r['split_default_us']:.1f} us ({gbs(r['split_default_us']) / rate:.2f})"
            if best is not None:
                line += (f" | best {best['us']:.1f} us ({gbs(best['us']) / rate:.2f}, "
                         f"x{r['cublas_us'] / best['us']:.2f} cuBLAS) {best['plan']}")
            print(line, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"device": props.name, "copy_gb_per_s": rate, "rows": rows},
                                                      indent=1))
    print(f"\n{props.name}, copy rate {rate:.0f} GB/s")
    print("| shape | batch | cuBLAS µs | split (default plan) µs | best plan µs | best / cuBLAS |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        d, b = r["split_default_us"], r["split_best"]
        default = "–" if d is None else f"{d:.1f}"
        best = "–" if b is None else f"{b['us']:.1f} | {r['cublas_us'] / b['us']:.2f}×"
        print(f"| {r['shape'][0]}×{r['shape'][1]} | {r['batch']} | {r['cublas_us']:.1f} | {default} | {best} |")


if __name__ == "__main__":
    main()
