"""Where a decode step's time goes: the kernels of one CUDA-graph decode step of the fast decoder.

  python benchmarks/profile_decode_step.py --json $OUT/decode_step_profile.json     # ~1 min on an H100
  python benchmarks/profile_decode_step.py --format bcq-q3-g128 --real              # projections not stubbed

The model is bench_e2e_decode's Llama-2-7B shape (random weights, no download) in --format. By default its
decoder projections answer from a preallocated buffer (no kernel), as in bench_e2e_decode's "outside"
column, so what is left is everything a step runs besides them: attention, norms, residual adds, SiLU·mul,
embedding, head, the pick and the step's bookkeeping. The step is captured by runtime.generate.FastGenerator
(a first generation), timed with CUDA events over 50 replays, then torch.profiler collects the kernels of
--replays replays; the table lists kernels per step, µs per step and µs per launch, largest first.
"""

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e_decode import FORMATS, LLAMA2_7B, build_model, family_of, projections, prompts_for  # noqa: E402

from quantkit.runtime import ops  # noqa: E402
from quantkit.runtime.generate import FastGenerator  # noqa: E402
from quantkit.runtime.model import DecoderConfig  # noqa: E402


def replay_ms(graph, replays):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="fp16", choices=FORMATS)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128, help="generated tokens: the cache holds prompt + gen positions")
    ap.add_argument("--replays", type=int, default=20, help="profiled decode steps")
    ap.add_argument("--real", action="store_true", help="keep the projections' kernels instead of stubbing them")
    ap.add_argument("--top", type=int, default=20, help="kernels printed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from transformers import LlamaConfig

    cfg = DecoderConfig.from_transformers(LlamaConfig(**{**LLAMA2_7B, "num_hidden_layers": args.layers}))
    model = build_model(cfg, family_of(args.format), 0)
    if args.format.startswith("anyprec-"):
        model.set_bits(int(args.format.split("-")[1]))
    if not args.real:
        widest = max(m.out_features for m in projections(model))
        buffer = torch.zeros(args.batch * args.prompt_len * widest, dtype=model.dtype, device="cuda")
        ops.project = lambda module, x: buffer[: x.numel() // x.shape[-1] * module.out_features].view(
            *x.shape[:-1], module.out_features)
        ops.project_sums = lambda module, x: None
    generator = FastGenerator(model)
    generator.run(prompts_for(args.batch, args.prompt_len, cfg.vocab_size, 0), args.gen)
    ((graph, _),) = generator.graphs.values()
    ms_per_step = replay_ms(graph, 50)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay_ms(graph, args.replays)
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name]
            entry[0] += 1
            entry[1] += event.device_time_total
    rows = sorted(({"kernel": name, "per_step": count / args.replays, "us_per_step": us / args.replays,
                    "us_each": us / count} for name, (count, us) in kernels.items()), key=lambda r: -r["us_per_step"])
    busy = sum(r["us_per_step"] for r in rows) / 1000
    launches = sum(r["per_step"] for r in rows)
    what = "projections' kernels" if args.real else "projections stubbed"
    print(f"{torch.cuda.get_device_name()}, {args.layers} layers, {args.format}, batch {args.batch}, {what}: "
          f"{ms_per_step:.3f} ms per step (CUDA events); profiler: {launches:.0f} kernels per step, {busy:.3f} ms busy")
    print(f"{'per step':>8}  {'us/step':>8}  {'us each':>7}  kernel")
    for r in rows[: args.top]:
        print(f"{r['per_step']:8.1f}  {r['us_per_step']:8.1f}  {r['us_each']:7.2f}  {r['kernel'][:100]}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
            "format": args.format, "batch": args.batch, "prompt_len": args.prompt_len, "gen": args.gen,
            "replays": args.replays, "projections": "real" if args.real else "stubbed", "ms_per_step": ms_per_step,
            "kernels_per_step": launches, "busy_ms_per_step": busy, "kernels": rows}, indent=2))


if __name__ == "__main__":
    main()
