"""GPTQ's column loop with a pluggable rounding rule, for the methods that run it on grids of their own
(output-aware BCQ, OOC's two-tier grids, the gptq upscaling of any-precision). methods/gptq.py keeps its own
loop: its groups' parameters are made inside it.

Columns are taken in processing order; each column's rounding error, divided by the diagonal entry of the
upper Cholesky factor U of H⁻¹, goes to the columns not yet quantized through that row of U: at once inside
a block of `block_size` columns, once per block (one matmul) beyond it."""

import torch


def column_sweep(work: torch.Tensor, u: torch.Tensor, round_column, block_size: int = 128):
    """work [k, d]: the weights in processing order (updated in place by the feedback); u [d, d] in the same
    order. round_column(c, col) gets column c's error-updated values [k] and returns the values it is
    quantized to [k] (recording its choice itself)."""
    d = work.shape[1]
    for i1 in range(0, d, block_size):
        i2 = min(i1 + block_size, d)
        w1 = work[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            e = (col - round_column(i1 + i, col)) / u1[i, i]
            w1[:, i:].addr_(e, u1[i, i:], alpha=-1)
            err1[:, i] = e
        work[:, i2:].addmm_(err1, u[i1:i2, i2:], alpha=-1)
