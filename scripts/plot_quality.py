"""Bits per weight against WikiText-2 perplexity, one series per method, from bench_quality.py JSON.

  python scripts/plot_quality.py out/quality_merged.json --out docs/quality-bits-wikitext2.png

x = measured bits per weight of the artifact; for an any-precision row served at b bits, the bits read at
that width (its b planes and its b-bit table; the artifact stores every width). y = WikiText-2 perplexity,
log scale. Needs matplotlib (not a quantkit dependency: pip install matplotlib).
"""

import argparse
import json
from pathlib import Path


def series_name(row):
    """The legend entry of a result row (None: not plotted)."""
    method, settings = row.get("method"), row.get("settings") or {}
    if "ensemble_of" in row:
        return "OOC two-flow ensemble"
    if method == "bcq":
        name = "BCQ output-aware" if settings.get("solver", "weight") == "output" else "BCQ weight-error"
        return name + (" + offset" if settings.get("offset") else "")
    if method == "squeezellm":
        return "SqueezeLLM" + (" + table refit" if settings.get("table_refit") == "output" else "")
    if method == "anyprec":
        if settings.get("upscale", "split") == "split":
            return "any-precision, split upscaling"
        return "any-precision" + (f" band {settings['band']}" if settings.get("band", 0.5) != 0.5 else "")
    if method == "gptq":
        return f"GPTQ g{settings.get('group_size')}"
    return {"rtn": "RTN", "ooc": "OOC"}.get(method)


def points(rows, dataset):
    """{series: [(bits, ppl, label)]} sorted by bits."""
    out = {}
    for row in rows:
        name = series_name(row)
        if name is None or dataset not in row.get("results", {}):
            continue
        bits = row.get("read_bits_per_weight") or row["bits_per_weight"]
        out.setdefault(name, []).append((bits, row["results"][dataset]["ppl"], row["config"]))
    return {name: sorted(p) for name, p in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default="docs/quality-bits-wikitext2.png")
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--max-ppl", type=float, default=1e4, help="rows above this perplexity are left off the plot")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.json).read_text())
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    markers = "osD^v<>phX*P"
    for i, (name, pts) in enumerate(sorted(points(rows, args.dataset).items())):
        pts = [p for p in pts if p[1] <= args.max_ppl]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], label=name,
                    linestyle="-" if len(pts) > 1 else "none")
    float_row = next((r for r in rows if r["config"] == "float"), None)
    if float_row is not None:
        ax.axhline(float_row["results"][args.dataset]["ppl"], color="gray", linestyle="--", label="float")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (any-precision: bits read at that width)")
    ax.set_ylabel(f"{args.dataset} perplexity (log)")
    meta = data.get("meta", {})
    ax.set_title(f"{meta.get('model', 'model')}: bits per weight vs {args.dataset} "
                 f"({meta.get('device', '')}, seqlen {meta.get('seqlen', '')})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
