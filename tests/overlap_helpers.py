"""Helper shared by the kernels' overlap tests (kernels/overlap.py): a chain of launches captured in
CUDA graphs with and without overlap, replayed on fresh input into poisoned outputs."""

import torch


def replay_chains(chain, x, outs, replays=3):
    """chain(flag) launches a chain of kernels from x into the tensors outs[flag], with overlap when flag.
    Each is run once (warm-up), then captured in a CUDA graph; each replay draws a fresh x, fills every
    output with NaN, replays both graphs and waits. Yields after each replay, for the caller's checks."""
    graphs = {}
    for flag in (False, True):
        chain(flag)
        torch.cuda.synchronize()
        graphs[flag] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[flag]):
            chain(flag)
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        for flag in (False, True):
            for out in outs[flag]:
                out.fill_(float("nan"))
            graphs[flag].replay()
        torch.cuda.synchronize()
        yield
