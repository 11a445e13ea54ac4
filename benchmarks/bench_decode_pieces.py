"""Alternatives for the pieces of a decode step outside the linears, batch 1, Llama-2-7B attention shapes.

  python benchmarks/bench_decode_pieces.py --json $OUT/decode_pieces.json       # ~30 s on an H100

Each variant runs 32 times inside one CUDA graph (as the 32 layers of a step would), timed over graph
replays with CUDA events (median of 5); µs per call:
  attention   SDPA with an additive mask over the static cache (L cached positions, one query): its
              cudnn, efficient and math backends, a torch.compile'd expression of the same product,
              FlexAttention masked by a position tensor, and runtime.decode_attention (split over the
              cache, positions past the current one not read)
  kv write    transformers' StaticLayer.update (arange + add for the position, an add_ to its counter,
              two index_copy_), two plain index_copy_, and the two compiled together
  add + norm  the residual add then a compiled RMSNorm, against both compiled together (the fast decoder
              uses runtime.add_norm's Triton kernel instead: docs/decode-runtime.md)
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from quantkit.runtime import decode_attention as split_attention

HEADS, HEAD_DIM, HIDDEN = 32, 128, 4096


def graph_us(fn, calls=32):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (10 * calls))
    return sorted(times)[2]


def decode_attention(q, k, v, mask):  # q [1, H, 1, D], k/v [1, H, L, D], mask [1, 1, 1, L]
    scores = (k.float() * q.float()).sum(-1, keepdim=True).transpose(-1, -2) * HEAD_DIM**-0.5 + mask.float()
    p = torch.softmax(scores, dim=-1)
    return (p.transpose(-1, -2) * v.float()).sum(-2, keepdim=True).to(q.dtype)


def write_kv(keys, values, k, v, position):
    keys.index_copy_(2, position, k)
    values.index_copy_(2, position, v)


def rms_norm(h, w, eps=1e-5):
    dtype = h.dtype
    h = h.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def add_rms_norm(x, residual, w):
    s = x + residual
    return rms_norm(s, w), s


def attention_rows(lengths):
    rows = []
    compiled = torch.compile(decode_attention, dynamic=False)
    for length in lengths:
        q = torch.randn(1, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.float16)
        k = torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        mask = torch.zeros(1, 1, 1, length, device="cuda", dtype=torch.float16)
        mask[..., length // 2 + 1 :] = torch.finfo(torch.float16).min
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
        for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa math", SDPBackend.MATH)):
            try:
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    us = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            except RuntimeError as exc:  # a backend this build or device lacks
                rows.append({"piece": "attention", "cached": length, "variant": name, "error": str(exc)[:120]})
                continue
            rows.append({"piece": "attention", "cached": length, "variant": name, "us": us,
                         "max_abs_err": (out.float() - want).abs().max().item()})
        out = compiled(q, k, v, mask)
        rows.append({"piece": "attention", "cached": length, "variant": "torch.compile", "us":
                     graph_us(lambda: compiled(q, k, v, mask)), "max_abs_err": (out.float() - want).abs().max().item()})
        rows.append(flex_row(q, k, v, length, want))
        if split_attention.available():
            position = torch.tensor([[length // 2]], device="cuda")  # the mask's last kept position
            counters = split_attention.counters(1, HEADS, "cuda")

            def split():
                return split_attention.decode(q, k, v, position, HEAD_DIM**-0.5, counters)

            out = split().transpose(1, 2)
            rows.append({"piece": "attention", "cached": length, "variant": "split (decode_attention)",
                         "us": graph_us(split), "max_abs_err": (out.float() - want).abs().max().item()})
    return rows


def flex_row(q, k, v, length, want):
    """FlexAttention (its split-KV decoding kernel for short queries), masked by a position tensor."""
    from torch.nn.attention.flex_attention import flex_attention

    position = torch.tensor([length // 2], device="cuda")

    def causal(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= position[0], score, -float("inf"))

    flex = torch.compile(flex_attention, dynamic=False)
    try:
        out = flex(q, k, v, score_mod=causal)
        us = graph_us(lambda: flex(q, k, v, score_mod=causal))
    except Exception as exc:  # inductor or triton missing or unable
        return {"piece": "attention", "cached": length, "variant": "flex_attention", "error": str(exc)[:120]}
    return {"piece": "attention", "cached": length, "variant": "flex_attention", "us": us,
            "max_abs_err": (out.float() - want).abs().max().item()}


def kv_write_rows(length):
    keys = torch.zeros(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.float16)
    values = torch.zeros_like(keys)
    k = torch.randn(1, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    position = torch.tensor([5], device="cuda")
    counter = torch.tensor(0, device="cuda")

    def transformers_update():  # StaticLayer.update's ops; the counter advanced by 0 to stay in range
        cache_position = torch.arange(1, device="cuda") + counter
        counter.add_(0)
        keys.index_copy_(2, cache_position, k)
        values.index_copy_(2, cache_position, v)

    compiled = torch.compile(write_kv, dynamic=False)
    return [{"piece": "kv write", "variant": "transformers StaticLayer.update", "us": graph_us(transformers_update)},
            {"piece": "kv write", "variant": "two index_copy_",
             "us": graph_us(lambda: write_kv(keys, values, k, v, position))},
            {"piece": "kv write", "variant": "torch.compile",
             "us": graph_us(lambda: compiled(keys, values, k, v, position))}]


def norm_rows():
    x = torch.randn(1, 1, HIDDEN, device="cuda", dtype=torch.float16)
    residual = torch.randn_like(x)
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.float16)
    norm, fused = torch.compile(rms_norm, dynamic=True), torch.compile(add_rms_norm, dynamic=True)
    return [{"piece": "add + norm", "variant": "add, compiled RMSNorm", "us": graph_us(lambda: norm(x + residual, w))},
            {"piece": "add + norm", "variant": "compiled together", "us": graph_us(lambda: fused(x, residual, w))}]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cached", default="256,1152", help="static cache lengths for attention [%(default)s]")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    rows = attention_rows([int(n) for n in args.cached.split(",")]) + kv_write_rows(256) + norm_rows()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per call, 32 calls per CUDA graph")
    for r in rows:
        where = f" L={r['cached']}" if "cached" in r else ""
        value = f"{r['us']:7.2f} us" if "us" in r else f"failed: {r['error']}"
        err = f"  max abs err {r['max_abs_err']:.1e}" if "max_abs_err" in r else ""
        print(f"{r['piece'] + where:16s} {r['variant']:32s} {value}{err}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
