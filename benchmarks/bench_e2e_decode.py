"""End-to-end greedy decode speed, batch 1, of a Llama-2-7B-shaped model: fp16 vs quantized linears.

  python benchmarks/bench_e2e_decode.py --json $OUT/e2e.json        # full: 32 layers, 128 + 1024 tokens, ~6 min
  python benchmarks/bench_e2e_decode.py --quick                     # 8 layers, 32 + 128 tokens, fewer formats

The model is built on the GPU from Llama-2-7B's config (hidden 4096, intermediate 11008, 32 layers and
heads, vocab 32000) with transformers' random init (no download). Its 224 decoder linears are then
replaced, in place, by QuantLinear modules built without calibration, one format at a time (speed does
not depend on the values):
  bcq-q3/q4-g128   random sign planes and α (LUT-GEMM's format, no offset)
  gptq4-bcq-g128   RTN 4-bit g128 of the random weights, converted to BCQ (with its offset, rounded to fp16): the
                   bytes and kernel of a GPTQ-4 artifact converted to BCQ (GPTQ only changes the values)
  anyprec-k        one random 8-bit parent (random codes, random sorted tables for 3..8 bits), served
                   at k = 3..8 through QuantLinear.set_bits on the same modules
Decoding: prompt of 128 random tokens, prefill, then greedy decode steps from a transformers
StaticCache, each step one CUDA-graph replay (quantkit.runtime.generate.StaticGreedyDecoder): no
Python between kernels, the next token chosen on the GPU. Timed with CUDA events; ms/token is decode
only (prefill apart), tokens/s = 1000 / (ms/token); e2e tokens/s also counts the prefill. Checked: the
graph's first tokens equal eager decoding's. Share of the linears: 1 - (the same graph step with the 224
decoder linears answering from a preallocated buffer, no kernel) / (the real step); the part outside
them is attention, norms, RoPE, residuals, the head. Fusion "pointwise" (runtime.fusion) compiles the
RMSNorms, the rotary embedding and SiLU*mul into one kernel each, adds each residual in the kernel of
the norm after it, and with split attention rotates q/k inside the attention kernel; "full" also stacks
q/k/v and gate/up into one linear each (one launch over the stacked rows). Attention "split" (the default)
attends in decode
steps with runtime.decode_attention (the cache split over many programs, positions past the current one
not read; the kernel also writes the step's key and value into the cache), "sdpa" with transformers'
SDPA over the whole masked cache.
On Hopper every kernel of a fused layer (matvecs, add + norm, attention, SiLU·mul) launches with
programmatic dependent launch (quantkit.kernels.overlap; QUANTKIT_OVERLAP=0 turns it off); cuBLAS does not.
Fusion and attention apply to fp16 and every format alike, and speedups compare formats at the same
fusion and attention.
GB/s: bytes a decode step must read (linears as served, lm_head, norms, and the KV cache: all max_len
positions under SDPA, which reads them masked, the positions up to the current one under split
attention) / step time.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.formats.bcq import BCQQuantizedTensor, bcq_from_uniform
from quantkit.kernels.dispatch import kernel_forward
from quantkit.methods import make_method
from quantkit.runtime import QuantLinear
from quantkit.runtime.fusion import fuse_pointwise, fuse_projections, unfuse_pointwise
from quantkit.runtime.generate import StaticGreedyDecoder

LLAMA2_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096}
FORMATS = ["fp16", "bcq-q3-g128", "bcq-q4-g128", "gptq4-bcq-g128"] + [f"anyprec-{k}" for k in range(3, 9)]
QUICK_FORMATS = ["fp16", "bcq-q3-g128", "bcq-q4-g128", "gptq4-bcq-g128", "anyprec-3", "anyprec-4", "anyprec-8"]
# the goals (RESULTS.md, end-to-end decode): tokens/s over fp16 for 128 generated tokens
GOALS = {"bcq-q3-g128": 2.5, "anyprec-3": 2.5, "bcq-q4-g128": 2.0, "gptq4-bcq-g128": 2.0, "anyprec-4": 2.0}
GROUP = 128
ANYPREC_SEED, ANYPREC_PARENT = 3, 8
CHECK_TOKENS = 16  # graph vs eager tokens compared


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --- model and formats -----------------------------------------------------------------------------


def build_model(layers):
    """Llama-2-7B shapes with `layers` decoder layers, fp16 on the GPU, transformers' random init there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA2_7B, "num_hidden_layers": layers})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # built in fp16 directly: no 27 GB fp32 detour
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def decoder_linears(model):
    """{name: module} of the decoder layers' linears, float or QuantLinear (what quantization replaces,
    and what a decode step runs; lm_head stays fp16)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, QuantLinear)) and ".layers." in n}


def random_bcq(k, d, bits, gen):
    words, groups = d // 32, math.ceil(d / GROUP)
    planes = torch.randint(-(2**31), 2**31 - 1, (bits, words, k), dtype=torch.int32, device="cuda", generator=gen)
    # α_1 > α_2 > ... as greedy BCQ gives; magnitudes like the 0.02-std weights
    alpha = 0.02 * torch.rand(groups, bits, k, device="cuda", generator=gen).add_(0.5)
    alpha = alpha * torch.exp2(-torch.arange(bits, device="cuda", dtype=torch.float32)).view(1, -1, 1)
    return BCQQuantizedTensor(qweight=planes, alpha=alpha.half(), offset=None, bits=bits, group_size=GROUP,
                              in_features=d)


def rtn_bcq(weight, bits):
    ut, _ = make_method("rtn", bits=bits, group_size=GROUP).quantize(weight.float(), None)
    return bcq_from_uniform(ut)


def random_anyprec(k, d, gen):
    planes = torch.randint(-(2**31), 2**31 - 1, (ANYPREC_PARENT, k, d // 32), dtype=torch.int32, device="cuda",
                           generator=gen)
    luts = {b: (0.02 * torch.randn(k, 2**b, device="cuda", generator=gen)).sort(dim=1).values.half()
            for b in range(ANYPREC_SEED, ANYPREC_PARENT + 1)}
    return AnyPrecisionTensor(planes=planes, luts=luts, seed_bits=ANYPREC_SEED, parent_bits=ANYPREC_PARENT,
                              in_features=d)


def make_qtensor(family, linear, gen):
    k, d = linear.weight.shape
    if d % 32:
        raise SystemExit(f"in_features {d} is not a multiple of 32: random planes would set padding bits")
    if family == "bcq-q3-g128":
        return random_bcq(k, d, 3, gen)
    if family == "bcq-q4-g128":
        return random_bcq(k, d, 4, gen)
    if family == "gptq4-bcq-g128":
        return rtn_bcq(linear.weight, 4)
    if family == "anyprec":
        return random_anyprec(k, d, gen)
    raise ValueError(family)


def install(model, dense, family, seed):
    """Replace every decoder linear by a QuantLinear of `family`; returns {name: QuantLinear}."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    quant = {}
    for name, linear in dense.items():
        # cache_weight=False: memory stays at the packed size (prefill dequantizes per call)
        quant[name] = QuantLinear(make_qtensor(family, linear, gen), None, compute_dtype=torch.float16,
                                  cache_weight=False)
        model.set_submodule(name, quant[name])
    return quant


def restore(model, dense):
    for name, linear in dense.items():
        model.set_submodule(name, linear)


def family_of(fmt):
    return "anyprec" if fmt.startswith("anyprec-") else fmt


# --- bytes read per decode step --------------------------------------------------------------------


def linear_bytes(modules):
    total = 0
    for m in modules:
        if isinstance(m, QuantLinear):
            qt = m.qtensor()
            if m.meta["format"] == "anyprec":
                total += qt.bits_read(m.bits) * m.in_features * m.out_features / 8
            else:
                total += qt.stored_bits() / 8
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total


def step_bytes(model, linears, cached_positions):
    """Bytes a decode step reads: linears as served, the rest of the weights it touches, the KV cache's
    `cached_positions` (the whole static cache under SDPA; the mean attended under split attention)."""
    cfg = model.config
    others = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if ".layers." not in n or "norm" in n)
    others -= model.model.embed_tokens.weight.numel() * 2  # a step reads one embedding row, not the table
    if model.config.tie_word_embeddings:
        others += model.model.embed_tokens.weight.numel() * 2
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * cached_positions * 2
    return linear_bytes(linears) + others + kv


# --- measurements ----------------------------------------------------------------------------------


def kernel_serves(modules):
    m = next(iter(modules))
    if not isinstance(m, QuantLinear):
        return True
    x = torch.randn(1, 1, m.in_features, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        return kernel_forward(m, x) is not None


def stub_forward(module, tokens):
    """A forward for `module` answering from a preallocated buffer (a view: no kernel), contiguous like a
    real output so compiled consumers (SiLU·mul) see the layouts they run on; up to `tokens` rows."""
    n = module.out_features
    buffer = torch.zeros(tokens * n, device="cuda", dtype=torch.float16)
    return lambda x: buffer[: x.shape[0] * x.shape[1] * n].view(x.shape[0], x.shape[1], n)


def captured_step_ms(model, prompt, max_len, steps, attention):
    """(ms per CUDA-graph decode step over `steps` replays after a prefill of `prompt`, the decoder)."""
    decoder = StaticGreedyDecoder(model, max_len=max_len, attention=attention)
    decoder.prefill(prompt)
    decoder.capture()
    decoder.prefill(prompt)
    decoder.steps(4)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    decoder.steps(steps)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps, decoder


def linear_free_ms(model, modules, prompt, max_len, steps, attention):
    """ms per CUDA-graph decode step with every module of `modules` stubbed (stub_forward), the rest of
    the step unchanged: the time a step spends outside those linears."""
    for m in modules:
        m.forward = stub_forward(m, prompt.numel())
        if isinstance(m, QuantLinear):
            m.accumulate = lambda x: None  # fused layers then call the stub instead of the kernel's sums
    try:
        return captured_step_ms(model, prompt, max_len, steps, attention)[0]
    finally:
        for m in modules:
            del m.forward  # back to the class's forward
            m.__dict__.pop("accumulate", None)


def time_decode(model, prompt, gen, repeats, use_graph, attention, share_modules=None):
    """One format, one generation length: check, capture, timed runs, optional linear-free step."""
    out = {"gen_tokens": gen}
    decoder = StaticGreedyDecoder(model, max_len=prompt.shape[1] + gen, attention=attention)
    check = min(CHECK_TOKENS, gen)
    eager = decoder.generate(prompt, check)  # also the kernels' first use, outside any capture
    if use_graph:
        start = time.perf_counter()
        try:
            decoder.capture()
            out["capture_s"] = round(time.perf_counter() - start, 3)
        except Exception as exc:  # fall back to eager steps and say so
            decoder.graph = None
            out["graph_error"] = f"{type(exc).__name__}: {exc}"
    out["cuda_graph"] = decoder.graph is not None
    decoder.prefill(prompt)
    decoder.steps(min(8, gen - 1))  # first replays (graph upload) untimed
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        first = decoder.prefill(prompt)
        marks[1].record()
        rest = decoder.steps(gen - 1)
        marks[2].record()
        marks[2].synchronize()
        runs.append((marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])))
        tokens = torch.cat([first, rest], dim=1)
    prefill_ms = statistics.median(r[0] for r in runs)
    decode_ms = statistics.median(r[1] for r in runs)
    ms_token = decode_ms / (gen - 1)
    out.update(prefill_ms=prefill_ms, decode_ms=decode_ms, ms_per_token=ms_token, tokens_per_s=1000 / ms_token,
               e2e_tokens_per_s=1000 * gen / (prefill_ms + decode_ms), runs_ms=runs,
               graph_eager_agreement=(tokens[:, :check] == eager).float().mean().item(),
               max_len=decoder.max_len, split_attention=decoder.split_attention)
    del decoder
    if share_modules is not None and out["cuda_graph"]:
        out["linear_free_ms"] = linear_free_ms(model, share_modules, prompt, out["max_len"], gen - 6, attention)
        out["linear_share"] = 1 - out["linear_free_ms"] / ms_token
    return out


def run_format(fmt, fusion, attention, model, modules, prompt, args, results):
    start = time.perf_counter()
    serves = kernel_serves(modules)  # the first probe of a format builds its extension (minutes, once)
    if time.perf_counter() - start > 5:
        log(f"  kernel probe (first use: build) took {time.perf_counter() - start:.0f} s")
    bits = None
    if fmt.startswith("anyprec-"):
        bits = int(fmt.split("-")[1])
        for m in modules:
            m.set_bits(bits)
    stacking = fuse_projections(model) if fusion == "full" else None  # after set_bits: stacks copy the bit-width
    try:
        in_use = list(decoder_linears(model).values())  # the stacked modules instead of q/k/v, gate/up when fused
        _run_lengths(fmt, fusion, attention, bits, model, modules, in_use, prompt, args, results, serves)
    finally:
        if stacking is not None:
            stacking.undo()


def _run_lengths(fmt, fusion, attention, bits, model, modules, in_use, prompt, args, results, serves):
    """Every generation length of one format and fusion; bytes and bits/w count the unstacked `modules`."""
    linears_read = linear_bytes(modules)
    numel = sum(m.in_features * m.out_features for m in modules)
    for i, gen in enumerate(args.gen):
        if not serves and not args.include_reference:
            log(f"  {fmt}: no CUDA kernel serves it; skipped (--include-reference times the PyTorch path)")
            results.append({"format": fmt, "fusion": fusion, "attention": attention, "gen_tokens": gen,
                            "skipped": "no kernel"})
            continue
        torch.cuda.reset_peak_memory_stats()
        row = time_decode(model, prompt, gen, args.repeats, not args.no_graph, attention,
                          share_modules=in_use if i == 0 and not args.no_share else None)
        row.update(format=fmt, fusion=fusion, attention=attention, served_bits=bits, kernel=serves,
                   linear_bits_per_weight=8 * linears_read / numel, peak_gb=torch.cuda.max_memory_allocated() / 1e9)
        # split attention reads positions 0..current only: prompt + gen / 2 of them on average
        cached = (prompt.shape[1] + gen / 2) if row["split_attention"] else row["max_len"]
        row["gb_per_s"] = step_bytes(model, modules, cached) / (row["ms_per_token"] / 1000) / 1e9
        results.append(row)
        log(f"  {fmt} ({fusion}, {attention}) gen {gen}: {row['ms_per_token']:.3f} ms/token, "
            f"{row['tokens_per_s']:.1f} tokens/s"
            + ("" if row["cuda_graph"] else "  (eager: " + row.get("graph_error", "--no-graph") + ")"))
        torch.cuda.empty_cache()


# --- report ----------------------------------------------------------------------------------------


def add_speedups(results):
    """Speedup over fp16 with the same fusion, attention and generation length."""
    base = {(r["fusion"], r["attention"], r["gen_tokens"]): r["tokens_per_s"] for r in results
            if r["format"] == "fp16" and "tokens_per_s" in r}
    for r in results:
        key = (r["fusion"], r["attention"], r["gen_tokens"])
        if "tokens_per_s" in r and key in base:
            r["speedup"] = r["tokens_per_s"] / base[key]


def table(results):
    cols = ["format", "fusion", "attention", "bits/w", "gen", "ms/token", "tokens/s", "speedup", "e2e tok/s",
            "prefill ms", "GB/s", "linear share", "graph", "graph=eager", "peak GB"]
    rows = []
    for r in results:
        if "skipped" in r:
            rows.append([r["format"], r["fusion"], r["attention"], "-", str(r["gen_tokens"]),
                         f"skipped: {r['skipped']}"] + ["-"] * 9)
            continue
        share = r.get("linear_share")
        attention = r["attention"] if r["split_attention"] or r["attention"] == "sdpa" else "sdpa (no Triton)"
        rows.append([r["format"], r["fusion"], attention, f"{r['linear_bits_per_weight']:.3f}", str(r["gen_tokens"]),
                     f"{r['ms_per_token']:.3f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['speedup']:.2f}x" if "speedup" in r else "-", f"{r['e2e_tokens_per_s']:.1f}",
                     f"{r['prefill_ms']:.1f}", f"{r['gb_per_s']:.0f}", "-" if share is None else f"{share:.1%}",
                     "yes" if r["cuda_graph"] else "NO", f"{r['graph_eager_agreement']:.2f}", f"{r['peak_gb']:.1f}"])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def goal_lines(results, gen, fusions, attentions):
    lines = []
    for fusion in fusions:
        for attention in attentions:
            for fmt, goal in GOALS.items():
                row = next((r for r in results if r["format"] == fmt and r["fusion"] == fusion
                            and r["attention"] == attention and r["gen_tokens"] == gen and "speedup" in r), None)
                if row is not None:
                    verdict = "met" if row["speedup"] >= goal else "MISSED"
                    lines.append(f"goal {fmt} >= {goal}x fp16 at {gen} tokens ({fusion}, {attention}): "
                                 f"{row['speedup']:.2f}x {verdict}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 layers, 32 + 128 tokens, 7 formats, 1 repeat")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers [32; quick 8]")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", default=None, help="comma list of generated token counts [128,1024; quick 32,128]")
    ap.add_argument("--formats", default=None, help=f"comma list from {','.join(FORMATS)}")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per length, median reported [2; quick 1]")
    ap.add_argument("--no-graph", action="store_true", help="time eager decode steps (shows Python overhead)")
    ap.add_argument("--no-share", action="store_true", help="skip the linear-free step timing (linear share)")
    ap.add_argument("--fusion", default="none,pointwise,full",
                    help="comma list of: none; pointwise (RMSNorm, rotary and SiLU*mul compiled, residual adds in the "
                         "norms' kernels); full (pointwise, "
                         "and q/k/v and gate/up stacked into one linear each); runtime.fusion, applied to fp16 and "
                         "every format alike [%(default)s]")
    ap.add_argument("--attention", default="split",
                    help="comma list of: split (runtime.decode_attention in decode steps, which also writes "
                         "the cache; SDPA where Triton is missing); sdpa (transformers' SDPA over the masked "
                         "static cache) [%(default)s]")
    ap.add_argument("--include-reference", action="store_true",
                    help="also time formats no kernel serves (PyTorch dequantize per call: slow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    args.layers = args.layers or (8 if args.quick else 32)
    args.gen = [int(g) for g in (args.gen or ("32,128" if args.quick else "128,1024")).split(",")]
    args.repeats = args.repeats or (1 if args.quick else 2)
    formats = args.formats.split(",") if args.formats else (QUICK_FORMATS if args.quick else FORMATS)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or min(args.gen) < 2:
        raise SystemExit(f"unknown formats {unknown}" if unknown else "--gen values must be at least 2")

    torch.manual_seed(args.seed)
    started = time.perf_counter()
    model = build_model(args.layers)
    dense = decoder_linears(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(args.seed))
    log(f"model: {args.layers} layers, {len(dense)} linears, built in {time.perf_counter() - started:.1f} s")
    results = []
    fusions = args.fusion.split(",")
    if not fusions or set(fusions) - {"none", "pointwise", "full"}:
        raise SystemExit(f"--fusion takes none, pointwise, full; got {args.fusion}")
    attentions = args.attention.split(",")
    if not attentions or set(attentions) - set(StaticGreedyDecoder.ATTENTION_MODES):
        raise SystemExit(f"--attention takes {', '.join(StaticGreedyDecoder.ATTENTION_MODES)}; got {args.attention}")
    families = []
    for fmt in formats:
        if family_of(fmt) not in families:
            families.append(family_of(fmt))
    for family in families:
        t0 = time.perf_counter()
        modules = list(dense.values()) if family == "fp16" else list(install(model, dense, family, args.seed).values())
        log(f"{family}: built in {time.perf_counter() - t0:.1f} s")
        for fmt in (f for f in formats if family_of(f) == family):
            for fusion in fusions:
                if fusion in ("pointwise", "full"):
                    fuse_pointwise(model)
                for attention in attentions:
                    run_format(fmt, fusion, attention, model, modules, prompt, args, results)
                unfuse_pointwise(model)
        restore(model, dense)
        del modules
        torch.cuda.empty_cache()
    add_speedups(results)

    props = torch.cuda.get_device_properties(0)
    import transformers

    print(f"{props.name}, torch {torch.__version__}, transformers {transformers.__version__}; Llama-2-7B shapes, "
          f"{args.layers} layers, batch 1, prompt {args.prompt_len}, greedy, static cache + CUDA graph per step")
    print(table(results))
    for line in goal_lines(results, args.gen[0], fusions, attentions):
        print(line)
    total = time.perf_counter() - started
    print(f"total {total:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "device": props.name, "torch": torch.__version__, "transformers": transformers.__version__,
            "config": {**LLAMA2_7B, "num_hidden_layers": args.layers}, "prompt_len": args.prompt_len,
            "gen": args.gen, "repeats": args.repeats, "group_size": GROUP, "fusions": fusions,
            "attentions": attentions,
            "anyprec": {"seed_bits": ANYPREC_SEED, "parent_bits": ANYPREC_PARENT}, "seconds": round(total, 1),
            "results": results}, indent=2))


if __name__ == "__main__":
    main()
