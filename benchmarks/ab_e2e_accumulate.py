"""A/B in one process: fused decoder layers with the LUT matvecs' split-K sums finished by the next kernel
(QuantLinear.accumulate, runtime/fusion.py) against the ordinary calls.

    python benchmarks/ab_e2e_accumulate.py --formats fp16,bcq-q3-g128,bcq-q4-g128 --json out.json

Variants, alternated twice per format on one model: "all" (o_proj, stacked gate/up and down), "mlp"
(gate/up and down only), "none" (every matvec finishes its own sums). Full fusion, split attention,
Llama-2-7B shapes (bench_e2e_decode.py); fp16 runs once, as the ratio's base. Prints ms per token.
"""

import argparse
import json

import torch

import bench_e2e_decode as bench
from quantkit.runtime import fusion

VARIANTS = ("all", "none", "mlp")


def set_variant(variant, originals):
    accumulating, returns_o_proj = originals
    fusion._accumulating_projections = accumulating if variant in ("all", "mlp") else (lambda mlp: None)
    fusion._returns_o_proj_output = returns_o_proj if variant == "all" else (lambda forward: False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp16,bcq-q3-g128,bcq-q4-g128")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    run_args = argparse.Namespace(gen=[args.gen], repeats=2, no_graph=False, no_share=True, include_reference=False,
                                  seed=0, layers=32, prompt_len=128)
    originals = (fusion._accumulating_projections, fusion._returns_o_proj_output)
    torch.manual_seed(0)
    model = bench.build_model(32)
    dense = bench.decoder_linears(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    formats = args.formats.split(",")
    results = []
    try:
        for family in dict.fromkeys(bench.family_of(f) for f in formats):
            modules = list(dense.values()) if family == "fp16" else list(bench.install(model, dense, family, 0).values())
            for fmt in (f for f in formats if bench.family_of(f) == family):
                for variant in ("all",) if fmt == "fp16" else VARIANTS * 2:
                    set_variant(variant, originals)
                    fusion.fuse_pointwise(model)
                    before = len(results)
                    bench.run_format(fmt, "full", "split", model, modules, prompt, run_args, results)
                    fusion.unfuse_pointwise(model)
                    for row in results[before:]:
                        row["variant"] = variant
            bench.restore(model, dense)
            del modules
            torch.cuda.empty_cache()
    finally:
        set_variant("all", originals)
    summary = {}
    for row in results:
        summary.setdefault((row["format"], row["variant"]), []).append(row["ms_per_token"])
    for (fmt, variant), ms in summary.items():
        print(f"{fmt:16s} {variant:6s} " + " ".join(f"{m:.4f}" for m in ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
