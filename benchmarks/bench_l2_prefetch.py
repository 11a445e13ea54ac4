"""The L2 prefetch between matvecs (runtime/l2_prefetch.py), end to end: decode with it off and at scaled budgets.

  python benchmarks/bench_l2_prefetch.py --json $OUT/l2_prefetch_ab.json     # ~3 min on an H100

The model and timing are bench_e2e_decode's (Llama-2-7B shapes, random weights, `FastGenerator.run`, one CUDA
graph per step, greedy). For each format the same model is decoded with the prefetch off and with
l2_prefetch.BUDGETS scaled by each --scales factor, each setting captured anew (a graph keeps the setting
it was captured with), in alternating order over --rounds rounds. Prints ms/token per setting and round,
and the speedup of each setting over "off" in the same round; the JSON has every run.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e_decode import FORMATS, LLAMA2_7B, build_model, family_of, prompts_for, time_decode  # noqa: E402

from quantkit.runtime import l2_prefetch  # noqa: E402
from quantkit.runtime.generate import FastGenerator  # noqa: E402
from quantkit.runtime.model import DecoderConfig  # noqa: E402


def timed(model, prompts, gen, repeats, scale, base):
    """ms/token of a generation captured with the prefetch off (scale 0) or at base budgets x scale."""
    l2_prefetch.BUDGETS.update({site: int(b * scale) for site, b in base.items()})
    if scale == 0:
        with l2_prefetch.disabled():
            ms = time_decode(FastGenerator(model), prompts, gen, repeats)["ms_per_token"]
    else:
        ms = time_decode(FastGenerator(model), prompts, gen, repeats)["ms_per_token"]
    l2_prefetch.BUDGETS.update(base)
    torch.cuda.empty_cache()
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp16,bcq-q3-g128,bcq-q4-g128,anyprec-3,anyprec-4",
                    help=f"comma list from {','.join(FORMATS)} [%(default)s]")
    ap.add_argument("--scales", default="0,1,2", help="budget factors, 0 = off [%(default)s]")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per setting and round, median")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    formats = args.formats.split(",")
    scales = [float(s) for s in args.scales.split(",")]
    if 0 not in scales or any(f not in FORMATS for f in formats):
        raise SystemExit("--scales must include 0 (off), --formats names from " + ",".join(FORMATS))
    from transformers import LlamaConfig

    cfg = DecoderConfig.from_transformers(LlamaConfig(**LLAMA2_7B))
    base = dict(l2_prefetch.BUDGETS)
    prompts = prompts_for(args.batch, args.prompt_len, cfg.vocab_size, 0)
    rows, started = [], time.perf_counter()
    for family in dict.fromkeys(family_of(f) for f in formats):
        model = build_model(cfg, family, 0)
        for fmt in (f for f in formats if family_of(f) == family):
            if fmt.startswith("anyprec-"):
                model.set_bits(int(fmt.split("-")[1]))
            for r in range(args.rounds):
                order = scales if r % 2 == 0 else scales[::-1]
                for scale in order:
                    ms = timed(model, prompts, args.gen, args.repeats, scale, base)
                    rows.append({"format": fmt, "round": r, "scale": scale, "ms_per_token": ms})
                    print(f"{fmt} round {r} scale {scale:g}: {ms:.3f} ms/token", flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, batch {args.batch}, prompt {args.prompt_len}, {args.gen} tokens; "
          f"budgets {', '.join(f'{k} {v >> 20} MiB' for k, v in base.items())} x scale")
    print("| format | " + " | ".join(f"x{s:g}" if s else "off" for s in scales) + " | best vs off |")
    print("|---|" + "---:|" * (len(scales) + 1))
    summary = {}
    for fmt in formats:
        ms = {s: [r["ms_per_token"] for r in rows if r["format"] == fmt and r["scale"] == s] for s in scales}
        med = {s: statistics.median(v) for s, v in ms.items()}
        best = min((s for s in scales if s), key=lambda s: med[s], default=0)
        summary[fmt] = {"median_ms": {str(s): med[s] for s in scales}, "best_scale": best,
                        "best_speedup": med[0] / med[best]}
        print(f"| {fmt} | " + " | ".join(" / ".join(f"{v:.3f}" for v in ms[s]) for s in scales)
              + f" | {med[0] / med[best]:.3f}x (x{best:g}) |")
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
            "gen": args.gen, "prompt_len": args.prompt_len, "budgets": base, "programs": l2_prefetch.PROGRAMS,
            "rows": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
