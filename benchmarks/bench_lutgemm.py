"""LUT-GEMM (BCQ) vs cuBLAS fp16 on the GPU, all in one process: latency, effective GB/s of the bytes
a call reads, fraction of cuBLAS's streaming rate on the same shape and batch, and speedup. Kernel
"lut" is the LUT kernel; "mma" the tensor-core decode kernel of the same extension (rows for
batches >= 2 where group_size % 128 == 0 or row-wise). Then two measurements that set constants of
quantkit.kernels.lutgemm: the batch from which "mma" beats "lut" (MMA_MIN_BATCH) and the token count
from which dequantize + cuBLAS beats the matvec kernels (MATVEC_MAX_TOKENS).

  python benchmarks/bench_lutgemm.py --json $OUT/lutgemm.json          # full table, ~1-2 min + build
  python benchmarks/bench_lutgemm.py --quick                           # 2 shapes, q3 g128

Shapes are out_features x in_features (49152x12288: 49152 rows, 12288 inputs). Weights are random
(random sign planes, α, fp16 weights): speed does not depend on the values. Timing: each
measurement is a CUDA graph of `reps` calls, replayed `iters` times and timed with CUDA events
(median per call); the calls cycle through enough copies of the weight that they cannot be served
from L2 (at least 4x the L2 size), so GB/s is HBM streaming, not cache. Every LUT configuration is
also checked against dequantize + fp32 matmul before it is timed.
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from quantkit.kernels import lutgemm

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (12288, 12288), (49152, 12288), (12288, 49152)]
QUICK_SHAPES = [(4096, 4096), (49152, 12288)]
GOAL_SHAPE = (49152, 12288)
GOALS = {2: 5.7, 3: 3.9, 4: 3.0}  # speedup over cuBLAS fp16 at g = 128, batch 1 (RESULTS.md)
GOAL_BATCH8_RATIO = 1.5           # batch-8 latency / batch-1 latency
CROSSOVER_TOKENS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
MAX_REL_ERR = 2e-3


def weight_copies(nbytes, l2_bytes, cap=64):
    """Copies to cycle through so that consecutive calls never find their weight in L2."""
    return max(1, min(cap, -(-4 * l2_bytes // max(1, nbytes))))


def random_bcq(k, d, q, g, offset, device):
    groups = -(-d // g)
    words = -(-d // 32)
    return lutgemm.BCQTensors(
        qweight=torch.randint(-(2**31), 2**31 - 1, (q, words, k), dtype=torch.int32, device=device),
        alpha=((torch.rand(groups, q, k, device=device) + 0.5) * 0.02).half(),
        offset=(torch.randn(groups, k, device=device) * 0.01).half() if offset else None,
        group_size=g, in_features=d)


def mma_ok(group_size, d):
    return group_size % 128 == 0 or group_size >= d


def bcq_bytes(t: lutgemm.BCQTensors):
    return sum(x.numel() * x.element_size() for x in (t.qweight, t.alpha, t.offset) if x is not None)


def time_calls(calls, iters, target_s=2e-3):
    """Median seconds per call of `calls` (closures, cycled) inside a CUDA graph."""
    for c in calls[:2]:
        c()  # warm-up outside the capture (first-use allocations, extension build)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in calls:
        c()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) / len(calls)  # eager estimate, an upper bound
    reps = max(len(calls), min(1000, int(target_s / max(est, 1e-7))))
    reps = -(-reps // len(calls)) * len(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            calls[r % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    del graph
    return statistics.median(times)


def check(ops, t, x, mma_min_batch):
    """Relative error of the kernel against dequantize + fp32 matmul (chunked over rows)."""
    y = lutgemm.lut_matmul(x, t, None, ops, mma_min_batch).double()
    w = lutgemm.dequantize(t, torch.float16, ops)
    ref = torch.cat([x.float() @ w[r:r + 8192].float().t() for r in range(0, w.shape[0], 8192)], 1).double()
    del w
    return ((y - ref).norm() / ref.norm()).item()


def bcq_copies(k, d, q, g, offset, l2, dev="cuda"):
    """Random BCQ weights of one configuration, as many copies as it takes to exceed L2 (HBM-bound timing)."""
    one = random_bcq(k, d, q, g, offset, dev)
    return [one] + [random_bcq(k, d, q, g, offset, dev) for _ in range(weight_copies(bcq_bytes(one), l2) - 1)]


def bench_shape(ops, k, d, args, l2):
    rows = []
    dev = "cuda"
    w16 = [torch.randn(k, d, device=dev).half() * 0.02 for _ in range(weight_copies(k * d * 2, l2))]
    cublas = {}
    for n in args.batches:
        x = torch.randn(n, d, device=dev).half()
        outs = [torch.empty(n, k, dtype=torch.float16, device=dev) for _ in w16]
        calls = [lambda w=w, o=o: torch.mm(x, w.t(), out=o) for w, o in zip(w16, outs)]
        sec = time_calls(calls, args.iters)
        cublas[n] = (sec, (k * d + n * d + n * k) * 2 / sec / 1e9)
    del w16
    for q in args.bits:
        for g in args.groups:
            gs = d if g == -1 else g
            copies = bcq_copies(k, d, q, gs, args.offset, l2)
            one = copies[0]
            for n in args.batches:
                x = torch.randn(n, d, device=dev).half()
                kernels = [("lut", 9)] + ([("mma", 1)] if mma_ok(gs, d) else [])
                # kept workspace, as QuantLinear runs it (the kernels leave it zero: no memset per call)
                ws = torch.zeros(ops.workspace_floats(n, k), dtype=torch.float32, device=dev)
                for kernel, mma_min in kernels:
                    err = check(ops, one, x, mma_min)
                    outs = [torch.empty(n, k, dtype=torch.float16, device=dev) for _ in copies]
                    calls = [lambda t=t, o=o: ops.lut_gemm(x, t.qweight, t.alpha, t.offset, None, t.group_size, o,
                                                           mma_min, ws) for t, o in zip(copies, outs)]
                    sec = time_calls(calls, args.iters)
                    zeroed_us = None
                    if n == 1:  # the same launches with a fresh zeroed workspace per call (one memset node more)
                        zeroed_us = 1e6 * time_calls(
                            [lambda t=t, o=o: ops.lut_gemm(x, t.qweight, t.alpha, t.offset, None, t.group_size, o,
                                                           mma_min) for t, o in zip(copies, outs)], args.iters)
                    gbps = (bcq_bytes(one) + n * d * 2 + n * k * 2) / sec / 1e9
                    c_sec, c_gbps = cublas[n]
                    row = {"k": k, "d": d, "bits": q, "group_size": g, "offset": args.offset, "batch": n,
                           "kernel": kernel, "bits_per_weight": bcq_bytes(one) * 8 / (k * d), "lut_us": sec * 1e6,
                           "lut_GBps": gbps, "cublas_us": c_sec * 1e6, "cublas_GBps": c_gbps,
                           "frac_of_cublas_rate": gbps / c_gbps, "speedup": c_sec / sec, "rel_err": err,
                           "weight_copies": len(copies), "lut_us_fresh_workspace": zeroed_us}
                    rows.append(row)
                    flag = "" if err < MAX_REL_ERR else f"  REL ERR {err:.1e} > {MAX_REL_ERR}"
                    print(f"{k:>6}x{d:<6} q{q} g{'row' if g == -1 else g:<4} b{n} {kernel}  {sec * 1e6:9.1f} us "
                          f"{gbps:8.0f} GB/s {gbps / c_gbps:6.2f}  | cuBLAS {c_sec * 1e6:9.1f} us {c_gbps:6.0f} GB/s "
                          f"| x{c_sec / sec:5.2f}  err {err:.1e}{flag}"
                          + ("" if zeroed_us is None else f"  | memset per call {zeroed_us:7.1f} us"), flush=True)
            del copies
    return rows


def batch_sweep(ops, k, d, args, l2):
    """LUT vs tensor-core kernel for 1..8 columns (q3, g128): where MMA_MIN_BATCH should sit."""
    dev = "cuda"
    copies = bcq_copies(k, d, 3, 128, False, l2)
    points = []
    for n in range(1, 9):
        x = torch.randn(n, d, device=dev).half()
        out = torch.empty(n, k, dtype=torch.float16, device=dev)
        ws = torch.zeros(ops.workspace_floats(n, k), dtype=torch.float32, device=dev)
        res = {"batch": n}
        for kernel, mma_min in (("lut", 9), ("mma", 1)):
            res[f"{kernel}_us"] = 1e6 * time_calls(
                [lambda t=t: ops.lut_gemm(x, t.qweight, t.alpha, t.offset, None, t.group_size, out, mma_min, ws)
                 for t in copies], args.iters)
        points.append(res)
        print(f"{k:>6}x{d:<6} q3 g128 batch {n}: LUT {res['lut_us']:9.1f} us | tensor cores {res['mma_us']:9.1f} us",
              flush=True)
    # smallest n from which the tensor-core kernel wins at every larger batch
    best = 9
    for p in reversed(points):
        if p["mma_us"] < p["lut_us"]:
            best = p["batch"]
        else:
            break
    return {"k": k, "d": d, "bits": 3, "group_size": 128, "points": points, "suggested_mma_min_batch": best}


GRID_SWEEP_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096), (22016, 4096)]


def grid_sweep(ops, args, l2):
    """Batch 1, g128: the LUT kernel's grid capped so each block runs at least s pipeline steps (one
    step = 4 words of one plane for 1024 rows; a block builds a chunk's tables once per chunk it enters
    and adds its partial sums with atomics once per row tile), vs the default one wave of resident blocks."""
    dev, out_rows = "cuda", []
    for k, d in GRID_SWEEP_SHAPES:
        for q in (3, 4):
            copies = bcq_copies(k, d, q, 128, False, l2)
            x = torch.randn(1, d, device=dev).half()
            out = torch.empty(1, k, dtype=torch.float16, device=dev)
            ws = torch.zeros(ops.workspace_floats(1, k), dtype=torch.float32, device=dev)
            steps = math.ceil(k / 1024) * math.ceil(d / 256) * q * 2  # row tiles x chunks x planes x NH (BP = 1)
            res = {"k": k, "d": d, "bits": q, "steps": steps, "us": {}}
            for spb in (0, 1, 2, 3, 4, 6, 8, 12):
                blocks = 0 if spb == 0 else math.ceil(steps / spb)
                res["us"][spb] = 1e6 * time_calls(
                    [lambda t=t: ops.lut_gemm(x, t.qweight, t.alpha, t.offset, None, t.group_size, out, 9, ws, blocks)
                     for t in copies], args.iters)
            out_rows.append(res)
            print(f"{k:>6}x{d:<6} q{q} steps {steps:5d}: " + "  ".join(
                f"{'auto' if s == 0 else f'>={s}'} {v:6.1f}" for s, v in res["us"].items()), flush=True)
            del copies
    return out_rows


def crossover(ops, k, d, args, l2):
    """Per token count: LUT kernel, dequantize + cuBLAS, cuBLAS on a cached fp16 weight."""
    dev = "cuda"
    copies = bcq_copies(k, d, 3, 128, False, l2)
    dense = [lutgemm.dequantize(t, torch.float16, ops) for t in copies[:weight_copies(k * d * 2, l2)]]
    scratch = torch.empty(k, d, dtype=torch.float16, device=dev)
    points = []
    for n in CROSSOVER_TOKENS:
        x = torch.randn(n, d, device=dev).half()
        out = torch.empty(n, k, dtype=torch.float16, device=dev)
        ws = torch.zeros(ops.workspace_floats(n, k), dtype=torch.float32, device=dev)
        lut = time_calls([lambda t=t: ops.lut_gemm(x, t.qweight, t.alpha, t.offset, None, t.group_size, out,
                                                   lutgemm.MMA_MIN_BATCH, ws) for t in copies], args.iters)

        def dq_mm(t):
            ops.dequantize(t.qweight, t.alpha, t.offset, t.group_size, scratch)
            torch.mm(x, scratch.t(), out=out)

        dqmm = time_calls([lambda t=t: dq_mm(t) for t in copies], args.iters)
        mm = time_calls([lambda w=w: torch.mm(x, w.t(), out=out) for w in dense], args.iters)
        points.append({"tokens": n, "lut_us": lut * 1e6, "dequant_mm_us": dqmm * 1e6, "cached_mm_us": mm * 1e6})
        print(f"{k:>6}x{d:<6} q3 g128 tokens {n:4d}: LUT {lut * 1e6:9.1f} us | dequant+cuBLAS {dqmm * 1e6:9.1f} us"
              f" | cuBLAS cached {mm * 1e6:9.1f} us", flush=True)
    dq_alone = time_calls([lambda t=t: ops.dequantize(t.qweight, t.alpha, t.offset, t.group_size, scratch)
                           for t in copies], args.iters)

    def first_loss(key):
        return next((p["tokens"] for p in points if p[key] < p["lut_us"]), None)

    return {"k": k, "d": d, "bits": 3, "group_size": 128, "points": points,
            "dequant_us": dq_alone * 1e6, "dequant_write_GBps": k * d * 2 / dq_alone / 1e9,
            "lut_loses_from_tokens": {"uncached": first_loss("dequant_mm_us"), "cached": first_loss("cached_mm_us")}}


def markdown(rows, device):
    lines = ["| shape (out x in) | q | g | batch | kernel | bits/w | µs | GB/s | frac. of cuBLAS rate | cuBLAS fp16 µs "
             "| speedup |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = "row" if r["group_size"] == -1 else r["group_size"]
        lines.append(f"| {r['k']}x{r['d']} | {r['bits']} | {g} | {r['batch']} | {r['kernel']} | "
                     f"{r['bits_per_weight']:.3f} | "
                     f"{r['lut_us']:.1f} | {r['lut_GBps']:.0f} | {r['frac_of_cublas_rate']:.2f} | {r['cublas_us']:.1f} "
                     f"| {r['speedup']:.2f} |")
    return f"Device: {device}\n\n" + "\n".join(lines)


def goals(rows):
    """The goals on 49152x12288 g128: batch-1 speedup (LUT kernel), batch 8 vs batch 1 for
    the LUT kernel alone and for the faster of the two kernels."""
    out = []
    by = {(r["k"], r["d"], r["bits"], r["group_size"], r["batch"], r["kernel"]): r for r in rows}
    for q, target in GOALS.items():
        r1 = by.get((*GOAL_SHAPE, q, 128, 1, "lut"))
        if r1 is None:
            continue
        res = {"bits": q, "speedup_b1": r1["speedup"], "goal": target, "met": r1["speedup"] >= target}
        b8 = {kern: by[(*GOAL_SHAPE, q, 128, 8, kern)]["lut_us"] for kern in ("lut", "mma")
              if (*GOAL_SHAPE, q, 128, 8, kern) in by}
        if b8:
            ratio = min(b8.values()) / r1["lut_us"]
            res |= {"b8_over_b1": ratio, "b8_over_b1_by_kernel": {kk: v / r1["lut_us"] for kk, v in b8.items()},
                    "b8_goal": GOAL_BATCH8_RATIO, "b8_met": ratio <= GOAL_BATCH8_RATIO}
        out.append(res)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shapes 4096x4096 and 49152x12288, q3, g128 only")
    ap.add_argument("--shapes", default=None, help="comma list of OUTxIN (default: the six of RESULTS.md)")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--groups", default="128,-1", help="group sizes; -1 = one group per row")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--offset", action="store_true", help="BCQ with an offset z (as uniform conversions have)")
    ap.add_argument("--iters", type=int, default=10, help="timed graph replays per measurement")
    ap.add_argument("--no-crossover", action="store_true")
    ap.add_argument("--grid-sweep", action="store_true", help="only the grid-size sweep (minimum steps per block)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.shapes = args.shapes or ",".join(f"{k}x{d}" for k, d in QUICK_SHAPES)
        args.bits, args.groups = "3", "128"
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    args.bits = [int(b) for b in args.bits.split(",")]
    args.groups = [int(g) for g in args.groups.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    t0 = time.perf_counter()
    ops = lutgemm.kernels()
    if ops is None:
        raise SystemExit("the lutgemm extension did not build (see the warning above)")
    build_s = time.perf_counter() - t0
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    device = torch.cuda.get_device_name()
    print(f"{device}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB; extension ready in {build_s:.1f} s")
    if args.grid_sweep:
        rows = grid_sweep(ops, args, l2)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"device": device, "date": time.strftime("%Y-%m-%d"),
                                                   "grid_sweep": rows}, indent=1))
        return
    print("shape          config       kernel   latency   eff. rate  frac | cuBLAS fp16 (same batch)     | speedup")
    torch.manual_seed(0)
    rows = []
    for k, d in shapes:
        rows += bench_shape(ops, k, d, args, l2)
        torch.cuda.empty_cache()
    sweep = None
    if not args.no_crossover:
        big = [s for s in shapes if s == GOAL_SHAPE] or shapes[-1:]
        sweep = batch_sweep(ops, *big[0], args, l2)
        print(f"suggested MMA_MIN_BATCH = {sweep['suggested_mma_min_batch']} "
              f"(current {lutgemm.MMA_MIN_BATCH}; 9 = never)")
        torch.cuda.empty_cache()
    cross = []
    if not args.no_crossover:
        for k, d in [s for s in shapes if s in ((4096, 4096), (11008, 4096), (49152, 12288))]:
            cross.append(crossover(ops, k, d, args, l2))
            torch.cuda.empty_cache()
        for c in cross:
            print(f"{c['k']}x{c['d']}: LUT loses from {c['lut_loses_from_tokens']} tokens; "
                  f"dequantize {c['dequant_us']:.1f} us ({c['dequant_write_GBps']:.0f} GB/s written)")
        cached = [c["lut_loses_from_tokens"]["cached"] for c in cross if c["lut_loses_from_tokens"]["cached"]]
        if cached:
            best = max((n for n in CROSSOVER_TOKENS if n < min(cached)), default=0)
            print(f"suggested MATVEC_MAX_TOKENS = {best} (largest measured count below every cached crossover; "
                  f"current {lutgemm.MATVEC_MAX_TOKENS})")
    gl = goals(rows)
    for g in gl:
        line = (f"goal 49152x12288 g128 q{g['bits']}: x{g['speedup_b1']:.2f} "
                f"(>= {g['goal']}: {'met' if g['met'] else 'NOT met'})")
        if "b8_over_b1" in g:
            per = ", ".join(f"{kk} {v:.2f}" for kk, v in g["b8_over_b1_by_kernel"].items())
            line += (f"; batch 8 = {g['b8_over_b1']:.2f} x batch 1 "
                     f"({per}; <= 1.5: {'met' if g['b8_met'] else 'NOT met'})")
        print(line)
    print()
    print(markdown(rows, device))
    bad = [r for r in rows if r["rel_err"] >= MAX_REL_ERR]
    meta = {"device": device, "sms": props.multi_processor_count, "l2_bytes": l2, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"), "build_s": build_s,
            "matvec_max_tokens": lutgemm.MATVEC_MAX_TOKENS, "mma_min_batch": lutgemm.MMA_MIN_BATCH, "iters": args.iters,
            "timing": "CUDA graph of repeated calls over >= 4x L2 of weight copies, median of replays",
            "total_s": time.perf_counter() - t0}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "batch_sweep": sweep, "crossover": cross,
                                               "goals": gl}, indent=1))
    print(f"total {meta['total_s']:.0f} s")
    if bad:
        raise SystemExit(f"{len(bad)} configurations exceed the relative error bound {MAX_REL_ERR}")


if __name__ == "__main__":
    main()
