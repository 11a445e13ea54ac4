"""Turn bench_anyprec_variants.py JSON files (one per GPU) into the dispatch table
quantkit/kernels/anyprec_variants.py.

  python benchmarks/anyprec_dispatch_table.py H100.json H200.json [--write] [--tolerance 0.01]

For every (width, batch) measured on a GPU, a candidate other than today's kernel is chosen only where it is
slower than today's kernel on no measured shape (by more than --tolerance, the timing noise allowed) and
faster by at least --min-gain in the geometric mean over the shapes; among those the fastest in that mean.
Batches 2..7, not measured, take a candidate only where batch 1 and batch 8 chose the same one. Without
--write the table is printed; with it the module is rewritten (entries of GPUs not given are kept).
"""

import argparse
import json
import math
import pprint
from pathlib import Path

import quantkit.kernels.anyprec_variants as variants

MODULE = Path(variants.__file__)
GPUS = ("H100", "H200", "B200", "A100", "L40S")


def gpu_key(device_name):
    """The table's key for a device name: the first known model it names, else the name itself."""
    return next((g for g in GPUS if g in device_name), device_name)


def choose(rows, tolerance, min_gain):
    """{bits: {batch: name}} from one run's rows, and per choice the evidence (geomean, worst ratio)."""
    by_case = {}
    for r in rows:
        by_case.setdefault((r["bits"], r["batch"]), []).append(r)
    chosen, evidence = {}, {}
    for (bits, batch), cases in sorted(by_case.items()):
        # a candidate that failed to launch on any case is never chosen
        names = set.intersection(*({n for n, v in r["candidates"].items() if "us" in v} for r in cases)) - {"today"}
        best, best_mean = None, 1.0 - min_gain
        for name in sorted(names):
            ratios = [r["candidates"][name]["us"] / r["candidates"]["today"]["us"] for r in cases]
            mean = math.exp(sum(math.log(v) for v in ratios) / len(ratios))
            if max(ratios) <= 1.0 + tolerance and mean <= best_mean:
                best, best_mean = name, mean
                evidence[(bits, batch)] = {"name": name, "geomean": round(mean, 4), "worst": round(max(ratios), 4),
                                           "shapes": len(cases)}
        if best is not None:
            chosen.setdefault(bits, {})[batch] = best
    for per_batch in chosen.values():
        first, last = per_batch.get(1), per_batch.get(8)
        if first is not None and first == last:
            for batch in range(2, 8):
                per_batch.setdefault(batch, first)
    return chosen, evidence


def render(choices, sources):
    """The module's text with the given tables."""
    text = MODULE.read_text()
    head, rest = text.split("# SOURCES:", 1)
    tail = rest.split("\n\ndef choice", 1)[1]
    return (head + "# SOURCES: the benchmark runs each GPU's entry came from (device, date, commit of the run)\n"
            + "SOURCES = " + pprint.pformat(sources, width=110, sort_dicts=True) + "\n\n"
            + "CHOICES = " + pprint.pformat(choices, width=110, sort_dicts=True) + "\n\n\ndef choice" + tail)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="JSON files written by bench_anyprec_variants.py")
    ap.add_argument("--tolerance", type=float, default=0.01, help="allowed slowdown on any shape (default 0.01)")
    ap.add_argument("--min-gain", type=float, default=0.02, help="required geomean gain (default 0.02)")
    ap.add_argument("--write", action="store_true", help=f"rewrite {MODULE.name}")
    args = ap.parse_args()

    choices, sources = dict(variants.CHOICES), dict(variants.SOURCES)
    for path in args.runs:
        run = json.loads(Path(path).read_text())
        key = gpu_key(run["info"]["device"])
        chosen, evidence = choose(run["rows"], args.tolerance, args.min_gain)
        choices[key] = chosen
        sources[key] = {k: run["info"].get(k) for k in ("device", "date", "commit")}
        print(f"{key} ({run['info']['device']}):")
        for (bits, batch), e in sorted(evidence.items()):
            print(f"  bits {bits} batch {batch}: {e['name']} (geomean {e['geomean']}, worst {e['worst']}, "
                  f"{e['shapes']} shapes)")
        if not evidence:
            print("  today's kernel everywhere")
    if args.write:
        MODULE.write_text(render(choices, sources))
        print(f"wrote {MODULE}")
    else:
        pprint.pprint(choices)


if __name__ == "__main__":
    main()
