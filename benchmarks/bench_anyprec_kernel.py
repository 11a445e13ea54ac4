"""Any-precision bitplane matvec kernel vs cuBLAS fp16, its ablations and the dequantize switch point.

Everything is measured in one process on one GPU. Parents are random (8 random bitplanes, random
sorted tables for 3..8 bits): the kernel's cost does not depend on the values. Times are per call,
from CUDA graphs of many calls (launch overhead as in a captured decode step) that cycle through
enough copies of the weights to exceed 3x the L2 size, so every call streams from HBM as in a real
model where each layer's weights are read once per token.

  python benchmarks/bench_anyprec_kernel.py [--quick] [--json out.json]

Tables: latency / speedup over cuBLAS fp16 / GB/s of bytes read / fraction of the fp16 rate for
every shape, width and batch; the ablation of each optimisation (anyprec.cu flags) at batch 1 and
8; TILES 1 vs 2; the one-time layout preprocessing; the rows where dequantize + cuBLAS overtakes
the kernel (what anyprec_gemm.MATVEC_MAX_ROWS should be); the goals of RESULTS.md checked.
"""

import argparse
import json
import math
import statistics
import time

import torch

from quantkit.kernels import anyprec_gemm as ag
from quantkit.kernels import build

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (28672, 8192)]  # out x in
VARIANTS = {"all": 7, "-LAYOUT": 6, "-IBT": 5, "-TLM": 3, "none": 0}


def graph_time(calls, min_calls=40, rounds=7):
    """Seconds per call: a CUDA graph replays `calls` round-robin; median over rounds."""
    n = max(min_calls, len(calls))
    n = -(-n // len(calls)) * len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:  # warm-up (and lazy allocations) outside capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / n)
    del graph
    return statistics.median(times)


def copies_for(nbytes, l2):
    return max(1, math.ceil(3 * l2 / nbytes))


class Parent:
    """Random 8-bit parent of one shape, in the kernel layout, with `copies` replicas."""

    def __init__(self, rows, cols, copies, natural=False):
        self.rows, self.cols, self.words = rows, cols, -(-cols // 32)
        g = torch.Generator(device="cuda").manual_seed(rows * 31 + cols)
        self.natural = []
        self.planes, self.luts = [], []
        for _ in range(copies):
            nat = torch.randint(-2**31, 2**31, (8, rows, self.words), generator=g, device="cuda", dtype=torch.int64)
            nat = nat.to(torch.int32)
            self.planes.append(ag.kernel_layout(nat))
            self.natural.append(nat if natural else None)
            self.luts.append({b: (torch.randn(rows, 2**b, generator=g, device="cuda").sort(1).values * 0.02).half()
                              for b in range(3, 9)})

    def bytes_read(self, bits, batch):
        return (bits * self.rows * self.words * 4 + self.rows * 2**bits * 2
                + batch * self.cols * 2 + batch * self.rows * 2)


def kernel_calls(ext, parent, bits, x, out, flags=7, tiles=None, natural=False):
    calls = []
    for i, planes in enumerate(parent.planes):
        p = parent.natural[i] if natural else planes
        lut = parent.luts[i][bits]
        t = tiles if tiles is not None else ag.choose_tiles(bits, parent.rows, x.shape[0], x.device, ext)
        calls.append(lambda p=p, lut=lut, t=t: ext.matvec(x, p, lut, bits, parent.words, None, out, flags, t))
    return calls


def cublas_calls(weights, x, out):
    return [lambda w=w: torch.mm(x, w.t(), out=out) for w in weights]


def fmt_table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def load_kernel():
    """(the anyprec extension, the GPU's properties, seconds to build or load it), TF32 off for cuBLAS."""
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    ext = build.load("anyprec", verbose=False)
    build_s = time.perf_counter() - t0
    if ext is None:
        raise SystemExit(f"anyprec kernel unavailable: {build.unavailable_reason('anyprec')}")
    return ext, torch.cuda.get_device_properties(0), build_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, widths 3/4/8, batch 1/8, short ablation")
    ap.add_argument("--json", help="write every measurement to this file")
    ap.add_argument("--no-switch", action="store_true", help="skip the dequantize switch-point sweep")
    ap.add_argument("--no-ablation", action="store_true", help="skip the ablation and tiles tables")
    ap.add_argument("--shapes", help="comma-separated MxN (out x in) instead of the default shapes, e.g. 11008x4096")
    ap.add_argument("--bits", help="comma-separated widths instead of the default (3..8, --quick 3,4,8)")
    ap.add_argument("--batches", help="comma-separated batches instead of the default (1,2,4,8, --quick 1,8)")
    args = ap.parse_args()

    ext, props, build_s = load_kernel()
    l2 = props.L2_cache_size
    info = {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": l2, "torch": torch.__version__,
            "cuda": torch.version.cuda, "build_or_load_s": round(build_s, 1), "quick": args.quick}
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; extension ready in {build_s:.1f} s")

    shapes = [(11008, 4096), (28672, 8192)] if args.quick else SHAPES
    widths = [3, 4, 8] if args.quick else [3, 4, 5, 6, 7, 8]
    batches = [1, 8] if args.quick else [1, 2, 4, 8]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.bits:
        widths = [int(v) for v in args.bits.split(",")]
    if args.batches:
        batches = [int(v) for v in args.batches.split(",")]
    results = {"info": info, "main": [], "ablation": [], "tiles": [], "layout_prep": [], "switch": []}

    for rows, cols in shapes:
        # copies: enough that the smallest read (3 bits) and the fp16 weight both exceed 3x L2
        parent = Parent(rows, cols, copies_for(3 * rows * cols // 8, l2), natural=True)
        weights = [torch.randn(rows, cols, device="cuda").half() for _ in range(copies_for(2 * rows * cols, l2))]
        torch.cuda.synchronize()
        t = time.perf_counter()
        ag.kernel_layout(parent.natural[0])
        torch.cuda.synchronize()
        prep_ms = (time.perf_counter() - t) * 1e3
        results["layout_prep"].append({"shape": [rows, cols], "ms": round(prep_ms, 2),
                                       "extra_bytes": parent.planes[0].numel() * 4})
        for batch in batches:
            x = torch.randn(batch, 32 * parent.words, device="cuda").half()
            out = torch.empty(batch, rows, dtype=torch.float16, device="cuda")
            t_fp16 = graph_time(cublas_calls(weights, x, out))
            fp16_gbs = (2 * rows * cols + 2 * batch * (rows + cols)) / t_fp16 / 1e9
            results["main"].append({"shape": [rows, cols], "bits": 16, "batch": batch, "us": t_fp16 * 1e6,
                                    "gbs": fp16_gbs})
            for bits in widths:
                tk = graph_time(kernel_calls(ext, parent, bits, x, out))
                gbs = parent.bytes_read(bits, batch) / tk / 1e9
                results["main"].append({"shape": [rows, cols], "bits": bits, "batch": batch, "us": tk * 1e6,
                                        "speedup": t_fp16 / tk, "gbs": gbs, "frac_fp16_rate": gbs / fp16_gbs,
                                        "tiles": ag.choose_tiles(bits, rows, batch, x.device, ext)})
        # ablations: each optimisation off alone, and all off (batch 1 and 8)
        abl_shapes = [(11008, 4096), (28672, 8192)]
        if (rows, cols) in abl_shapes and not args.no_ablation:
            for batch in (1, 8):
                x = torch.randn(batch, 32 * parent.words, device="cuda").half()
                out = torch.empty(batch, rows, dtype=torch.float16, device="cuda")
                for bits in widths:
                    base = None
                    for name, flags in VARIANTS.items():
                        if not ext.has_matvec(torch.float16, bits, 1, flags) or (name == "-TLM" and bits > 3):
                            continue
                        tk = graph_time(kernel_calls(ext, parent, bits, x, out, flags=flags, tiles=1,
                                                     natural=not flags & ag.FLAG_LAYOUT))
                        base = tk if name == "all" else base
                        results["ablation"].append({"shape": [rows, cols], "bits": bits, "batch": batch,
                                                    "variant": name, "flags": flags, "us": tk * 1e6,
                                                    "vs_all": tk / base})
                    for tiles in (1, 2):
                        if ext.has_matvec(torch.float16, bits, tiles, 7):
                            tk = graph_time(kernel_calls(ext, parent, bits, x, out, tiles=tiles))
                            results["tiles"].append({"shape": [rows, cols], "bits": bits, "batch": batch,
                                                     "tiles": tiles, "us": tk * 1e6})
        if not args.no_switch and (rows, cols) in [(11008, 4096), (28672, 8192)]:
            bits = 4
            sweep = [8, 16, 32, 64, 128] if args.quick else [8, 16, 24, 32, 48, 64, 96, 128, 256]
            wbuf = torch.empty(rows, cols, dtype=torch.float16, device="cuda")
            for batch in sweep:
                x = torch.randn(batch, 32 * parent.words, device="cuda").half()
                out = torch.empty(batch, rows, dtype=torch.float16, device="cuda")
                kcalls = [lambda p=p, lut=lut, words=parent.words: ag.matvec(x, p, lut, bits, words, out=out, ext=ext)
                          for p, lut in zip(parent.planes, (d[bits] for d in parent.luts))]
                dcalls = [lambda p=p, lut=lut: (ext.dequantize(p, lut, bits, cols, wbuf),
                                                torch.mm(x, wbuf.t(), out=out))
                          for p, lut in zip(parent.natural, (d[bits] for d in parent.luts))]
                tk, td, tc = graph_time(kcalls), graph_time(dcalls), graph_time(cublas_calls(weights, x, out))
                results["switch"].append({"shape": [rows, cols], "bits": bits, "batch": batch, "kernel_us": tk * 1e6,
                                          "dequant_cublas_us": td * 1e6, "cached_cublas_us": tc * 1e6})
        del parent, weights
        torch.cuda.empty_cache()

    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.json}")


def report(res):
    rows = []
    fp16 = {(tuple(r["shape"]), r["batch"]): r for r in res["main"] if r["bits"] == 16}
    for r in res["main"]:
        if r["bits"] == 16:
            continue
        f = fp16[(tuple(r["shape"]), r["batch"])]
        rows.append([f"{r['shape'][0]}x{r['shape'][1]}", r["bits"], r["batch"], f"{f['us']:.1f}", f"{r['us']:.1f}",
                     f"{r['speedup']:.2f}x", f"{r['gbs']:.0f}", f"{r['frac_fp16_rate']:.2f}", r["tiles"]])
    print("\n## Latency vs cuBLAS fp16 (us per call; GB/s of bytes read; fraction of the fp16 GB/s)")
    print(fmt_table(["MxN", "bits", "batch", "cuBLAS", "kernel", "speedup", "GB/s", "of fp16", "tiles"], rows))

    if res["ablation"]:
        print("\n## Ablation (TILES=1; vs_all > 1: turning the optimisation off is slower)")
        print(fmt_table(["MxN", "bits", "batch", "variant", "us", "vs all"],
                        [[f"{a['shape'][0]}x{a['shape'][1]}", a["bits"], a["batch"], a["variant"], f"{a['us']:.1f}",
                          f"{a['vs_all']:.2f}"] for a in res["ablation"]]))
    if res["tiles"]:
        print("\n## 16-row tiles per block (all optimisations)")
        print(fmt_table(["MxN", "bits", "batch", "tiles", "us"],
                        [[f"{a['shape'][0]}x{a['shape'][1]}", a["bits"], a["batch"], a["tiles"], f"{a['us']:.1f}"]
                         for a in res["tiles"]]))
    print("\n## One-time kernel layout (LAYOUT preprocessing of the 8-bit parent)")
    print(fmt_table(["MxN", "ms", "extra MiB"], [[f"{p['shape'][0]}x{p['shape'][1]}", f"{p['ms']:.1f}",
                                                 f"{p['extra_bytes'] / 2**20:.0f}"] for p in res["layout_prep"]]))
    if res["switch"]:
        print("\n## Switch point, 4 bits: kernel (8 rows per launch) vs dequantize + cuBLAS vs cached fp16 weight")
        print(fmt_table(["MxN", "rows", "kernel", "dequant+cuBLAS", "cached cuBLAS"],
                        [[f"{s['shape'][0]}x{s['shape'][1]}", s["batch"], f"{s['kernel_us']:.1f}",
                          f"{s['dequant_cublas_us']:.1f}", f"{s['cached_cublas_us']:.1f}"] for s in res["switch"]]))
        for key, name in (("dequant_cublas_us", "uncached"), ("cached_cublas_us", "cached")):
            last = {}
            for s in res["switch"]:
                if s["kernel_us"] <= s[key]:
                    last[tuple(s["shape"])] = max(last.get(tuple(s["shape"]), 0), s["batch"])
            print(f"largest rows where the kernel still wins ({name}): "
                  + ", ".join(f"{m}x{n}: {v}" for (m, n), v in last.items())
                  + f"  (anyprec_gemm.MATVEC_MAX_ROWS['{name}'] = {ag.MATVEC_MAX_ROWS[name]})")

    goals = check_goals(res)
    res["goals"] = goals
    print("\n## Goals")
    for g in goals:
        print(f"{'MET ' if g['met'] else 'MISS'} {g['goal']}: {g['value']}")


def check_goals(res):
    by = {(tuple(r["shape"]), r["bits"], r["batch"]): r for r in res["main"]}
    goals = []

    def add(text, value, met):
        goals.append({"goal": text, "value": value, "met": bool(met)})

    for shape, want in (((11008, 4096), 3.5), ((28672, 8192), 4.5)):
        r = by.get((shape, 3, 1))
        if r:
            add(f"3-bit batch-1 speedup on {shape[0]}x{shape[1]} >= {want}", f"{r['speedup']:.2f}x",
                r["speedup"] >= want)
    for shape in {tuple(r["shape"]) for r in res["main"]}:
        lat = [by[(shape, b, 1)]["us"] for b in range(3, 9) if (shape, b, 1) in by]
        if len(lat) >= 2 and (shape, 8, 1) in by and (shape, 3, 1) in by:
            falls = all(a <= b * 1.02 for a, b in zip(lat, lat[1:]))
            ratio = by[(shape, 8, 1)]["us"] / by[(shape, 3, 1)]["us"]
            add(f"{shape[0]}x{shape[1]}: latency falls with bits and 8-bit/3-bit >= 2", f"{ratio:.2f}",
                falls and ratio >= 2)
        if (shape, 4, 8) in by and (shape, 4, 1) in by:
            ratio = by[(shape, 4, 8)]["us"] / by[(shape, 4, 1)]["us"]
            add(f"{shape[0]}x{shape[1]}: 4-bit batch 8 <= 1.7x batch 1", f"{ratio:.2f}", ratio <= 1.7)
    return goals


if __name__ == "__main__":
    main()
