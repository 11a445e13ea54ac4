"""Helper shared by the kernels' overlap tests (kernels/overlap.py): a chain of launches run with and
without overlap, eagerly and captured in CUDA graphs, on fresh input into poisoned outputs."""

import torch

from machine import require


def replay_chains(chain, x, outs, replays=3):
    """chain(flag) launches a chain of kernels from x into the tensors outs[flag], with overlap when flag.
    Both chains run eagerly once, then are captured in CUDA graphs and replayed `replays` times; before
    each run x is drawn afresh and every output filled with NaN. Yields after each run (eager first),
    once both chains have finished, for the caller's checks. Skips below compute capability 9.0, where
    launches never overlap."""
    with torch.cuda.device(x.device):
        require("sm90")

    def fresh():
        x.copy_(torch.randn_like(x))
        for out in outs[False] + outs[True]:
            out.fill_(float("nan"))

    fresh()
    for flag in (False, True):
        chain(flag)
    torch.cuda.synchronize()
    yield
    graphs = {}
    for flag in (False, True):
        graphs[flag] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[flag]):
            chain(flag)
    for _ in range(replays):
        fresh()
        for flag in (False, True):
            graphs[flag].replay()
        torch.cuda.synchronize()
        yield
