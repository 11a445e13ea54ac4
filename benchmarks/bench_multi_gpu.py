"""Quantization on one GPU vs spread over N GPUs of the host (torchrun, NCCL): time, and whether the
two artifacts are byte-identical (they should be: engine/distributed.py).

The driver runs the same worker twice, `python THIS --worker` (one process) and
`python -m torch.distributed.run --standalone --nproc-per-node N THIS --worker`, on a
Llama-2-7B-shaped random fp16 model of --layers layers built identically by every process
(bench_quant_memory.random_llama) and --nsamples random calibration windows; each writes its
artifact and its timings. The driver then compares every artifact file byte for byte
(quant_log.json without its timings) and prints and writes the result.

  python benchmarks/bench_multi_gpu.py --nproc 2 --json $OUT/multi_gpu.json        # ~3 min on 2 H200
  python benchmarks/bench_multi_gpu.py --nproc 2 --quick --json $OUT/multi_gpu_quick.json

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set for the workers unless already set).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 500}  # --tiny: a CPU smoke test of the script itself
VOLATILE = {"time_s", "quantize_seconds", "world_size", "device", "engine_seconds"}


def worker(args):
    sys.path.insert(0, str(HERE))
    from bench_quant_memory import random_llama

    from quantkit.artifact import float_tensors, write_artifact
    from quantkit.engine import quantize_model
    from quantkit.engine.distributed import init_from_env, shutdown
    from quantkit.methods import make_method
    from quantkit.models import adapter_for

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = args.device == "cuda"
    ranks = init_from_env(args.device)
    device = ranks.device if ranks.distributed else args.device
    start = time.perf_counter()
    model = random_llama(args.layers, seed=args.seed, **(TINY if args.tiny else {}))
    if not cuda:
        model = model.float()  # CPU smoke runs: fp16 matmuls are not what CPUs are for
    build = time.perf_counter() - start
    calib = torch.randint(0, model.config.vocab_size, (args.nsamples, args.seqlen),
                          generator=torch.Generator().manual_seed(args.seed))
    method = make_method("gptq", bits=4, group_size=128, clip_search=not args.no_clip_search)
    ranks.barrier()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    qtensors, entries = quantize_model(model, adapter_for(model), method, calib, device=device,
                                       progress=False, ranks=ranks)
    sync()
    engine = time.perf_counter() - start
    report = {"rank": ranks.rank, "world_size": ranks.world_size,
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              "build_seconds": round(build, 1), "engine_seconds": round(engine, 2),
              "peak_gpu_allocated": torch.cuda.max_memory_allocated() if cuda else 0}
    if ranks.is_main:
        write_artifact(args.out, model_config=model.config.to_dict(), tokenizer=None, qtensors=qtensors,
                       float_tensors=float_tensors(model, qtensors),
                       quantization_config={"method": "gptq", **method.config(), "architecture": "llama"},
                       quant_log={"world_size": ranks.world_size, "modules": entries}, overwrite=True)
    Path(f"{args.out}.rank{ranks.rank}.json").write_text(json.dumps(report))
    ranks.barrier()
    shutdown(ranks)


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    return [_strip(v) for v in value] if isinstance(value, list) else value


def compare(one: Path, many: Path):
    """{file: equal?} over the union of both artifacts' files."""
    names = sorted({p.name for p in one.iterdir()} | {p.name for p in many.iterdir()})
    result = {}
    for name in names:
        a, b = one / name, many / name
        if not (a.is_file() and b.is_file()):
            result[name] = False
        elif name == "quant_log.json":
            result[name] = _strip(json.loads(a.read_text())) == _strip(json.loads(b.read_text()))
        else:
            result[name] = a.read_bytes() == b.read_bytes()
    return result


def driver(args):
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    common = ["--worker", "--layers", str(args.layers), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
              "--seed", str(args.seed), "--device", args.device] \
        + (["--no-clip-search"] if args.no_clip_search else []) \
        + (["--tiny"] if args.tiny else [])
    runs = {}
    for label, nproc in (("one", 1), ("many", args.nproc)):
        out = work / label
        launcher = [sys.executable] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        start = time.perf_counter()
        proc = subprocess.run(launcher + [__file__, *common, "--out", str(out)], env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{label} run failed with exit code {proc.returncode}")
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]
        runs[label] = {"nproc": nproc, "wall_seconds": round(wall, 1),
                       "engine_seconds": max(r["engine_seconds"] for r in ranks), "ranks": ranks}
    files = compare(work / "one", work / "many")
    identical = all(files.values())
    speedup = runs["one"]["engine_seconds"] / runs["many"]["engine_seconds"]
    print(f"model: {args.layers} {'tiny' if args.tiny else 'Llama-2-7B-shaped'} layers, gptq w4g128, "
          f"{args.nsamples} x {args.seqlen} windows")
    print(f"{'GPUs':>5}  {'engine s':>9}  {'wall s':>7}  {'peak GPU GiB (max rank)':>24}")
    for label in ("one", "many"):
        r = runs[label]
        peak = max(x["peak_gpu_allocated"] for x in r["ranks"]) / 2**30
        print(f"{r['nproc']:>5}  {r['engine_seconds']:>9.2f}  {r['wall_seconds']:>7.1f}  {peak:>24.2f}")
    print(f"speedup of the engine: {speedup:.2f}x; artifacts byte-identical: {identical}")
    if not identical:
        print("differing files: " + ", ".join(n for n, same in files.items() if not same))
    if args.json:
        payload = {"benchmark": "multi_gpu_quantize", "layers": args.layers, "nsamples": args.nsamples,
                   "seqlen": args.seqlen, "method": "gptq w4g128" + (" no clip" if args.no_clip_search else ""),
                   "runs": runs, "speedup": round(speedup, 3), "identical": identical, "files": files,
                   "torch": torch.__version__}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2))
    if not identical:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="GPUs of the spread run (1, 2, 4 or 8)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-clip-search", action="store_true", help="GPTQ without the clipping search (faster)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 16 windows")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo ranks (smoke test)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model instead of the 7B shape (smoke test)")
    ap.add_argument("--workdir", default="/tmp/quantkit-multi-gpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.nsamples = 2, 16
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
