"""Where one 7B-shaped layer's GPTQ solve goes, stage by stage, on one GPU.

The default `gptq` method (w4g128, act-order, static groups, clip search) runs on the seven linears of a
Llama-2-7B block (random weights, H from correlated random tokens as in bench_gptq_kernel.py), each stage timed
with the stream synchronised around it, the way GPTQ.quantize chains them (gptq_quantize includes the
static-group params, which are also timed alone, in PyTorch and by the kernel gptq_quantize uses on CUDA); then
the engine's own call (engine.driver._quantize_linear: the method plus the dequantized weight, weight and
output error) is timed whole, each linear with its own statistics (no U shared). Prints a table and writes JSON.

  python3 benchmarks/profile_gptq_layer.py --json $OUT/gptq_layer_profile.json
"""

import argparse
import json
import time
from functools import partial

import torch
from bench_gptq_kernel import make_layer  # benchmarks/, next to this script

from quantkit.engine.driver import _quantize_linear
from quantkit.formats.uniform import UniformQuantizedTensor, grouped_uniform_params
from quantkit.kernels import gptq_cuda
from quantkit.methods import make_method
from quantkit.methods.base import effective_group_size
from quantkit.methods.gptq import gptq_quantize, ordered_inverse, prepare_hessian

LINEARS = {"q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096), "o_proj": (4096, 4096),
           "gate_proj": (11008, 4096), "up_proj": (11008, 4096), "down_proj": (4096, 11008)}


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def stages(method, weight, xtx, nsamples):
    """Seconds of each stage of GPTQ.quantize (same calls, same order), and the static-group params both ways."""
    t = {}
    (h, w), t["prepare_hessian"] = timed(lambda: prepare_hessian(xtx, nsamples, weight))
    # the device's form: on CUDA the reversed Cholesky (gptq.inverse_cholesky)
    (perm, u, _), t["ordered_inverse"] = timed(lambda: ordered_inverse(h, method.act_order, float(method.damp)))
    g = effective_group_size(method.group_size, w.shape[1])
    _, t["static_group_params_pytorch"] = timed(lambda: grouped_uniform_params(w, g, method.bits, method.sym,
                                                                                method.clip_search))
    _, t["static_group_params_kernel"] = timed(lambda: gptq_cuda.group_params(w, g, method.bits, method.sym,
                                                                               method.clip_search))
    (codes, scales, zeros, g_idx, loss), t["gptq_quantize"] = timed(lambda: gptq_quantize(
        w, u, method.bits, method.group_size, method.sym, method.act_order, method.static_groups,
        method.block_size, perm, method.clip_search))
    qt, t["pack"] = timed(lambda: UniformQuantizedTensor.from_codes(codes, scales, zeros, method.bits, g,
                                                                     method.sym, g_idx=g_idx))
    _, t["dequantize"] = timed(lambda: qt.dequantize(torch.float32))
    return t


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    method = make_method("gptq")
    rows, totals = [], {}
    for name, (k, d) in LINEARS.items():
        h, w, _ = make_layer(k, d)
        nsamples = 128
        xtx = h * (nsamples / 2.0)
        stats = {"xtx": xtx, "nsamples": nsamples, "ntokens": nsamples * 2048}
        stages(method, w, xtx, nsamples)  # warm-up: kernels built, allocator primed
        t = stages(method, w, xtx, nsamples)
        linear = torch.nn.Linear(d, k, bias=False, device="cuda", dtype=torch.bfloat16)
        linear.weight.data.copy_(w)
        _, t["engine_call"] = timed(partial(_quantize_linear, method, name, linear, stats, "cuda"))
        rows.append({"linear": name, "shape": [k, d], **{s: round(v, 4) for s, v in t.items()}})
        for s, v in t.items():
            totals[s] = totals.get(s, 0.0) + v
        del h, w, xtx, stats, linear
        torch.cuda.empty_cache()
    keys = [s for s in rows[0] if s not in ("linear", "shape")]
    print(f"{torch.cuda.get_device_name()}; seconds per stage, synchronised")
    print(f"{'linear':<10} " + " ".join(f"{s:>19}" for s in keys))
    for r in rows:
        print(f"{r['linear']:<10} " + " ".join(f"{r[s]:>19.4f}" for s in keys))
    print(f"{'layer':<10} " + " ".join(f"{totals[s]:>19.4f}" for s in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "method": "gptq (defaults)", "rows": rows,
                       "layer_total": {s: round(v, 4) for s, v in totals.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
