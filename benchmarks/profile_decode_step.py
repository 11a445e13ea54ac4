"""Where a decode step's time goes outside the linears: kernels per step of one CUDA-graph decode step.

  python benchmarks/profile_decode_step.py --json $OUT/decode_step_profile.json     # ~1 min on an H100
  python benchmarks/profile_decode_step.py --real                                   # linears not stubbed

The model is bench_e2e_decode's fp16 Llama-2-7B shape (random weights, no download) with the full fusion
(runtime.fusion: compiled pointwise pieces, stacked q/k/v and gate/up). By default its decoder linears
answer from a preallocated buffer (no kernel), as in bench_e2e_decode's "linear share", so what is left
is everything a step runs besides them: attention, norms, rotary, residual adds, cache writes, lm_head,
argmax. The step is timed with CUDA events over 50 replays, then torch.profiler collects the kernels of
20 replays; the table lists kernels per step, µs per step and µs per launch, largest first.
"""

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e_decode import build_model, captured_step_ms, decoder_linears, stub_forward  # noqa: E402

from quantkit.runtime.fusion import fuse_pointwise, fuse_projections  # noqa: E402
from quantkit.runtime.generate import StaticGreedyDecoder  # noqa: E402


def profile_step(model, prompt, max_len, replays, attention):
    ms_per_step, decoder = captured_step_ms(model, prompt, max_len, 50, attention)
    decoder.prefill(prompt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decoder.steps(replays)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name]
            entry[0] += 1
            entry[1] += event.device_time_total
    rows = [{"kernel": name, "per_step": count / replays, "us_per_step": us / replays, "us_each": us / count}
            for name, (count, us) in kernels.items()]
    return ms_per_step, sorted(rows, key=lambda r: -r["us_per_step"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=256, help="static cache length (SDPA reads all of it)")
    ap.add_argument("--attention", default="split", choices=StaticGreedyDecoder.ATTENTION_MODES,
                    help="the decoder's attention in decode steps (see StaticGreedyDecoder) [split]")
    ap.add_argument("--replays", type=int, default=20, help="profiled decode steps")
    ap.add_argument("--real", action="store_true", help="keep the fp16 linears (cuBLAS) instead of stubbing them")
    ap.add_argument("--top", type=int, default=20, help="kernels printed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    model = build_model(args.layers)
    fuse_pointwise(model)
    fuse_projections(model)
    if not args.real:
        for module in decoder_linears(model).values():
            module.forward = stub_forward(module, args.prompt_len)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device="cuda")
    with torch.inference_mode():
        ms_per_step, rows = profile_step(model, prompt, args.max_len, args.replays, args.attention)
    busy = sum(r["us_per_step"] for r in rows) / 1000
    launches = sum(r["per_step"] for r in rows)
    what = "fp16 linears (cuBLAS)" if args.real else "linears stubbed"
    print(f"{torch.cuda.get_device_name()}, {args.layers} layers, full fusion, {args.attention} attention, {what}: "
          f"{ms_per_step:.3f} ms per step "
          f"(CUDA events); profiler: {launches:.0f} kernels per step, {busy:.3f} ms busy")
    print(f"{'per step':>8}  {'us/step':>8}  {'us each':>7}  kernel")
    for r in rows[: args.top]:
        print(f"{r['per_step']:8.1f}  {r['us_per_step']:8.1f}  {r['us_each']:7.2f}  {r['kernel'][:100]}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
            "prompt_len": args.prompt_len, "max_len": args.max_len, "replays": args.replays,
            "attention": args.attention,
            "linears": "real" if args.real else "stubbed", "ms_per_step": ms_per_step,
            "kernels_per_step": launches, "busy_ms_per_step": busy, "kernels": rows}, indent=2))


if __name__ == "__main__":
    main()
