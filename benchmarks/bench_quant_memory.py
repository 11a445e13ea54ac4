"""Peak accelerator and host memory of layer-by-layer quantization on a Llama-2-7B-shaped model.

The model is built on the host in fp16 from its config with random weights (hidden 4096,
intermediate 11008, 32 heads, vocab 32000; --layers of them, 32 by default), so nothing is
downloaded; calibration windows are random token ids. Each run calls the engine
(quantkit.engine.quantize_model) as `quantkit quantize` does, on CUDA, and reports:
  peak GPU   torch.cuda.max_memory_allocated during the run (and the allocator's reserved peak)
  host peak  the process's peak resident set during the run (VmHWM, reset before each run),
             next to the resident set before it (the model itself)
  time       wall time of the run, and per layer
The table's "budget" column is what the engine is designed to hold at once: one decoder layer
(fp16) + the calibration activations (inputs and outputs of a layer, unless offloaded) + the
statistics of the widest group (two d×d fp32 sums) + the embedding and head while the first
layer's inputs are captured. It leaves out the method's own workspace (GPTQ: a few more d×d fp32
matrices for the damped Hessian and its inverse Cholesky factor), so the peak lies somewhat above it.

  python benchmarks/bench_quant_memory.py --json $OUT/quant_memory.json           # ~2-3 min on an H100
  python benchmarks/bench_quant_memory.py --quick --json $OUT/quant_memory_quick.json

Runs (each on the same host model; weights are replaced by their quantized values as they go,
which changes nothing about memory): RTN without calibration over every layer; GPTQ w4g128 with
--nsamples windows over the first --gptq-layers layers, activations on the GPU and offloaded;
GPTQ with --big-nsamples windows over --big-layers layers, both ways, where the activations
dominate. Peak GPU memory does not depend on the number of layers, only on one layer's size
and the activations: that is the point being measured.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from quantkit.engine import quantize_model
from quantkit.methods import make_method
from quantkit.models import adapter_for

LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def random_llama(layers=32, seed=0, dtype=torch.float16, **shape):
    """A LlamaForCausalLM with random weights, built in `dtype` directly on the host (the weights are
    allocated once: no fp32 copy, no second copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, use_cache=False, **{**LLAMA_7B, **shape})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cpu")
    for index, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:  # seeded per tensor, so every process builds the same model; drawn on the GPU when there
            # is one (a host generator needs ~5 min for 6.7B fp16 values on one core)
            where = "cuda" if torch.cuda.is_available() else "cpu"
            gen = torch.Generator(device=where).manual_seed(seed * 1_000_003 + index)
            param.data.copy_(torch.empty(param.shape, dtype=param.dtype, device=where)
                             .normal_(0.0, 0.02, generator=gen))
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffers were never computed on meta
    return model.eval()


def rss_bytes():
    """(current, peak) resident set of this process in bytes, from /proc/self/status."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def reset_host_peak():
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def first_layers(model, count):
    """A context that leaves only the first `count` decoder layers in the model."""

    class _Only:
        def __enter__(self):
            self.saved = model.model.layers
            model.model.layers = torch.nn.ModuleList(list(self.saved)[:count])
            return model

        def __exit__(self, *exc):
            model.model.layers = self.saved

    return _Only()


def budget_bytes(model, nsamples, seqlen, offload):
    """The engine's designed peak: one layer + activations + two fp32 d×d sums + embedding and head."""
    layer = model.model.layers[0]
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    hidden = model.config.hidden_size
    acts = 0 if offload else 2 * nsamples * seqlen * hidden * 2
    widest = max(m.in_features for m in layer.modules() if isinstance(m, torch.nn.Linear))
    stats = 2 * widest * widest * 4 if nsamples else 0
    outside = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." not in n)
    return layer_bytes + acts + stats + (outside if nsamples else 0)


def run(model, label, method, nsamples, seqlen, layers, offload, device, seed):
    with first_layers(model, layers):
        calib = None
        if nsamples:
            gen = torch.Generator().manual_seed(seed)
            calib = torch.randint(0, model.config.vocab_size, (nsamples, seqlen), generator=gen)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rss_before, _ = rss_bytes()
        exact_host_peak = reset_host_peak()
        torch.cuda.synchronize()
        start = time.perf_counter()
        qtensors, _ = quantize_model(model, adapter_for(model), method, calib, device=device, progress=False,
                                     offload_activations=offload)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        _, host_peak = rss_bytes()
        row = {"run": label, "method": method.name, "settings": method.config(), "layers": layers,
               "nsamples": nsamples, "seqlen": seqlen if nsamples else None, "offload_activations": offload,
               "seconds": round(seconds, 2), "seconds_per_layer": round(seconds / layers, 3),
               "peak_gpu_allocated": torch.cuda.max_memory_allocated(),
               "peak_gpu_reserved": torch.cuda.max_memory_reserved(),
               "budget_bytes": budget_bytes(model, nsamples, seqlen, offload),
               "host_rss_before": rss_before, "host_peak": host_peak, "host_peak_is_per_run": exact_host_peak,
               "packed_bytes": sum(sum(t.numel() * t.element_size() for t in q.state_dict().values())
                                   for q in qtensors.values())}
        del qtensors
    return row


def gib(n):
    return f"{n / 2**30:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the model built [32, as Llama-2-7B]")
    ap.add_argument("--gptq-layers", type=int, default=3, help="layers quantized in the GPTQ runs [3]")
    ap.add_argument("--nsamples", type=int, default=16, help="calibration windows of the GPTQ runs [16]")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--big-nsamples", type=int, default=128, help="windows of the activation-heavy runs [128]")
    ap.add_argument("--big-layers", type=int, default=1, help="layers of the activation-heavy runs [1]")
    ap.add_argument("--quick", action="store_true", help="4 layers, 8 x 1024 windows, 32 in the heavy runs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.gptq_layers, args.nsamples, args.seqlen = 4, 2, 8, 1024
        args.big_nsamples, args.big_layers = 32, 1
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark measures GPU memory: it needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False  # as the engine's numerics assume

    start = time.perf_counter()
    model = random_llama(args.layers, seed=args.seed)
    build_seconds = time.perf_counter() - start
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    print(f"model: {args.layers} Llama-2-7B-shaped layers, {model_bytes / 2**30:.2f} GiB fp16 on the host "
          f"(one layer {layer_bytes / 2**20:.0f} MiB), built in {build_seconds:.1f} s")

    gptq = make_method("gptq", bits=4, group_size=128)
    plan = [("rtn w4g128, no calibration", make_method("rtn", bits=4, group_size=128), 0, args.layers, False)]
    for offload in (False, True):
        plan.append((f"gptq w4g128, {args.nsamples} windows" + (", offloaded" if offload else ""), gptq,
                     args.nsamples, args.gptq_layers, offload))
    for offload in (False, True):
        plan.append((f"gptq w4g128, {args.big_nsamples} windows" + (", offloaded" if offload else ""), gptq,
                     args.big_nsamples, args.big_layers, offload))
    rows = []
    for label, method, nsamples, layers, offload in plan:
        row = run(model, label, method, nsamples, args.seqlen, min(layers, args.layers), offload, args.device,
                  args.seed)
        rows.append(row)
        print(f"  {label}: peak GPU {gib(row['peak_gpu_allocated'])} GiB, {row['seconds']} s", flush=True)

    header = ["run", "layers", "peak GPU GiB", "reserved GiB", "budget GiB", "host before GiB", "host peak GiB",
              "s/layer"]
    table = [[r["run"], str(r["layers"]), gib(r["peak_gpu_allocated"]), gib(r["peak_gpu_reserved"]),
              gib(r["budget_bytes"]), gib(r["host_rss_before"]), gib(r["host_peak"]), f"{r['seconds_per_layer']:.2f}"]
             for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    print(f"fp16 model: {gib(model_bytes)} GiB; a GPU holding it whole would need at least that much")

    if args.json:
        payload = {"benchmark": "quant_memory", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "host": platform.node(), "model": {"shape": "llama-2-7b", "layers": args.layers,
                                                      "bytes": model_bytes, "layer_bytes": layer_bytes,
                                                      "build_seconds": round(build_seconds, 1)},
                   "seqlen": args.seqlen, "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
