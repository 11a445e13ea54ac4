"""Any-precision matvec: today's kernel against its variants (anyprec_gemm.CANDIDATES) and cuBLAS fp16.

One process, one GPU. For every shape, width 3..8 and batch 1 and 8 it times cuBLAS fp16 and each built
candidate instance (today's kernel, FLAG_PAIR / FLAG_OCC variants with their own tile choice or one tile, the
row-per-lane FLAG_ROWS kernel with its own split or none, reading its rows-layout copy of the planes)
on the same random 8-bit parent, in alternating order over two passes (best of the two medians is kept).
Timing as bench_anyprec_kernel.py: CUDA graphs of many calls cycling through weight copies larger than 3x L2.

  python benchmarks/bench_anyprec_variants.py --json out.json [--shapes 4096x4096,...] [--bits 4,8]
      [--candidates today,rows,...]

The JSON is rewritten after every shape (a cut-short run keeps what it measured) and is what
benchmarks/anyprec_dispatch_table.py turns into quantkit/kernels/anyprec_variants.py. Printed last: per
shape, width and batch the cuBLAS time, today's time, the best candidate and its speedup over cuBLAS fp16,
GB/s of bytes read and fraction of the fp16 streaming rate.
"""

import argparse
import json
import subprocess
import time

import torch
from bench_anyprec_kernel import Parent, copies_for, fmt_table, graph_time, load_kernel

from quantkit.kernels import anyprec_gemm as ag

# the shapes that matter most first: a run cut short by its time limit keeps them
SHAPES = [(28672, 8192), (49152, 12288), (11008, 4096), (4096, 4096), (8192, 28672), (4096, 11008),
          (14336, 4096)]


def commit():
    """The checkout's commit, with "+changes" when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (head + ("+changes" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def instances(ext, bits, rows, words, batch, device, names):
    """{candidate name: (flags, tiles)} of the built candidates among `names` for this case."""
    found = {}
    for name, (flags, tiles) in ag.CANDIDATES.items():
        if name not in names or not ext.has_matvec(torch.float16, bits, 1, flags):
            continue
        if tiles is None:
            tiles = ag.default_tiles(flags, bits, rows, words, batch, device, ext)
        if ext.has_matvec(torch.float16, bits, tiles, flags):
            found[name] = (flags, tiles)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="write every measurement to this file")
    ap.add_argument("--shapes", help="comma-separated MxN (out x in) instead of the default shapes")
    ap.add_argument("--bits", default="3,4,5,6,7,8", help="comma-separated widths (default 3..8)")
    ap.add_argument("--batches", default="1,8", help="comma-separated batches (default 1,8)")
    ap.add_argument("--passes", type=int, default=2, help="alternating passes over the candidates (default 2)")
    ap.add_argument("--candidates", default=",".join(ag.CANDIDATES),
                    help="comma-separated names of anyprec_gemm.CANDIDATES to time (default all; today's always)")
    args = ap.parse_args()

    ext, props, build_s = load_kernel()
    l2 = props.L2_cache_size
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    widths = [int(v) for v in args.bits.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    names = set(args.candidates.split(",")) | {"today"}
    unknown = names - set(ag.CANDIDATES)
    if unknown:
        raise SystemExit(f"unknown candidates {sorted(unknown)}; known: {', '.join(ag.CANDIDATES)}")
    rows_names = any(ag.CANDIDATES[n][0] & ag.FLAG_ROWS for n in names)
    res = {"info": {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": l2,
                    "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit(),
                    "date": time.strftime("%Y-%m-%d"), "build_or_load_s": round(build_s, 1),
                    "passes": args.passes},
           "rows": []}
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; extension ready in {build_s:.1f} s", flush=True)
    device = torch.device("cuda", torch.cuda.current_device())

    for rows, cols in shapes:
        t_shape = time.perf_counter()
        parent = Parent(rows, cols, copies_for(3 * rows * cols // 8, l2))
        # the row-per-lane kernel reads its own layout (one more copy of the planes)
        rows_planes = [ag.rows_layout(p) for p in parent.planes] if rows_names else parent.planes
        weights = [torch.randn(rows, cols, device="cuda").half() for _ in range(copies_for(2 * rows * cols, l2))]
        for batch in batches:
            x = torch.randn(batch, 32 * parent.words, device="cuda").half()
            out = torch.empty(batch, rows, dtype=torch.float16, device="cuda")
            t_fp16 = graph_time([lambda w=w: torch.mm(x, w.t(), out=out) for w in weights])
            fp16_gbs = (2 * rows * cols + 2 * batch * (rows + cols)) / t_fp16 / 1e9
            for bits in widths:
                cands = instances(ext, bits, rows, parent.words, batch, device, names)
                unique = sorted(set(cands.values()))
                failed = {}  # an instance that refuses this launch is reported, not timed
                for flags, tiles in unique:
                    planes = (rows_planes if flags & ag.FLAG_ROWS else parent.planes)[0]
                    try:
                        ext.matvec(x, planes, parent.luts[0][bits], bits, parent.words, None, out, flags, tiles)
                        torch.cuda.synchronize()
                    except RuntimeError as exc:
                        failed[(flags, tiles)] = str(exc).splitlines()[0]
                unique = [inst for inst in unique if inst not in failed]
                times = {inst: [] for inst in unique}
                for p in range(args.passes):
                    order = unique if p % 2 == 0 else unique[::-1]
                    for flags, tiles in order:
                        calls = []
                        copies = rows_planes if flags & ag.FLAG_ROWS else parent.planes
                        for planes, luts in zip(copies, parent.luts):
                            lut = luts[bits]
                            calls.append(lambda planes=planes, lut=lut, f=flags, t=tiles, k=bits, w=parent.words:
                                         ext.matvec(x, planes, lut, k, w, None, out, f, t))
                        times[(flags, tiles)].append(graph_time(calls))
                nbytes = parent.bytes_read(bits, batch)
                entry = {"shape": [rows, cols], "batch": batch, "bits": bits, "cublas_us": t_fp16 * 1e6,
                         "cublas_gbs": fp16_gbs, "bytes_read": nbytes, "candidates": {}}
                for name, inst in cands.items():
                    if inst in failed:
                        entry["candidates"][name] = {"flags": inst[0], "tiles": inst[1], "error": failed[inst]}
                        continue
                    best = min(times[inst])
                    gbs = nbytes / best / 1e9
                    entry["candidates"][name] = {"flags": inst[0], "tiles": inst[1], "us": best * 1e6,
                                                 "us_passes": [t * 1e6 for t in times[inst]],
                                                 "speedup": t_fp16 / best, "gbs": gbs, "frac_fp16_rate": gbs / fp16_gbs}
                res["rows"].append(entry)
        del parent, weights, rows_planes
        torch.cuda.empty_cache()
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"# {rows}x{cols} done in {time.perf_counter() - t_shape:.1f} s", flush=True)

    report(res)


def report(res):
    table = []
    for r in res["rows"]:
        c = {n: v for n, v in r["candidates"].items() if "us" in v}
        today = c["today"]["us"]
        best = min(c, key=lambda n: c[n]["us"])
        b = c[best]
        table.append([f"{r['shape'][0]}x{r['shape'][1]}", r["bits"], r["batch"], f"{r['cublas_us']:.1f}",
                      f"{today:.1f}", f"{r['cublas_us'] / today:.2f}x", best, f"{b['us']:.1f}", f"{b['speedup']:.2f}x",
                      f"{today / b['us']:.3f}", f"{b['gbs']:.0f}", f"{b['frac_fp16_rate']:.2f}"])
    print("\n## cuBLAS fp16, today's kernel and the fastest candidate (us per call; GB/s of bytes read)")
    print(fmt_table(["MxN", "bits", "batch", "cuBLAS", "today", "today x", "best", "us", "best x", "gain",
                     "GB/s", "of fp16"], table))


if __name__ == "__main__":
    main()
