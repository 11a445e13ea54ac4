"""End-to-end decode speed of `quantkit generate`'s fast decoder, Llama-2-7B shapes: fp16 against quantized formats.

  python benchmarks/bench_e2e_decode.py --json $OUT/e2e.json     # every format, batch 1 and 8, 128 and 1024 tokens
  python benchmarks/bench_e2e_decode.py --quick                  # 6 formats, one timed run each

The model is runtime.model's Decoder built from Llama-2-7B's config (hidden 4096, intermediate 11008, 32
layers and heads, vocab 32000) by runtime.weights.build_decoder, the loader `quantkit generate` uses, from
random tensors made on the GPU (speed does not depend on the values; no download):
  fp16         random fp16 weights (q/k/v and gate/up stacked as for any model), projections on the split-K
               matvec (runtime/dense_matvec.py) as the decoder serves them
  fp16-cublas  the same model with its projections on cuBLAS (the speedups stay over "fp16")
  bcq-q3/q4    random sign planes and α, groups of 128, no offset (LUT-GEMM's format)
  gptq4        random uniform 4-bit codes, fp16 scales and 4-bit zero points, groups of 128: the layout of a
               GPTQ-4 / RTN-4 artifact, which the loader converts to BCQ on the GPU for the LUT kernels, the
               fastest kernel serving uniform 4-bit today
  anyprec-k    one random 8-bit parent (random codes, sorted random tables for 3..8 bits), served at k = 3..8
               through Decoder.set_bits on the same model
Decoding is runtime.generate.FastGenerator.run, the code `quantkit generate` runs: B random prompts of
--prompt-len tokens, prefill, then each decode step one CUDA-graph replay (captured once per shape, untimed,
by FastGenerator.prepare), greedy, no stop tokens; --repeats timed runs (--repeats-long from 512 tokens).
ms/token = decode time / decode steps (prefill apart), host
clock between synchronisations; tokens/s = B × 1000 / (ms/token). Speedup = fp16 ms/token / format ms/token
at the same batch and length, fp16 measured in the same process.

Also reported:
  GB/s     bytes a decode step reads (projections as served, head, norms, the rows' embedding rows, and the
           KV cache up to each row's position: prompt + gen/2 on average) / step time; for fp16, its
           fraction of the card's streaming rate, measured here: the larger of a 2 GiB device copy
           ((read + write) / time) and an fp16 matvec over a 1 GiB weight (weight bytes / time)
  outside  share of the step outside the 224 decoder projections: the same step captured with every
           projection answering from a preallocated buffer (no kernel) / the real step, at the first length
"""

import argparse
import contextlib
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.formats.bcq import BCQQuantizedTensor
from quantkit.formats.packing import pack_rows
from quantkit.formats.uniform import UniformQuantizedTensor
from quantkit.kernels import lutgemm
from quantkit.runtime import dense_matvec, ops
from quantkit.runtime.generate import FastGenerator
from quantkit.runtime.model import DecoderConfig
from quantkit.runtime.quant_linear import QuantLinear
from quantkit.runtime.weights import GROUPS, build_decoder

LLAMA2_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5}
FORMATS = ["fp16", "fp16-cublas", "bcq-q3-g128", "bcq-q4-g128", "gptq4-g128"] + [f"anyprec-{k}" for k in range(3, 9)]
QUICK_FORMATS = ["fp16", "fp16-cublas", "bcq-q3-g128", "bcq-q4-g128", "gptq4-g128", "anyprec-3", "anyprec-4"]
# speedup over fp16 at batch 1 (and the fp16 step's fraction of the streaming rate), by card
GOALS = {"H100": {"bcq-q3-g128": 3.2, "bcq-q4-g128": 2.7, "gptq4-g128": 2.7, "anyprec-3": 2.8},
         "H200": {"bcq-q3-g128": 2.7, "bcq-q4-g128": 2.3, "anyprec-3": 2.4}}
FP16_STREAM_GOAL = 0.8
GROUP = 128
ANYPREC_SEED, ANYPREC_PARENT = 3, 8
LONG = 512  # generations of this many tokens or more are timed --repeats-long times
LINEARS = [name for names in GROUPS.values() for name in names]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --- random weights in each format ---------------------------------------------------------------------


def _shape(cfg, name):
    """(out_features, in_features) of a Llama linear."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i)}
    return shapes[name.split(".")[-1]]


def _ints(shape, gen):
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=gen)


def random_weight(family, k, d, gen):
    """A random weight [k, d] of `family` on the GPU: an fp16 tensor or a QuantizedTensor."""
    groups = math.ceil(d / GROUP)
    if family == "fp16":
        return 0.02 * torch.randn(k, d, device="cuda", dtype=torch.float16, generator=gen)
    if family.startswith("bcq-q"):
        bits = int(family[5])
        alpha = 0.02 * torch.rand(groups, bits, k, device="cuda", generator=gen).add_(0.5)
        alpha = alpha * torch.exp2(-torch.arange(bits, device="cuda", dtype=torch.float32)).view(1, -1, 1)
        return BCQQuantizedTensor(qweight=_ints((bits, d // 32, k), gen), alpha=alpha.half(), offset=None, bits=bits,
                                  group_size=GROUP, in_features=d)
    if family == "gptq4-g128":
        zeros = torch.randint(0, 16, (groups, k), device="cuda", generator=gen)
        scales = (0.003 * torch.rand(k, groups, device="cuda", generator=gen) + 1e-3).half()
        return UniformQuantizedTensor(qweight=_ints((k, d * 4 // 32), gen), scales=scales, qzeros=pack_rows(zeros, 4),
                                      bits=4, group_size=GROUP, in_features=d, sym=False)
    if family == "anyprec":
        luts = {b: (0.02 * torch.randn(k, 2**b, device="cuda", generator=gen)).sort(dim=1).values.half()
                for b in range(ANYPREC_SEED, ANYPREC_PARENT + 1)}
        return AnyPrecisionTensor(planes=_ints((ANYPREC_PARENT, k, d // 32), gen), luts=luts, seed_bits=ANYPREC_SEED,
                                  parent_bits=ANYPREC_PARENT, in_features=d)
    raise ValueError(family)


def build_model(cfg, family, seed):
    """The fast Decoder of `family` with random weights, through the loader `quantkit generate` uses."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = cfg.hidden_size
    floats = {"model.embed_tokens.weight": random_weight("fp16", cfg.vocab_size, h, gen),
              "model.norm.weight": torch.ones(h, device="cuda", dtype=torch.float16),
              "lm_head.weight": random_weight("fp16", cfg.vocab_size, h, gen)}
    quantized = {}
    for i in range(cfg.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            floats[f"model.layers.{i}.{norm}.weight"] = torch.ones(h, device="cuda", dtype=torch.float16)
        for name in LINEARS:
            full = f"model.layers.{i}.{name}"
            weight = random_weight(family, *_shape(cfg, name), gen)
            if isinstance(weight, torch.Tensor):
                floats[f"{full}.weight"] = weight
            else:
                quantized[full] = weight
    return build_decoder(cfg, floats, quantized, device="cuda", dtype=torch.float16, where="random Llama-2-7B")


def family_of(fmt):
    return "anyprec" if fmt.startswith("anyprec-") else "fp16" if fmt.startswith("fp16") else fmt


# --- bytes and rates -----------------------------------------------------------------------------------


def projections(model):
    return [m for layer in model.layers for m in (layer.wqkv, layer.wo, layer.w13, layer.w2)]


def projection_bytes(model, batch):
    """Bytes the decoder projections read per step of `batch` rows, as served (any-precision: the served planes
    and table; BCQ with power-of-two planes, up to lutgemm.COMPACT_ALPHA_MAX_TOKENS rows: plane 0's α only)."""
    total = 0
    for m in projections(model):
        if isinstance(m, QuantLinear):
            qt = m.qtensor()
            if m.meta["format"] == "anyprec":
                total += qt.bits_read(m.bits) * m.in_features * m.out_features / 8
                continue
            total += qt.stored_bits() / 8
            if (m.meta["format"] == "bcq" and batch <= lutgemm.COMPACT_ALPHA_MAX_TOKENS
                    and lutgemm.power_of_two_planes(m.alpha) is not None):
                total -= m.alpha.numel() * m.alpha.element_size() * (m.alpha.shape[1] - 1) / m.alpha.shape[1]
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total


def step_bytes(model, batch, mean_positions):
    cfg = model.cfg
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2
    head = model.lm_head.numel() * 2
    embed_rows = batch * cfg.hidden_size * 2
    kv = cfg.num_layers * 2 * batch * cfg.num_kv_heads * cfg.head_dim * mean_positions * 2
    return projection_bytes(model, batch) + norms + head + embed_rows + kv


def _timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def copy_rate():
    """GB/s of a 2 GiB device copy, counting read + write."""
    src = torch.ones(2**30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / _timed(lambda: dst.copy_(src)) / 1e9


def streaming_rates():
    """(copy GB/s counting read + write, fp16 matvec GB/s of weight bytes) on this card."""

    def matvec_rate():
        weight = torch.randn(32768, 16384, device="cuda", dtype=torch.float16)  # 1 GiB
        x = torch.randn(1, 16384, device="cuda", dtype=torch.float16)
        return weight.numel() * 2 / _timed(lambda: torch.nn.functional.linear(x, weight)) / 1e9

    rates = copy_rate(), matvec_rate()
    torch.cuda.empty_cache()
    return rates


# --- timing --------------------------------------------------------------------------------------------


def prompts_for(batch, length, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def time_decode(generator, prompts, gen, repeats):
    """The step's graph captured first (untimed, FastGenerator.prepare); then `repeats` timed runs, median
    ms/token. (The first replay of a graph also uploads it: well under 1 ms, in the first timed run.)"""
    start = time.perf_counter()
    generator.prepare(len(prompts), len(prompts[0]), gen)
    capture_s = time.perf_counter() - start
    runs = [generator.run(prompts, gen) for _ in range(repeats)]
    ms = statistics.median(r["ms_per_token"] for r in runs)
    return {"ms_per_token": ms, "tokens_per_s": len(prompts) * 1000 / ms,
            "prefill_ms": statistics.median(r["prefill_ms"] for r in runs), "capture_s": capture_s,
            "runs_ms_per_token": [r["ms_per_token"] for r in runs], "cuda_graph": all(r["cuda_graph"] for r in runs),
            "same_tokens_in_every_run": all(r["token_ids"] == runs[0]["token_ids"] for r in runs),
            "tokens_digest": hashlib.sha1(repr(runs[0]["token_ids"]).encode()).hexdigest()[:12]}


def stubbed_step_ms(model, prompts, gen, repeats):
    """ms/token of the same generation with every decoder projection answering from one preallocated buffer
    (a view: no kernel) and leaving no sums: the step outside the projections."""
    rows = len(prompts) * len(prompts[0])
    widest = max(m.out_features for m in projections(model))
    buffer = torch.zeros(rows * widest, dtype=model.dtype, device="cuda")
    project, project_sums = ops.project, ops.project_sums
    ops.project = lambda module, x: buffer[: x.numel() // x.shape[-1] * module.out_features].view(
        *x.shape[:-1], module.out_features)
    ops.project_sums = lambda module, x: None
    try:
        return time_decode(FastGenerator(model), prompts, gen, repeats)["ms_per_token"]
    finally:
        ops.project, ops.project_sums = project, project_sums


def run_format(fmt, model, args, results, vocab):
    """Time `fmt` on `model` (fp16-cublas: the fp16 model with its projections on cuBLAS instead of the split-K
    matvec, captured so)."""
    with dense_matvec.disabled() if fmt == "fp16-cublas" else contextlib.nullcontext():
        _run_format(fmt, model, args, results, vocab)


def _run_format(fmt, model, args, results, vocab):
    bits = int(fmt.split("-")[1]) if fmt.startswith("anyprec-") else None
    if bits is not None:
        model.set_bits(bits)
    numel = sum(m.in_features * m.out_features for m in projections(model))
    for batch in args.batches:
        bits_per_weight = 8 * projection_bytes(model, batch) / numel
        generator = FastGenerator(model)
        for i, gen in enumerate(args.gen):
            prompts = prompts_for(batch, args.prompt_len, vocab, args.seed + batch)
            torch.cuda.reset_peak_memory_stats()
            repeats = args.repeats if gen < LONG else args.repeats_long
            row = {"format": fmt, "batch": batch, "gen_tokens": gen, "served_bits": bits, "repeats": repeats,
                   "linear_bits_per_weight": bits_per_weight, **time_decode(generator, prompts, gen, repeats)}
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            row["gb_per_s"] = step_bytes(model, batch, args.prompt_len + gen / 2) / (row["ms_per_token"] / 1000) / 1e9
            if i == 0 and not args.no_share:
                row["outside_ms"] = stubbed_step_ms(model, prompts, gen, 1)
                row["outside_share"] = row["outside_ms"] / row["ms_per_token"]
            results.append(row)
            log(f"  {fmt} batch {batch} gen {gen}: {row['ms_per_token']:.3f} ms/token, {row['tokens_per_s']:.1f} "
                f"tokens/s" + ("" if row["cuda_graph"] else "  (NO CUDA graph)"))
        del generator
        torch.cuda.empty_cache()


# --- report --------------------------------------------------------------------------------------------


def add_ratios(results, stream_rate):
    base = {(r["batch"], r["gen_tokens"]): r["ms_per_token"] for r in results if r["format"] == "fp16"}
    for r in results:
        key = (r["batch"], r["gen_tokens"])
        if key in base:
            r["speedup"] = base[key] / r["ms_per_token"]
        if family_of(r["format"]) == "fp16":
            r["stream_fraction"] = r["gb_per_s"] / stream_rate


def table(results):
    cols = ["format", "bits/w", "batch", "gen", "ms/token", "tokens/s", "speedup", "prefill ms", "GB/s", "of stream",
            "outside", "graph", "peak GB"]
    rows = []
    for r in results:
        share = r.get("outside_share")
        rows.append([r["format"], f"{r['linear_bits_per_weight']:.3f}", str(r["batch"]), str(r["gen_tokens"]),
                     f"{r['ms_per_token']:.3f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['speedup']:.2f}x" if "speedup" in r else "-", f"{r['prefill_ms']:.1f}",
                     f"{r['gb_per_s']:.0f}", f"{r['stream_fraction']:.1%}" if "stream_fraction" in r else "-",
                     "-" if share is None else f"{share:.1%}", "yes" if r["cuda_graph"] else "NO",
                     f"{r['peak_gb']:.1f}"])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows])


def goal_lines(results, device_name):
    card = "H200" if "H200" in device_name else "H100"
    lines = []
    for r in results:
        if r["batch"] != 1:
            continue
        goal = GOALS[card].get(r["format"])
        if goal is not None and "speedup" in r:
            verdict = "met" if r["speedup"] >= goal else "MISSED"
            lines.append(f"goal ({card}) {r['format']} >= {goal}x fp16, batch 1, {r['gen_tokens']} tokens: "
                         f"{r['speedup']:.2f}x {verdict}")
        if r["format"] == "fp16":
            verdict = "met" if r["stream_fraction"] >= FP16_STREAM_GOAL else "MISSED"
            lines.append(f"goal fp16 >= {FP16_STREAM_GOAL:.0%} of the streaming rate, {r['gen_tokens']} tokens: "
                         f"{r['stream_fraction']:.1%} {verdict}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"formats {','.join(QUICK_FORMATS)}, 1 timed run each")
    ap.add_argument("--formats", default=None, help=f"comma list from {','.join(FORMATS)} [all]")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes [%(default)s]")
    ap.add_argument("--gen", default="128,1024", help="comma list of generated token counts [%(default)s]")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per case, median reported [2; quick 1]")
    ap.add_argument("--repeats-long", type=int, default=1,
                    help=f"timed runs per case of {LONG} or more generated tokens [%(default)s]")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers [32, as Llama-2-7B]")
    ap.add_argument("--no-share", action="store_true", help="skip the step timing with the projections stubbed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    formats = args.formats.split(",") if args.formats else (QUICK_FORMATS if args.quick else FORMATS)
    unknown = [f for f in formats if f not in FORMATS]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.gen = [int(g) for g in args.gen.split(",")]
    args.repeats = args.repeats or (1 if args.quick else 2)
    if unknown or min(args.gen) < 2:
        raise SystemExit(f"unknown formats {unknown}" if unknown else "--gen values must be at least 2")
    from transformers import LlamaConfig

    cfg = DecoderConfig.from_transformers(LlamaConfig(**{**LLAMA2_7B, "num_hidden_layers": args.layers or 32}))
    started = time.perf_counter()
    device = torch.cuda.get_device_name()
    copy_rate, matvec_rate = streaming_rates()
    stream_rate = max(copy_rate, matvec_rate)
    log(f"streaming: copy {copy_rate:.0f} GB/s (read + write), fp16 matvec {matvec_rate:.0f} GB/s")
    results = []

    def write(complete):  # after every format: a run cut short still leaves its numbers
        if args.json:
            add_ratios(results, stream_rate)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({
                "device": device, "torch": torch.__version__,
                "config": {**LLAMA2_7B, "num_hidden_layers": cfg.num_layers}, "prompt_len": args.prompt_len,
                "batches": args.batches, "gen": args.gen, "repeats": args.repeats, "repeats_long": args.repeats_long,
                "group_size": GROUP, "anyprec": {"seed_bits": ANYPREC_SEED, "parent_bits": ANYPREC_PARENT},
                "streaming_gb_per_s": {"copy": copy_rate, "matvec": matvec_rate, "used": stream_rate},
                "seconds": round(time.perf_counter() - started, 1), "complete": complete, "results": results,
                "goals": goal_lines(results, device)}, indent=2))

    for family in dict.fromkeys(family_of(f) for f in formats):
        t0 = time.perf_counter()
        model = build_model(cfg, family, args.seed)
        log(f"{family}: built in {time.perf_counter() - t0:.1f} s")
        for fmt in (f for f in formats if family_of(f) == family):
            run_format(fmt, model, args, results, cfg.vocab_size)
            write(complete=False)
        del model
        torch.cuda.empty_cache()
    add_ratios(results, stream_rate)
    print(f"{device}, torch {torch.__version__}; Llama-2-7B shapes, {cfg.num_layers} layers, prompt {args.prompt_len}, "
          f"greedy, fast decoder (runtime.generate.FastGenerator), one CUDA graph per step; streaming rate "
          f"{stream_rate:.0f} GB/s (copy {copy_rate:.0f}, matvec {matvec_rate:.0f})")
    print(table(results))
    for line in goal_lines(results, device):
        print(line)
    print(f"total {time.perf_counter() - started:.0f} s")
    write(complete=True)

if __name__ == "__main__":
    main()
