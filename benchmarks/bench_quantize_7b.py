"""Whole-model GPTQ w4g128 (the method's default settings) of a Llama-2-7B-shaped checkpoint read from local
disk, through the real pipeline (`quantkit quantize`'s quantize_checkpoint): wall time split into load /
calibration forwards / solver / write, peak host RSS, peak GPU memory.

The driver first writes the checkpoint to --workdir (once; reused when present): random bf16 weights
(hidden 4096, intermediate 11008, 32 heads, vocab 32000, 32 layers: 6.7 B parameters, 12.6 GiB) drawn on the
GPU per tensor, as safetensors shards of four layers with a model.safetensors.index.json, beside a word-level
tokenizer of 32000 words "w0".."w31999" and a calibration .txt of random words (so the calibration windows are
random token ids, sampled by the pipeline's own seeded rule from a local file). It then runs the quantization in
a fresh process, `python THIS --worker`, or under `torchrun --nproc-per-node N` with --nproc N, so the peak
host RSS of the worker is the quantization's alone (the checkpoint is read one decoder block at a time).

Timings (seconds, from the run's summary and quant_log.json):
  load         reading the weights: the tensors outside the blocks, plus every block as its turn comes (on a
               GPU the engine reads block i + 1 while block i computes: only the wait for it counts here)
  forwards     the engine's time less the solver and block reads: capturing the first block's inputs and
               the calibration forwards of every block (one per sequential group, one for the outputs)
  solver       the sum of the per-linear method times (GPTQ with act-order, static groups, clip search)
  write        writing the artifact (shards, checksums, tokenizer)
  other        the rest of the wall time: checks, tokenizing the calibration text, sampling the windows
The time of a few steps inside these (STEPS: the tokenizer, the calibration text, the first block's inputs,
the kernel's cache lookup...) is reported as well. The GPTQ kernel is built (or found in the cache) by a
process of its own before the run: a machine's first run adds that one-time build, reported apart.
Peak host RSS: the worker's ru_maxrss, and the peak per phase from a thread reading /proc/self/statm every
50 ms (it can miss a spike shorter than that; ru_maxrss cannot): `load` up to the engine's start (tokenizer,
calibration windows, the tensors outside the blocks), `forwards+solver` the engine (block reads included),
`write` the artifact writer, `other` before and after those. Finished layers' packed tensors wait on disk
(engine/spill.py) unless --no-spill keeps them in memory (the behaviour before the spill, for comparison).
The layer checkpoint (resume) is off unless --checkpoint: it writes each layer's next inputs to disk
(128 × 2048 × 4096 bf16 = 2 GiB per layer).

  python benchmarks/bench_quantize_7b.py --build-only                                 # ~1 min: the checkpoint
  python benchmarks/bench_quantize_7b.py --json $OUT/quantize_7b.json                 # the run, one GPU
  python benchmarks/bench_quantize_7b.py --nproc 2 --json $OUT/quantize_7b_2gpu.json  # 2 GPUs, torchrun
  python benchmarks/bench_quantize_7b.py --layers 2 --nsamples 8 --workdir build/q2 --json $OUT/q.json  # a check
  python benchmarks/bench_quantize_7b.py --nproc 4 --phases --json $OUT/q4.json      # where each rank's time goes
The checkpoint (12.6 GiB) stays in --workdir (build/ is ignored by git) for the runs that follow on the same
machine; building it in the same command as a full run may not fit a time limit of a few minutes.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set for the workers unless already set).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 500}  # --tiny: a CPU smoke test of the script itself
LAYERS_PER_SHARD = 4
PHASES = ("load", "forwards+solver", "write", "other")


def _tokenizer(vocab_size):
    """A word-level tokenizer of the words w0 .. w{vocab_size-1} (w0 doubles as the unknown word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def build_checkpoint(directory: Path, layers: int, tokens: int, seed=0, shape=None):
    """Write the random bf16 checkpoint, its tokenizer and a calibration text of `tokens` random words."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shape = {**LLAMA_7B, **(shape or {})}
    stamp = [layers, tokens, seed, shape]
    if (directory / "done").is_file() and json.loads((directory / "done").read_text()) == stamp:
        return
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, dtype="bfloat16", **shape)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    _tokenizer(config.vocab_size).save_pretrained(directory)
    where = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=where).manual_seed(seed)
    h, inter = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, h), "k_proj": (h, h), "v_proj": (h, h), "o_proj": (h, h)}
    mlp = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}

    def draw(shape):
        return (torch.randn(shape, generator=gen, device=where) / shape[-1] ** 0.5).to(torch.bfloat16).cpu()

    groups = [list(range(i, min(i + LAYERS_PER_SHARD, layers))) for i in range(0, layers, LAYERS_PER_SHARD)]
    names = [f"model-{k + 1:05d}-of-{len(groups) + 1:05d}.safetensors" for k in range(len(groups) + 1)]
    weight_map = {}
    for fname, group in zip(names, groups):
        tensors = {}
        for i in group:
            p = f"model.layers.{i}."
            tensors.update({f"{p}self_attn.{n}.weight": draw(s) for n, s in shapes.items()})
            tensors.update({f"{p}mlp.{n}.weight": draw(s) for n, s in mlp.items()})
            tensors[f"{p}input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    outside = {"model.embed_tokens.weight": draw((config.vocab_size, h)) * h ** 0.5,  # of unit scale
               "lm_head.weight": draw((config.vocab_size, h)), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(outside, str(directory / names[-1]), metadata={"format": "pt"})
    weight_map.update({k: names[-1] for k in outside})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    words = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    lines = [" ".join(f"w{w}" for w in words[i : i + 4096]) for i in range(0, len(words), 4096)]
    (directory / "calibration.txt").write_text("\n".join(lines) + "\n")
    (directory / "done").write_text(json.dumps(stamp))


class PhaseRss:
    """Resident set size of this process, read from /proc/self/statm every `interval` seconds by a thread;
    the peak (and when it came, seconds from the start) per phase. `during(phase, fn)` wraps fn so that its
    calls count as `phase`."""

    def __init__(self, interval=0.05):
        self.interval, self.phase, self.peaks = interval, "other", {}
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self):
        with open("/proc/self/statm") as fh:
            fields = fh.read().split()
        rss, shared = int(fields[1]) * self.page, int(fields[2]) * self.page
        peak = self.peaks.get(self.phase)
        if peak is None or rss > peak["rss_bytes"]:
            self.peaks[self.phase] = {"rss_bytes": rss, "file_backed_bytes": shared,
                                      "at_seconds": round(time.perf_counter() - self.start, 2)}

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def enter(self, phase):
        self.sample()  # the last moment of the phase that ends
        self.phase = phase
        self.sample()

    def during(self, phase, fn):
        def wrapped(*args, **kwargs):
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.enter("other")

        return wrapped

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peaks


# (module, function) whose calls the worker times, to split "other" and "forwards" further; each is looked up
# in that module at call time
STEPS = (("quantkit.pipeline", "resolve_device"), ("quantkit.pipeline", "check_architecture"),
         ("quantkit.pipeline", "check_shards"), ("quantkit.pipeline", "load_tokenizer"),
         ("quantkit.pipeline", "calibration_windows"), ("quantkit.pipeline", "_Job"),
         ("quantkit.pipeline", "run_fingerprint"), ("quantkit.models.lazy", "open_lazy"),
         ("quantkit.engine.driver", "capture_layer_inputs"), ("quantkit.kernels.build", "load"))


def time_steps(seconds: dict):
    """Wrap every STEPS function so that its calls add to seconds["module.function"]."""
    import importlib

    def timed(key, fn):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] = round(seconds.get(key, 0.0) + time.perf_counter() - start, 3)

        return wrapped

    for module_name, name in STEPS:
        module = importlib.import_module(module_name)
        setattr(module, name, timed(f"{module_name.rpartition('.')[2]}.{name}", getattr(module, name)))


def warm_kernels(device) -> float:
    """Compile (or find in the cache) the GPTQ kernel in a process of its own, so that a machine's one-time
    build is reported apart from the run; seconds taken."""
    if device != "cuda":
        return 0.0
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from quantkit.kernels import build; build.load('gptq')"], check=True)
    return round(time.perf_counter() - start, 1)


def worker(args):
    import quantkit.pipeline as pipeline
    from quantkit.engine.distributed import env_world_size

    torch.backends.cuda.matmul.allow_tf32 = False
    rank = int(os.environ.get("RANK", "0"))
    rss = PhaseRss()
    # the pipeline looks both up at call time: wrapped, their calls are the forwards+solver and write phases
    pipeline.quantize_model = rss.during("forwards+solver", pipeline.quantize_model)
    pipeline.write_artifact = rss.during("write", pipeline.write_artifact)
    steps = {}
    time_steps(steps)
    start = time.perf_counter()
    rss.enter("load")
    summary = pipeline.quantize_checkpoint(str(args.model), args.out, "gptq", {"bits": 4, "group_size": 128},
                                           calib=str(Path(args.model) / "calibration.txt"), nsamples=args.nsamples,
                                           seqlen=args.seqlen, device=args.device, dtype=args.dtype, overwrite=True,
                                           progress=False, checkpoint=args.checkpoint, spill=not args.no_spill)
    wall = time.perf_counter() - start
    peaks = rss.stop()
    cuda = args.device == "cuda"
    report = {"rank": rank, "world_size": env_world_size(), "wall_seconds": round(wall, 2),
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "peak_host_rss_by_phase": peaks,
              "peak_gpu_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
              "peak_gpu_reserved": torch.cuda.max_memory_reserved() if cuda else 0, "step_seconds": steps,
              "summary": {k: v for k, v in summary.items() if k not in ("settings",)}}
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report))


def phases(report, out: Path):
    """The wall time split (see the module docstring) of the rank-0 report."""
    s = report["summary"]
    log = json.loads((out / "quant_log.json").read_text())
    solver = sum(e.get("time_s", 0.0) for e in log["modules"])
    block_reads = s.get("block_read_seconds", 0.0)
    load = s["load_seconds"] + block_reads
    forwards = s["quantize_seconds"] - solver - block_reads
    write = s["write_seconds"]
    other = report["wall_seconds"] - load - forwards - solver - write
    return {"load": round(load, 2), "forwards": round(forwards, 2), "solver": round(solver, 2),
            "write": round(write, 2), "other": round(other, 2), "wall": report["wall_seconds"]}


def driver(args):
    work = Path(args.workdir)
    model = work / "checkpoint"
    start = time.perf_counter()
    build_checkpoint(model, args.layers, args.nsamples * args.seqlen * 2, shape=TINY if args.tiny else None)
    build = time.perf_counter() - start
    if args.build_only:
        print(f"checkpoint written to {model} in {build:.0f} s")
        return
    kernel_build = warm_kernels(args.device)
    out = work / f"artifact-{args.nproc}gpu"
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.phases:
        env["QUANTKIT_ENGINE_TIMINGS"] = "1"
    launcher = [sys.executable] if args.nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd = launcher + [__file__, "--worker", "--model", str(model), "--out", str(out), "--nsamples",
                      str(args.nsamples), "--seqlen", str(args.seqlen), "--dtype", args.dtype,
                      "--device", args.device] \
        + (["--checkpoint"] if args.checkpoint else []) + (["--no-spill"] if args.no_spill else [])
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the quantization failed with exit code {proc.returncode}")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(args.nproc)]
    split = phases(ranks[0], out)
    gib = 2**30
    result = {"benchmark": "quantize_7b", "model": f"Llama-2-7B-shaped, {args.layers} layers, random bf16 weights",
              "method": "gptq w4g128 (defaults)", "nsamples": args.nsamples, "seqlen": args.seqlen,
              "nproc": args.nproc, "device": ranks[0]["device"], "dtype": ranks[0]["summary"]["dtype"],
              "checkpoint_build_seconds": round(build, 1), "kernel_build_seconds": kernel_build, "seconds": split,
              "step_seconds": ranks[0]["step_seconds"],
              "peak_host_rss_gib": round(max(r["peak_host_rss_bytes"] for r in ranks) / gib, 2),
              "peak_host_rss_by_phase_gib": {phase: round(max(r["peak_host_rss_by_phase"].get(phase, {})
                                                              .get("rss_bytes", 0) for r in ranks) / gib, 2)
                                             for phase in PHASES},
              "spill": not args.no_spill,
              "peak_gpu_allocated_gib": round(max(r["peak_gpu_allocated"] for r in ranks) / gib, 2),
              "peak_gpu_reserved_gib": round(max(r["peak_gpu_reserved"] for r in ranks) / gib, 2),
              "artifact_bytes": sum(p.stat().st_size for p in out.iterdir()),
              "lazy_loading": "block_read_seconds" in ranks[0]["summary"],
              "torch": torch.__version__, "ranks": ranks}
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(f"{result['model']}; {result['method']}, {args.nsamples} x {args.seqlen} windows, {args.nproc} GPU(s) "
          f"({result['device']}), compute {result['dtype']}")
    print(f"{'phase':<10} {'seconds':>9}")
    for key in ("load", "forwards", "solver", "write", "other", "wall"):
        print(f"{key:<10} {split[key]:>9.1f}")
    for report in ranks if args.phases else ():
        engine = report["summary"].get("engine_phases", {})
        print(f"engine phases, rank {report['rank']} (synchronised): "
              + ", ".join(f"{k} {v:.1f}" for k, v in engine.items()))
    print("within them (rank 0): " + ", ".join(f"{k} {v:.1f}" for k, v in result["step_seconds"].items()))
    print("peak host RSS by phase (GiB, sampled every 50 ms): " + ", ".join(
        f"{phase} {value:.2f}" for phase, value in result["peak_host_rss_by_phase_gib"].items()))
    print(f"peak host RSS {result['peak_host_rss_gib']:.2f} GiB (max over ranks); peak GPU allocated "
          f"{result['peak_gpu_allocated_gib']:.2f} GiB, reserved {result['peak_gpu_reserved_gib']:.2f} GiB; "
          f"checkpoint build {build:.0f} s, GPTQ kernel build or cache lookup {kernel_build:.0f} s "
          "(neither in the wall time)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (1, 2, 4 or 8; more than 1 runs under torchrun)")
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: the checkpoint's bf16)")
    ap.add_argument("--checkpoint", action="store_true", help="keep the per-layer resume checkpoint on")
    ap.add_argument("--no-spill", action="store_true",
                    help="keep finished layers' packed tensors in memory until the write (for comparison)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model instead of the 7B shape (smoke test)")
    ap.add_argument("--workdir", default="build/quantize-7b",
                    help="where the checkpoint (reused when present) and the artifact go")
    ap.add_argument("--build-only", action="store_true", help="write the checkpoint and stop")
    ap.add_argument("--phases", action="store_true",
                    help="time the engine's phases on every rank (QUANTKIT_ENGINE_TIMINGS=1: the GPU is synchronised "
                         "at each phase boundary, which costs a little time)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
