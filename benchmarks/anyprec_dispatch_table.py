"""Turn bench_anyprec_variants.py JSON files into the dispatch table quantkit/kernels/anyprec_variants.py.

  python benchmarks/anyprec_dispatch_table.py RUN.json [RUN.json ...] [--write] [--min-gain 0.02]
      [--today-widths 4] [--widths 4] [--summary OUT.json]

Runs are grouped by GPU (the model its device name names); several runs of one GPU are combined per case
(shape, width, batch) by taking each candidate's slowest time over the runs (a candidate missing or failed in
any run is never chosen), so one lucky run cannot pick a loser. Then, per measured shape, width and batch, a
candidate other than today's kernel is chosen where it is at least --min-gain faster than today's kernel
(both slowest times); among those the fastest, ties going to the earlier name of anyprec_gemm.CANDIDATES.
Batches 2..7 are not measured and not written: anyprec_variants.choice serves them what batch 1 and 8 share.
Every measured shape is a shape class of the table, kept even where nothing beats today's kernel (see
anyprec_variants.shape_class for how a module's shape finds its class).

Without --write the table is printed; with it the module is rewritten (entries of GPUs not given are kept; with
--widths, only those widths of the given GPUs change, and their sources are recorded per width).
--summary writes, per GPU, shape, width and batch, the served instance against today's kernel and cuBLAS fp16
(kernels at their slowest time over the runs, cuBLAS at its fastest), with the bytes the kernel reads per µs and
that rate as a fraction of cuBLAS fp16's (the fp16 weight, x and y over its time); --markdown prints RESULTS.md's two
tables: per case the served instance's µs and speedup over cuBLAS fp16, then that rate.
"""

import argparse
import json
import pprint
from pathlib import Path

import quantkit.kernels.anyprec_variants as variants
from quantkit.kernels.anyprec_gemm import CANDIDATES

MODULE = Path(variants.__file__)
GPUS = ("H100", "H200", "B200", "A100", "L40S")


def gpu_key(device_name):
    """The table's key for a device name: the first known model it names, else the name itself."""
    return next((g for g in GPUS if g in device_name), device_name)


def combine(runs):
    """{(rows, cols, bits, batch): {"cublas_us": fastest, "us": {name: slowest}, "runs": n}} over runs (lists
    of rows); a case keeps only candidates timed in every run that measured it. cuBLAS keeps its fastest time
    so that speedups over it are not flattered by a slow run."""
    cases = {}
    for rows in runs:
        for r in rows:
            key = (r["shape"][0], r["shape"][1], r["bits"], r["batch"])
            timed = {n: v["us"] for n, v in r["candidates"].items() if "us" in v}
            case = cases.setdefault(key, {"cublas_us": r.get("cublas_us"), "us": timed, "runs": 0,
                                          "bytes_read": r.get("bytes_read"),
                                          "cublas_bytes": r["cublas_gbs"] * r["cublas_us"] * 1e3
                                          if r.get("cublas_gbs") and r.get("cublas_us") else None})
            if case["runs"]:
                case["us"] = {n: max(us, timed[n]) for n, us in case["us"].items() if n in timed}
                if r.get("cublas_us") is not None and case["cublas_us"] is not None:
                    case["cublas_us"] = min(case["cublas_us"], r["cublas_us"])
            case["runs"] += 1
    return cases


def choose(cases, min_gain, today_widths=()):
    """{(rows, cols): {bits: {batch: name}}} from one GPU's combined cases; widths in `today_widths` keep today's
    kernel everywhere."""
    order = {name: i for i, name in enumerate(CANDIDATES)}
    chosen = {}
    for (rows, cols, bits, batch), case in sorted(cases.items()):
        per_shape = chosen.setdefault((rows, cols), {})
        us = case["us"]
        if "today" not in us:
            continue
        today = us["today"]
        fine = [n for n in us if n != "today" and n in order and us[n] <= (1.0 - min_gain) * today
                and bits not in today_widths]
        best = min(fine, key=lambda n: (us[n], order[n]), default="today")
        if best != "today":
            per_shape.setdefault(bits, {})[batch] = best
    return chosen


def served(cases, chosen):
    """Per measured case, the instance `chosen` serves (today's where it names none) with its times."""
    evidence = {}
    for (rows, cols, bits, batch), case in sorted(cases.items()):
        us = case["us"]
        name = chosen.get((rows, cols), {}).get(bits, {}).get(batch, "today")
        if "today" not in us or name not in us:
            continue
        evidence[(rows, cols, bits, batch)] = {"name": name, "today_us": us["today"], "us": us[name],
                                               "cublas_us": case["cublas_us"], "runs": case["runs"],
                                               "bytes_read": case["bytes_read"], "cublas_bytes": case["cublas_bytes"]}
    return evidence


def merge_widths(kept, chosen, widths):
    """`kept`'s entries with those of `widths` replaced by `chosen`'s (a shape the new runs did not measure loses
    its entries at those widths: today's kernel serves them)."""
    merged = {}
    for shape in sorted(set(kept) | set(chosen)):
        per_shape = {bits: dict(v) for bits, v in kept.get(shape, {}).items() if bits not in widths}
        per_shape.update({bits: dict(v) for bits, v in chosen.get(shape, {}).items() if bits in widths})
        merged[shape] = dict(sorted(per_shape.items()))
    return merged


def summary(evidence):
    """Rows of the chosen instance against today's kernel and cuBLAS fp16, per measured case."""
    out = []
    for (rows, cols, bits, batch), e in sorted(evidence.items()):
        row = {"shape": [rows, cols], "bits": bits, "batch": batch, "chosen": e["name"],
               "today_us": round(e["today_us"], 2), "chosen_us": round(e["us"], 2),
               "gain_over_today": round(e["today_us"] / e["us"], 3)}
        if e["cublas_us"]:
            row.update(cublas_us=round(e["cublas_us"], 2), today_x_cublas=round(e["cublas_us"] / e["today_us"], 3),
                       chosen_x_cublas=round(e["cublas_us"] / e["us"], 3))
        if e["bytes_read"]:
            row.update(bytes_read=e["bytes_read"], chosen_gbs=round(e["bytes_read"] / e["us"] / 1e3, 1))
            if e["cublas_us"] and e["cublas_bytes"]:
                cublas_gbs = e["cublas_bytes"] / e["cublas_us"] / 1e3
                row.update(cublas_gbs=round(cublas_gbs, 1), chosen_fraction_of_cublas_rate=round(
                    e["bytes_read"] / e["us"] / 1e3 / cublas_gbs, 3))
        out.append(row)
    return out


def _table_rows(card, cases, cublas_cell, cell):
    """RESULTS.md rows, one per shape and batch: cuBLAS fp16's cell, then cell(case) at each width 3..8."""
    lines = []
    shapes = sorted({(c["shape"][0], c["shape"][1], c["batch"]) for c in cases},
                    key=lambda s: (s[0] * s[1], s[0], s[2]))
    for rows, cols, batch in shapes:
        here = {c["bits"]: c for c in cases if c["shape"] == [rows, cols] and c["batch"] == batch}
        cells = [cell(here[k]) if k in here else "–" for k in range(3, 9)]
        lines.append(f"| {rows}×{cols} | {card} | {batch} | {cublas_cell(next(iter(here.values())))} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_us(card, cases):
    """The served instance's µs (its speedup over cuBLAS fp16) at each width, * where it is not today's kernel."""
    return _table_rows(card, cases, lambda c: f"{c.get('cublas_us', 0):.1f}",
                       lambda c: f"{c['chosen_us']:.1f} ({c['chosen_x_cublas']:.2f}×)"
                       + ("*" if c["chosen"] != "today" else "") if "chosen_x_cublas" in c else "–")


def markdown(card, cases):
    """The served instance's GB/s of bytes read (its fraction of cuBLAS fp16's streaming rate) at each width."""
    return _table_rows(card, cases, lambda c: f"{c.get('cublas_gbs', 0):.0f}",
                       lambda c: f"{c['chosen_gbs']:.0f} ({c['chosen_fraction_of_cublas_rate']:.2f})"
                       if "chosen_fraction_of_cublas_rate" in c else "–")


SOURCES_COMMENT = ("# SOURCES: the benchmark runs each GPU's entry came from (device, date, commits of the runs;\n"
                   "# under 'widths', the runs that decided those widths)\n")


def render(choices, sources):
    """The module's text with the given tables."""
    text = MODULE.read_text()
    head, rest = text.split("# SOURCES:", 1)
    tail = rest.split("\n\ndef shape_class", 1)[1]
    return (head + SOURCES_COMMENT
            + "SOURCES = " + pprint.pformat(sources, width=110, sort_dicts=True) + "\n\n"
            + "CHOICES = " + pprint.pformat(choices, width=110, sort_dicts=True) + "\n\n\ndef shape_class" + tail)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="JSON files written by bench_anyprec_variants.py")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="how much faster than today's kernel a candidate must be on a shape (default 0.02)")
    ap.add_argument("--today-widths", default="",
                    help="comma list of widths that keep today's kernel at every shape (e.g. where end-to-end decode "
                         "measured the table's choices slower than today's kernel)")
    ap.add_argument("--widths", default="",
                    help="comma list of widths these runs decide; the table keeps its other widths' entries for "
                         "these GPUs (e.g. a new instance measured at one width, where the other widths' choices "
                         "were checked end to end)")
    ap.add_argument("--write", action="store_true", help=f"rewrite {MODULE.name}")
    ap.add_argument("--summary", help="write the chosen-against-today speedups per case to this JSON file")
    ap.add_argument("--markdown", action="store_true",
                    help="print each case's µs and GB/s as RESULTS.md's table rows")
    args = ap.parse_args()
    today_widths = sorted({int(w) for w in args.today_widths.split(",") if w})
    widths = sorted({int(w) for w in args.widths.split(",") if w})

    by_gpu = {}
    for path in args.runs:
        run = json.loads(Path(path).read_text())
        by_gpu.setdefault(gpu_key(run["info"]["device"]), []).append((path, run))
    choices, sources, report = dict(variants.CHOICES), dict(variants.SOURCES), {}
    for key, runs in sorted(by_gpu.items()):
        cases = combine([run["rows"] for _, run in runs])
        chosen = choose(cases, args.min_gain, today_widths)
        infos = [run["info"] for _, run in runs]
        source = {"device": infos[0]["device"], "date": max(i.get("date") or "" for i in infos),
                  "commits": sorted({i.get("commit") or "?" for i in infos}), "runs": len(runs),
                  **({"today_widths": today_widths} if today_widths else {})}
        if widths:  # only these widths change: the rest keep their entries and their sources
            chosen = merge_widths(choices.get(key, {}), chosen, widths)
            kept = {k: v for k, v in sources.get(key, {}).items() if k not in ("widths", "today_widths")}
            still_today = [w for w in sources.get(key, {}).get("today_widths", []) if w not in widths]
            if still_today:
                kept["today_widths"] = still_today
            by_width = dict(sources.get(key, {}).get("widths", {}))
            by_width.update({w: {**source, "min_gain": args.min_gain} for w in widths})
            source = {**kept, "widths": dict(sorted(by_width.items()))}
        choices[key], sources[key] = chosen, source
        evidence = served(cases, chosen)
        report[key] = {"runs": [Path(p).name for p, _ in runs],
                       "combined": "kernels: slowest time over the runs; cuBLAS: fastest",
                       "min_gain": args.min_gain, "today_widths": today_widths, "widths": widths,
                       "cases": summary(evidence)}
        print(f"{key} ({infos[0]['device']}, {len(runs)} run(s)):")
        for (rows, cols, bits, batch), e in sorted(evidence.items()):
            if e["name"] != "today":
                print(f"  {rows}x{cols} bits {bits} batch {batch}: {e['name']} {e['us']:.1f} us against "
                      f"today's {e['today_us']:.1f} ({e['today_us'] / e['us']:.3f}x)")
    if args.markdown:
        for key in sorted(report):
            print(markdown_us(key, report[key]["cases"]))
        for key in sorted(report):
            print(markdown(key, report[key]["cases"]))
    if args.summary:
        Path(args.summary).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.summary}")
    if args.write:
        MODULE.write_text(render(choices, sources))
        print(f"wrote {MODULE}")
    else:
        pprint.pprint(choices, width=110)


if __name__ == "__main__":
    main()
