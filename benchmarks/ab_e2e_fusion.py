"""A/B in one process: parts of the decoder-layer fusion (runtime/fusion.py) on and off, Llama-2-7B shapes.

    python benchmarks/ab_e2e_fusion.py --formats fp16,bcq-q3-g128,bcq-q4-g128 --json out.json

Variants (--variants), alternated twice per format on one model, each with full fusion, split attention
and 128 generated tokens (bench_e2e_decode.py), every format under every variant, so that each variant
has its own fp16 base:
- "all": everything fusion.py does.
- "separate-attention": decode steps call the attention's own forward (the rotary embedding a kernel of
  its own, q/k/v finished by their matvec); o_proj, gate/up and down still leave their sums to the next
  kernel (`_restated_attention` off).
- "eager-angles": the rotary embedding's angles computed by transformers' own forward (eight kernels a
  step instead of one compiled kernel; `_static_rotary` off).
- "no-sums": "separate-attention", and every matvec finishes its own sums (`_accumulating_projections` and
  `_returns_o_proj_output` off too).
- "mlp-sums": only gate/up and down leave their sums (`_restated_attention` and `_returns_o_proj_output`
  off).
- "no-overlap": everything, but every kernel launched without programmatic dependent launch
  (kernels/overlap.py disabled while the step's graph is captured).
- "matvec-overlap": overlap for the matvec kernels only (the Triton kernels launched as before).
- "triton-overlap": overlap for the Triton kernels (add + norm, attention, SiLU·mul) only.
Prints ms per token.
"""

import argparse
import contextlib
import json

import bench_e2e_decode as bench
import torch

from quantkit.kernels import overlap
from quantkit.runtime import fusion

OFF = {"_restated_attention": lambda forward: None, "_accumulating_projections": lambda mlp: None,
       "_returns_o_proj_output": lambda forward: False, "_static_rotary": lambda module: False}
VARIANTS = {"all": (), "separate-attention": ("_restated_attention",), "eager-angles": ("_static_rotary",),
            "no-sums": ("_restated_attention", "_accumulating_projections", "_returns_o_proj_output"),
            "mlp-sums": ("_restated_attention", "_returns_o_proj_output"), "no-overlap": (), "matvec-overlap": (),
            "triton-overlap": ()}


@contextlib.contextmanager
def overlap_variant(variant):
    """kernels/overlap.py as the variant wants it while the decode step is captured."""
    if variant == "no-overlap":
        with overlap.disabled():
            yield
        return
    saved = overlap.enabled, overlap.triton_launch
    if variant == "matvec-overlap":
        overlap.triton_launch = lambda device: {"GDC": False}
    elif variant == "triton-overlap":
        triton_kwargs = overlap.triton_launch(torch.device("cuda"))  # decided while overlap is on
        overlap.triton_launch = lambda device: triton_kwargs
        overlap.enabled = lambda: False
    try:
        yield
    finally:
        overlap.enabled, overlap.triton_launch = saved


def set_variant(variant, originals):
    for name, original in originals.items():
        setattr(fusion, name, OFF[name] if name in VARIANTS[variant] else original)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp16,bcq-q3-g128,bcq-q4-g128")
    ap.add_argument("--variants", default="all,separate-attention")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    run_args = argparse.Namespace(gen=[args.gen], repeats=2, no_graph=False, no_share=True, include_reference=False,
                                  seed=0, layers=32, prompt_len=128)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if {"no-overlap", "matvec-overlap", "triton-overlap"} & set(variants) and not overlap.for_device("cuda"):
        ap.error("the overlap variants need overlap on (QUANTKIT_OVERLAP unset) and a GPU of compute capability 9.0+")
    originals = {name: getattr(fusion, name) for name in OFF}
    torch.manual_seed(0)
    model = bench.build_model(32)
    dense = bench.decoder_linears(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    formats = args.formats.split(",")
    results = []
    try:
        for family in dict.fromkeys(bench.family_of(f) for f in formats):
            modules = (list(dense.values()) if family == "fp16"
                       else list(bench.install(model, dense, family, 0).values()))
            for fmt in (f for f in formats if bench.family_of(f) == family):
                for variant in variants * 2:
                    set_variant(variant, originals)
                    fusion.fuse_pointwise(model)
                    before = len(results)
                    with overlap_variant(variant):
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
        print(f"{fmt:16s} {variant:18s} " + " ".join(f"{m:.4f}" for m in ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
