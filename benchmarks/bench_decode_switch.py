"""A/B of one runtime switch, end to end: decode with each value of a module-level setting, captured anew each time.

  python benchmarks/bench_decode_switch.py --switch quantkit.runtime.decode_attention:READ_CACHE_BEFORE_WAIT \
      --values True,False --json $OUT/ab.json                                    # ~2 min on an H100

The model and timing are bench_e2e_decode's (Llama-2-7B shapes, random weights, `FastGenerator.run`, one CUDA
graph per step, greedy). For each format the same model decodes with the switch (MODULE:NAME, set with
setattr) at each of --values (Python literals), a new generator and graph capture per run (a graph keeps the
kernels and arguments it was captured with), in alternating order over --rounds rounds. The switch must be read
when the kernels launch (a name bound at import, such as a default argument, does not change with it). Prints
ms/token per value and round and each value's speedup over the first value in the same rounds, and says where the
greedy tokens differ between runs; the JSON has every run.
"""

import argparse
import ast
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e_decode import FORMATS, LLAMA2_7B, build_model, family_of, prompts_for, time_decode  # noqa: E402

from quantkit.runtime.generate import FastGenerator  # noqa: E402
from quantkit.runtime.model import DecoderConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", required=True, help="MODULE:NAME of a module-level setting")
    ap.add_argument("--values", required=True,
                    help="two or more comma-separated Python literals, e.g. True,False or 64,256; the first is the "
                         "baseline")
    ap.add_argument("--formats", default="fp16,bcq-q3-g128,bcq-q4-g128,anyprec-3",
                    help=f"comma list from {','.join(FORMATS)} [%(default)s]")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per value and round, median")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    module_name, _, attr = args.switch.partition(":")
    module = importlib.import_module(module_name)
    if not attr or not hasattr(module, attr):
        raise SystemExit(f"{args.switch}: no such module-level name")
    values = ast.literal_eval(args.values)
    if not isinstance(values, tuple) or len(values) < 2 or len(set(map(repr, values))) < len(values):
        raise SystemExit("--values: two or more different comma-separated Python literals")
    formats = args.formats.split(",")
    if any(f not in FORMATS for f in formats):
        raise SystemExit("--formats names from " + ",".join(FORMATS))
    from transformers import LlamaConfig

    cfg = DecoderConfig.from_transformers(LlamaConfig(**LLAMA2_7B))
    default = getattr(module, attr)
    prompts = prompts_for(args.batch, args.prompt_len, cfg.vocab_size, 0)
    rows, started = [], time.perf_counter()
    for family in dict.fromkeys(family_of(f) for f in formats):
        model = build_model(cfg, family, 0)
        for fmt in (f for f in formats if family_of(f) == family):
            if fmt.startswith("anyprec-"):
                model.set_bits(int(fmt.split("-")[1]))
            for r in range(args.rounds):
                for i in (range(len(values)) if r % 2 == 0 else reversed(range(len(values)))):
                    setattr(module, attr, values[i])
                    try:
                        timed = time_decode(FastGenerator(model), prompts, args.gen, args.repeats)
                    finally:
                        setattr(module, attr, default)
                    torch.cuda.empty_cache()
                    ms = timed["ms_per_token"]
                    rows.append({"format": fmt, "round": r, "value": repr(values[i]), "ms_per_token": ms,
                                 "tokens_digest": timed["tokens_digest"]})
                    print(f"{fmt} round {r} {attr}={values[i]!r}: {ms:.3f} ms/token", flush=True)
        del model
        torch.cuda.empty_cache()
    names = [repr(v) for v in values]
    print(f"\n{torch.cuda.get_device_name()}, batch {args.batch}, prompt {args.prompt_len}, {args.gen} tokens; "
          f"{args.switch}, ms/token per round")
    print("| format | " + " | ".join(names) + " | " + " | ".join(f"{n} vs {names[0]}" for n in names[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    summary = {}
    for fmt in formats:
        ms = {n: [r["ms_per_token"] for r in rows if r["format"] == fmt and r["value"] == n] for n in names}
        med = {n: statistics.median(v) for n, v in ms.items()}
        # greedy tokens alike under every value? (BCQ may part at a near-tie: its sums add in no fixed order)
        same = len({r["tokens_digest"] for r in rows if r["format"] == fmt}) == 1
        summary[fmt] = {"median_ms": med, "speedup_over_first": {n: med[names[0]] / med[n] for n in names[1:]},
                        "same_tokens": same}
        print(f"| {fmt} | " + " | ".join(" / ".join(f"{v:.3f}" for v in ms[n]) for n in names) + " | "
              + " | ".join(f"{med[names[0]] / med[n]:.3f}x" for n in names[1:]) + " |"
              + ("" if same else "  (tokens differ between runs)"))
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "switch": args.switch,
            "values": names, "batch": args.batch, "gen": args.gen, "prompt_len": args.prompt_len, "rows": rows,
            "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
