"""A quantkit artifact exported to compressed-tensors and loaded by transformers itself scores the same
perplexity as the artifact under quantkit: the export is lossless end to end.

  python benchmarks/export_ppl_check.py --model smollm2 --out out/export-check --json results.json

Quantizes the model with GPTQ w4g64 symmetric (the preset's other settings: act-order, static groups,
clip search; 128 x 2048 C4 windows), evaluates the artifact with quantkit, exports it with `quantkit
export --to compressed-tensors`, loads the export with AutoModelForCausalLM.from_pretrained (no
quantkit import before it: transformers' compressed-tensors integration decodes it) and evaluates it on
the same WikiText-2 windows with the same perplexity code. Prints both and the relative difference.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(*args):
    subprocess.run([sys.executable, "-m", "quantkit", *args], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, default=Path("out/export-check"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    artifact, export = args.out / "gptq-w4g64-sym", args.out / "gptq-w4g64-sym-ct"
    run("quantize", "--model", args.model, "--preset", "configs/gptq-w4g128.yaml", "--group-size", "64", "--sym",
        "--device", args.device, "--out", str(artifact), "--overwrite")
    run("export", str(artifact), "--to", "compressed-tensors", "--out", str(export), "--overwrite")
    window_args = [] if args.max_windows is None else ["--max-windows", str(args.max_windows)]
    run("eval", "ppl", "--model", str(artifact), "--dataset", "wikitext2", "--device", args.device, "--dtype",
        args.dtype, "--json", str(args.out / "quantkit.json"), *window_args)
    ours = json.loads((args.out / "quantkit.json").read_text())["results"][0]

    # transformers alone, in a fresh process that never imports quantkit before loading the export
    code = f"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained({str(export)!r}, dtype=getattr(torch, {args.dtype!r}),
                                             device_map={args.device!r}).eval()
load_s = time.perf_counter() - start
layer = type(model.model.layers[0].self_attn.q_proj)
tokenizer = AutoTokenizer.from_pretrained({str(export)!r})
from quantkit.data import eval_tokens
from quantkit.eval.perplexity import perplexity
ids, protocol = eval_tokens("wikitext2", tokenizer, 2048, None)
print(json.dumps({{"layer": f"{{layer.__module__}}.{{layer.__name__}}", "load_s": load_s,
                  **perplexity(model, ids, 2048, {args.max_windows!r}, {args.device!r}, progress=False)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    relative = abs(theirs["ppl"] - ours["ppl"]) / ours["ppl"]
    print(f"quantkit eval ppl on the artifact: {ours['ppl']:.4f} ({ours['windows']} windows)")
    print(f"transformers on the compressed-tensors export: {theirs['ppl']:.4f} (linears: {theirs['layer']})")
    print(f"relative difference: {100 * relative:.4f} % (goal <= 0.1 %)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"quantkit": ours, "transformers_compressed_tensors": theirs,
                                         "relative_difference": relative, "dtype": args.dtype,
                                         "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
