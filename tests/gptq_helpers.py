"""Helpers shared by the GPTQ and OOC tests."""

import torch

# the textbook algorithm: no act-order, dynamic groups, no clipping search (the method's defaults
# turn all three on, see BENCHMARKS.md)
PLAIN = {"act_order": False, "static_groups": False, "clip_search": False}


def hessian_stats(x, nsamples=4):
    return {"xtx": x.t() @ x, "nsamples": nsamples, "ntokens": x.shape[0]}


def correlated_inputs(n, d, gen, dtype=torch.float32):
    """Tokens from a low-rank mix plus noise, with uneven channel scales (like LLM activations)."""
    rank = max(4, d // 4)
    mix = torch.randn(rank, d, generator=gen, dtype=dtype)
    x = torch.randn(n, rank, generator=gen, dtype=dtype) @ mix + 0.3 * torch.randn(n, d, generator=gen, dtype=dtype)
    return x * torch.exp(torch.randn(d, generator=gen, dtype=dtype) * 0.5)
