"""Per-layer GPTQ time (our PyTorch implementation) for given weight shapes: the baseline the
fused k-OOC kernel must beat. Random weights; H from random correlated inputs (n tokens).

  python scripts/bench_gptq_speed.py --device cuda --json out/gptq_speed.json
Prints a table (median of --repeats runs, after one warm-up) and writes JSON.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from quantkit.methods import make_method

SHAPES = {  # (out_features, in_features)
    "smollm2 q/o 576x576": (576, 576),
    "smollm2 up 1536x576": (1536, 576),
    "smollm2 down 576x1536": (576, 1536),
    "opt-125m 768x768": (768, 768),
    "7b q/o 4096x4096": (4096, 4096),
    "7b up 11008x4096": (11008, 4096),
    "7b down 4096x11008": (4096, 11008),
}


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--config", action="append", default=None,
                    help="BITS:GROUP[:act_order][:static_groups][:clip_search] "
                         "(default: 4:128, 3:128, 4:128:act_order)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = args.config or ["4:128", "3:128", "4:128:act_order"]
    gen = torch.Generator(device=args.device).manual_seed(0)
    rows = []
    for label in args.shapes.split(","):
        k, d = SHAPES[label]
        w = torch.randn(k, d, device=args.device, generator=gen) * 0.02
        mix = torch.randn(d, d, device=args.device, generator=gen) / d**0.5 + torch.eye(d, device=args.device)
        x = torch.randn(args.tokens, d, device=args.device, generator=gen) @ mix  # correlated inputs
        stats = {"xtx": x.t() @ x, "nsamples": args.tokens // 2048 or 1, "ntokens": args.tokens}
        for cfg in configs:
            bits, group, *flags = cfg.split(":")
            method = make_method("gptq", bits=int(bits), group_size=int(group), act_order="act_order" in flags,
                                 static_groups="static_groups" in flags, clip_search="clip_search" in flags)
            method.quantize(w, stats)  # warm-up (allocator, kernels)
            times = []
            for _ in range(args.repeats):
                sync(args.device)
                t0 = time.perf_counter()
                method.quantize(w, stats)
                sync(args.device)
                times.append(time.perf_counter() - t0)
            rows.append({"shape": label, "k": k, "d": d, "config": cfg, "median_s": statistics.median(times),
                         "times_s": times})
            print(f"{label:24s} {cfg:18s} {statistics.median(times) * 1000:10.1f} ms", flush=True)
    meta = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
            "tokens": args.tokens, "repeats": args.repeats}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
