"""k-OOC kernel benchmark, one GPU, one process, per layer shape:
  * k-OOC(0): the fused kernel's GPTQ(2), g128, against our PyTorch GPTQ (the same function, kernel disabled);
  * k-OOC(s), s in {0.1, 0.2, 0.5, 1.0}: the kernel's candidate scan of GPTQ(2,2,0.1,s) against p-OOC-Batch
    (ooc_gptq's batched PyTorch loop) and p-OOC-Naive (ooc_gptq one candidate at a time);
with the peak GPU memory of each and the arithmetic floor: the error-update flops (2 per multiply-add, d(d-1)/2
per row and GPTQ run) over the fp32 GEMM rate measured in the same process.

  python3 benchmarks/bench_gptq_kernel.py --json $OUT/gptq_kernel.json     # all shapes, ~3 min with the build
  python3 benchmarks/bench_gptq_kernel.py --quick --json $OUT/quick.json   # three shapes, s in {0.1, 1.0}

Inputs: W = 0.02·N(0, 1), H from n = d + 1024 correlated random tokens, U = the damped inverse Cholesky factor
(computed once per shape, not timed: every path needs it). Times: CUDA events around each call after a warm-up
(median of --repeats for the kernel; the slow PyTorch paths run once per count, small shapes twice). The scan
is what ooc_gptq produces per candidate (codes, params, dequantized weights); choosing the winner (the probe
loss) costs the same for all three and is not timed. The kernel's scan streams the candidates (ooc_stream),
so its peak memory is one chunk's; p-OOC-Batch holds all candidates of a batch at once and runs the scan in
batches of as many as fit in 70 % of the free memory (every s measured); p-OOC-Naive runs one at a time and
is measured on --naive-cap candidates, then extrapolated linearly in the candidate count ("~" in the tables).
TF32 is off: every path computes in fp32. The kernel is also timed with 3xTF32 lazy updates
(benchmarks/gptq_split_tf32.py), with their code agreement.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from gptq_split_tf32 import split_updates  # benchmarks/, next to this script

from quantkit.kernels import build, gptq_cuda
from quantkit.methods.gptq import gptq_quantize, inverse_cholesky, prepare_hessian
from quantkit.methods.ooc import clear_count, ooc_gptq, select_candidates

SHAPES = {  # label: (out_features = rows k, in_features = columns d)
    "SmolLM2 q/o 576x576": (576, 576),
    "SmolLM2 up 1536x576": (1536, 576),
    "SmolLM2 down 576x1536": (576, 1536),
    "OPT-125M q 768x768": (768, 768),
    "OPT-125M fc1 3072x768": (3072, 768),
    "OPT-125M fc2 768x3072": (768, 3072),
    "Llama-2-7B q/o 4096x4096": (4096, 4096),
    "Llama-2-7B up 11008x4096": (11008, 4096),
    "Llama-2-7B down 4096x11008": (4096, 11008),
    "Llama-2-70B q/o 8192x8192": (8192, 8192),
    "Llama-2-70B up 28672x8192": (28672, 8192),
}
QUICK_SHAPES = ["SmolLM2 q/o 576x576", "OPT-125M fc2 768x3072", "Llama-2-7B q/o 4096x4096"]
SCANS = [0.1, 0.2, 0.5, 1.0]
BITS, GROUP, CLEAR = 2, 128, 0.1  # OOC(2, 2, 0.1, s), the paper's setting
BATCH_BYTES_PER_WEIGHT = 24  # p-OOC-Batch per candidate: W copy 4 + codes 8 + dq 4 + pending-update temp 4 + slack
MiB = 1 << 20


def measure(fn, repeats=1, keep=False):
    """(median seconds, peak extra bytes[, last result]) of fn() over `repeats` runs, timed with CUDA events."""
    times, peak, result = [], 0, None
    for _ in range(repeats):
        result = None  # the previous result must not count in this run's memory
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return (statistics.median(times), peak, result) if keep else (statistics.median(times), peak)


def sgemm_rate():
    """fp32 GEMM flop/s on this GPU (8192³, TF32 off): the rate the floor divides by."""
    a = torch.randn(8192, 8192, device="cuda")
    b = torch.randn(8192, 8192, device="cuda")
    torch.mm(a, b)
    seconds, _ = measure(lambda: torch.mm(a, b), repeats=5)
    return 2 * 8192**3 / seconds


def make_layer(k, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(k, d, device="cuda", generator=gen) * 0.02
    n = d + 1024
    mix = torch.randn(d, d, device="cuda", generator=gen) / d**0.5 + torch.eye(d, device="cuda")
    x = (torch.randn(n, d, device="cuda", generator=gen) @ mix) * torch.exp(
        0.5 * torch.randn(d, device="cuda", generator=gen))
    xtx = x.t() @ x
    del x, mix
    h, w = prepare_hessian(xtx, max(1, n // 2048), w)
    u, _ = inverse_cholesky(h, 0.01)
    return h, w, u


def gemm_only(k, d, u, repeats):
    """The kernel path's lazy-update GEMMs alone (same shapes, dummy data): the part cuBLAS does."""
    work = torch.randn(k, d, device="cuda")
    err = torch.randn(k, gptq_cuda.TILE, device="cuda") * 1e-3
    tiles = gptq_cuda.tile_plan(d, GROUP, 128)

    def run():
        for i1, i2 in tiles:
            if i2 < d:
                work[:, i2:].addmm_(err[:, : i2 - i1], u[i1:i2, i2:], alpha=-1)

    run()
    return measure(run, repeats)[0]


def gptq_row(label, k, d, h, w, u, rate, args):
    def kernel():
        return gptq_quantize(w, u, BITS, GROUP, False)

    def pytorch():
        with gptq_cuda.disabled():
            return gptq_quantize(w, u, BITS, GROUP, False)

    kernel()  # warm-up (the first call also builds or loads the extension)
    before = gptq_cuda.launches["tiles"]
    t_kernel, m_kernel, got = measure(kernel, args.repeats, keep=True)
    assert gptq_cuda.launches["tiles"] > before, "the kernel did not run"
    got = got[0]
    t_torch, m_torch, ref = measure(pytorch, 1 if d >= 4096 else 2, keep=True)
    agree = (got == ref[0]).double().mean().item()
    with split_updates():
        t_split, _, got_split = measure(kernel, args.repeats, keep=True)
    agree_split = (got_split[0] == ref[0]).double().mean().item()
    del got, ref, got_split
    floor = gptq_cuda.gptq_flops(k, d) / rate
    row = {"shape": label, "k": k, "d": d, "kernel_s": t_kernel, "pytorch_s": t_torch, "speedup": t_torch / t_kernel,
           "floor_s": floor, "kernel_over_floor": t_kernel / floor, "gemm_only_s": gemm_only(k, d, u, args.repeats),
           "peak_kernel_bytes": m_kernel, "peak_pytorch_bytes": m_torch, "codes_agree": agree,
           "kernel_3xtf32_s": t_split, "codes_agree_3xtf32": agree_split,
           "threads_per_row": gptq_cuda.threads_per_row(k)}
    print(f"  k-OOC(0) {label}: kernel {t_kernel * 1e3:.2f} ms (3xTF32 updates {t_split * 1e3:.2f} ms), "
          f"PyTorch {t_torch * 1e3:.1f} ms ({row['speedup']:.1f}x), floor {floor * 1e3:.2f} ms, "
          f"codes agree {agree:.5f} (3xTF32 {agree_split:.5f})", flush=True)
    return row


def candidates(h, w, scan):
    groups, cols = select_candidates(h, w, GROUP, scan, clear_count(CLEAR, GROUP))
    mask = torch.zeros(len(groups), w.shape[1], dtype=torch.bool, device="cuda")
    if groups:
        mask.scatter_(1, cols, True)
    return groups, mask


def drain(stream):
    for _ in stream:
        pass


def ooc_rows(label, k, d, h, w, u, rate, args, scans):
    free = torch.cuda.mem_get_info()[0]
    masks = {s: candidates(h, w, s)[1] for s in scans}
    counts = {s: masks[s].shape[0] for s in scans}
    # p-OOC-Batch holds every candidate of a batch at once (BATCH_BYTES_PER_WEIGHT each), so on one card it runs
    # the scan in batches of what fits; it is timed that way, every s measured (no extrapolation)
    fit = max(1, int(0.7 * free // (BATCH_BYTES_PER_WEIGHT * k * d)))
    per_batch = min(fit, args.batch_cap) if args.batch_cap else fit

    def batched(c, mask):
        for lo in range(0, c, per_batch):
            hi = min(c, lo + per_batch)
            ooc_gptq(w.expand(hi - lo, -1, -1), u, BITS, BITS, GROUP, False, mask[lo:hi])

    batch = {}
    for s in scans:
        while s not in batch:
            try:
                with gptq_cuda.disabled():
                    batch[s] = measure(lambda: batched(counts[s], masks[s]), 1)
            except torch.cuda.OutOfMemoryError:  # the size estimate was optimistic: smaller batches
                if per_batch == 1:
                    raise
                per_batch = max(1, per_batch // 2)
                torch.cuda.empty_cache()
    # p-OOC-Naive: one candidate at a time, results dropped as they come (the kernel's scan streams too)
    n_naive = min(args.naive_cap, max(counts.values()))
    naive_mask = masks[max(scans)][:n_naive]

    def naive():
        for m in range(n_naive):
            ooc_gptq(w[None], u, BITS, BITS, GROUP, False, naive_mask[m : m + 1])

    with gptq_cuda.disabled():
        t_naive, m_naive = measure(naive, 1)

    rows = []
    for s in scans:
        c, mask = counts[s], masks[s]
        fractions = (mask.to(torch.uint8).argmax(dim=1) // GROUP * GROUP).float().div(d).tolist()

        def scan():
            drain(gptq_cuda.ooc_stream(w.expand(c, -1, -1), u, BITS, BITS, GROUP, False, mask))

        t_kernel, m_kernel = measure(scan, args.repeats)
        with split_updates():
            t_split, _ = measure(scan, 1)
        t_batch, m_batch = batch[s]
        batch_exact = True
        units = gptq_cuda.ooc_work_units(fractions)
        floor = units * gptq_cuda.gptq_flops(k, d) / rate
        row = {"shape": label, "k": k, "d": d, "scan": s, "candidates": c, "kernel_s": t_kernel,
               "batch_s": t_batch, "batch_measured": batch_exact, "batch_per_run": per_batch,
               "naive_s": t_naive * c / n_naive,
               "naive_measured": c == n_naive, "speedup_batch": t_batch / t_kernel,
               "speedup_naive": t_naive * c / n_naive / t_kernel, "work_units": units, "floor_s": floor,
               "kernel_over_floor": t_kernel / floor, "kernel_3xtf32_s": t_split,
               "peak_kernel_bytes": m_kernel, "peak_batch_bytes": m_batch,
               "peak_naive_bytes": m_naive}
        rows.append(row)
        print(f"  k-OOC({s}) {label}: {c} candidates, kernel {t_kernel * 1e3:.1f} ms "
              f"(3xTF32 updates {t_split * 1e3:.1f} ms), batch {t_batch:.2f} s"
              f"{'' if batch_exact else ' (extrap.)'}, naive {row['naive_s']:.2f} s"
              f"{'' if row['naive_measured'] else ' (extrap.)'}", flush=True)
    return rows


def tpr_sweep(label, k, d, w, u, args):
    out = []
    chosen = gptq_cuda.threads_per_row
    try:
        for tpr in gptq_cuda.THREADS_PER_ROW:
            gptq_cuda.threads_per_row = lambda rows, tpr=tpr: tpr  # every instance, the unchosen 4 included
            gptq_quantize(w, u, BITS, GROUP, False)
            out.append({"shape": label, "threads_per_row": tpr,
                        "kernel_s": measure(lambda: gptq_quantize(w, u, BITS, GROUP, False), args.repeats)[0]})
    finally:
        gptq_cuda.threads_per_row = chosen
    print(f"  threads per row {label}: " + ", ".join(f"{r['threads_per_row']}: {r['kernel_s'] * 1e3:.2f} ms"
                                                  for r in out), flush=True)
    return out


def mark(value, exact):
    return ("" if exact else "~") + value


def tables(gptq, ooc, sweep, meta):
    lines = [f"Device {meta['device']}, torch {meta['torch']}, fp32 GEMM rate {meta['sgemm_tflops']:.1f} TFLOP/s "
             f"(TF32 off), {meta['date']}.", "",
             "| shape (out x in) | kernel ms | PyTorch GPTQ ms | speedup | floor ms | kernel/floor | GEMM-only ms "
             "| peak MiB kernel / PyTorch | codes agree | kernel ms, 3xTF32 updates | codes agree, 3xTF32 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in gptq:
        agree = f"{100 * r['codes_agree']:.3f} %"
        lines.append(f"| {r['shape']} | {r['kernel_s'] * 1e3:.2f} | {r['pytorch_s'] * 1e3:.1f} | {r['speedup']:.1f}x "
                     f"| {r['floor_s'] * 1e3:.2f} | {r['kernel_over_floor']:.1f} | {r['gemm_only_s'] * 1e3:.2f} "
                     f"| {r['peak_kernel_bytes'] / MiB:.0f} / {r['peak_pytorch_bytes'] / MiB:.0f} | {agree} "
                     f"| {r['kernel_3xtf32_s'] * 1e3:.2f} | {100 * r['codes_agree_3xtf32']:.3f} % |")
    lines += ["", "| shape (out x in) | s | cands | kernel ms | p-OOC-Batch s | p-OOC-Naive s | x Batch | x Naive "
              "| work (GPTQ runs) | floor ms | kernel/floor | peak MiB kernel / Batch / Naive | kernel ms, 3xTF32 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ooc:
        b, n = r["batch_measured"], r["naive_measured"]
        cells = [r["shape"], str(r["scan"]), str(r["candidates"]), f"{r['kernel_s'] * 1e3:.1f}",
                 mark(f"{r['batch_s']:.2f}", b), mark(f"{r['naive_s']:.2f}", n),
                 mark(f"{r['speedup_batch']:.0f}x", b), mark(f"{r['speedup_naive']:.0f}x", n),
                 f"{r['work_units']:.1f}", f"{r['floor_s'] * 1e3:.1f}", f"{r['kernel_over_floor']:.1f}",
                 f"{r['peak_kernel_bytes'] / MiB:.0f} / " + mark(f"{r['peak_batch_bytes'] / MiB:.0f}", b)
                 + f" / {r['peak_naive_bytes'] / MiB:.0f}", f"{r['kernel_3xtf32_s'] * 1e3:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if sweep:
        lines += ["", "| shape | threads per row | kernel ms |", "|---|---:|---:|"]
        lines += [f"| {r['shape']} | {r['threads_per_row']} | {r['kernel_s'] * 1e3:.2f} |" for r in sweep]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"shapes {', '.join(QUICK_SHAPES)}; s in 0.1, 1.0")
    ap.add_argument("--shapes", default=None, help="comma-separated labels of SHAPES (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="timed kernel runs per measurement (median)")
    ap.add_argument("--batch-cap", type=int, default=0,
                    help="most candidates p-OOC-Batch runs at once (default 0: as many as fit in 70%% of free memory)")
    ap.add_argument("--naive-cap", type=int, default=1,
                    help="candidates p-OOC-Naive runs; its time is per candidate x count beyond that (extrapolated)")
    ap.add_argument("--sweep", default="Llama-2-7B q/o 4096x4096,Llama-2-70B up 28672x8192",
                    help="shapes to time with every threads-per-row variant ('' for none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or build.load("gptq", verbose=False) is None:
        raise SystemExit(f"the gptq kernel is unavailable: {build.unavailable_reason('gptq')}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    labels = QUICK_SHAPES if args.quick else (args.shapes.split(",") if args.shapes else list(SHAPES))
    scans = [0.1, 1.0] if args.quick else SCANS
    t_start = time.time()
    rate = sgemm_rate()
    print(f"fp32 GEMM {rate / 1e12:.1f} TFLOP/s", flush=True)
    gptq_rows, ooc_all, sweep = [], [], []
    for label in labels:
        k, d = SHAPES[label]
        h, w, u = make_layer(k, d)
        gptq_rows.append(gptq_row(label, k, d, h, w, u, rate, args))
        ooc_all += ooc_rows(label, k, d, h, w, u, rate, args, scans)
        if label in args.sweep.split(","):
            sweep += tpr_sweep(label, k, d, w, u, args)
        del h, w, u
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "sgemm_tflops": rate / 1e12, "bits": BITS, "group": GROUP, "clear_fraction": CLEAR,
            "repeats": args.repeats, "batch_cap": args.batch_cap, "naive_cap": args.naive_cap,
            "wall_s": time.time() - t_start}
    print()
    print(tables(gptq_rows, ooc_all, sweep, meta))
    print(f"\nwall {meta['wall_s']:.0f} s (after the kernel build)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "gptq": gptq_rows, "ooc": ooc_all, "sweep": sweep},
                                              indent=1))


if __name__ == "__main__":
    main()
