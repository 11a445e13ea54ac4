"""Any-precision upscaling with error feedback: every child bit chosen in GPTQ's column sweep.

At width b+1 a weight's code is 2·code_b + bit: its b-bit code is fixed by the width below, the bit is
free. The split rule (anyprec.upscale) takes the bit from the exact weighted 2-means cut of each b-bit
cluster, which minimises the sensitivity-weighted error of the weights themselves. This rule chooses it
for the layer's calibration output error L = tr((W − Ŵ)·H·(W − Ŵ)ᵀ), H = 2·XᵀX/n, as GPTQ chooses grid
points. Per width above the seed:

  start   the children of every b-bit cluster by its exact weighted 2-means cut (the split rule, on
          whatever clusters the width below left: kmeans.grouped_rows) and their weighted means, the
          (b+1)-bit table the sweep chooses from;
  sweep   GPTQ's column loop with methods/gptq.py's conventions (act-order, damping raised while the
          Cholesky factorisation fails, lazy block updates): each column, after the error feedback of the
          columns before it, takes per row the nearer of its cluster's two children, and its error goes
          through the Cholesky factor U of H⁻¹ to the columns not yet quantized. Only a weight whose own
          value lies within `band` × half the children's gap of their midpoint may follow its error-updated
          value; the others keep their nearer child. Without the band the feedback mixes the clusters
          (a child's members no longer form a run of values), which widens every cluster below it and
          costs the top widths (docs/quality-methods.md: 1.9× the split's output error at 6 bits);
  refit   the (b+1)-bit table refitted to L with the codes fixed (table_refit.py); `sweeps` − 1 more times,
          sweep again on the refitted table and refit, each kept per row where it lowers L;
  guard   per row, the swept codes or the split codes (each with its refitted table), whichever has the
          lower L with the table rounded to fp16 as stored.

The next width starts from the codes kept. Nesting holds by construction (only the new bit is chosen), so
the stored layout (bitplanes, one table per width) is the split rule's. With H diagonal there is no
feedback (U is diagonal) and the sweep takes the nearer child, which is the split: an optimal 2-means cut
puts every member at its nearer mean. The seed's codes and table are the caller's (independent SqueezeLLM).
"""

import torch

from quantkit.methods.bcq_output import output_error
from quantkit.methods.error_feedback import column_sweep
from quantkit.methods.kmeans import grouped_rows, split_runs
from quantkit.methods.table_refit import refit_table


def split_children(weight, sens, parent, table, bits):
    """The split rule on clusters of any shape: parent codes [k, d] in [0, 2^bits) with their table
    [k, 2^bits] -> (child codes [k, d] = 2·parent + bit, child table [k, 2^(bits+1)] fp64 weighted means;
    an empty child keeps its parent's entry)."""
    sr, starts = grouped_rows(weight, sens, parent, 2**bits)
    children = split_runs(sr, starts, exact=True)
    return sr.codes(children), sr.run_means(children, table.repeat_interleave(2, dim=1))


def cluster_means(weight, sens, codes, fallback, bits):
    """Weighted mean of every cluster of codes [k, d] (2^bits clusters), fallback [k, 2^bits] where empty."""
    sr, starts = grouped_rows(weight, sens, codes, 2**bits)
    return sr.run_means(starts, fallback)


def child_sweep(weight, u, perm, parent, table, block_size=128, band=None):
    """GPTQ's column loop choosing one bit per weight: weight [k, d], U = upper Cholesky factor of H⁻¹ in
    processing order, perm the processing order of the original columns (None: 0..d−1), parent codes
    [k, d], table [k, 2V] of the children (child of c: 2c, 2c+1). Each column takes per row the nearer child
    of its parent (ties to 2c) after the error feedback of the columns before it. Returns 2·parent + bit."""
    k, d = weight.shape
    dtype = u.dtype
    low = table.to(dtype).gather(1, 2 * parent)
    high = table.to(dtype).gather(1, 2 * parent + 1)
    work = weight.to(dtype).clone()
    if perm is not None:
        work, low, high = work[:, perm], low[:, perm], high[:, perm]
    # band: only a weight whose own value lies within band·(half the children's gap) of their midpoint may
    # take the child its error-updated value is nearer to; the others keep their nearer child
    fixed = None
    if band is not None:
        fixed = (work - (low + high) / 2).abs() > band * (high - low).abs() / 2
        fixed_up = (work - high).abs() < (work - low).abs()
    bit = torch.empty(k, d, dtype=torch.bool, device=weight.device)

    def nearer_child(c, col):
        up = (col - high[:, c]).abs() < (col - low[:, c]).abs()
        if fixed is not None:
            up = torch.where(fixed[:, c], fixed_up[:, c], up)
        bit[:, c] = up
        return torch.where(up, high[:, c], low[:, c])

    column_sweep(work, u, nearer_child, block_size)
    if perm is not None:
        bit = bit[:, torch.argsort(perm)]
    return 2 * parent + bit.to(parent.dtype)


def _stored_errors(weight, codes, table, h):
    """Per-row L of codes with the table as stored (fp16)."""
    return output_error(weight, table.to(torch.float16).to(weight.dtype).gather(1, codes), h)


def gptq_upscale(weight, sens, h, u, perm, seed_codes, seed_table, seed_bits, parent_bits, *, refit=True,
                 sweeps=1, band=None, block_size=128):
    """Upscale the seed (codes [k, d], table [k, 2^seed_bits]) to parent_bits by the module's rule.

    weight [k, d] (fp32 or fp64, as stored: dead columns keep their values, and with prepare_hessian's
    H_ii = 1 for them their error counts as plain weight error, so a dead input's child is still the nearer
    one), sens the k-means weights
    (broadcastable to weight), h [d, d] the Hessian the output error is measured with (original column
    order), u / perm as in child_sweep. refit: refit every table above the seed to L (else the weighted
    cluster means). Returns (parent codes int64 [k, d], {b: table [k, 2^b]} for b = seed..parent,
    {b: rows that kept the swept codes})."""
    w64 = weight.to(torch.float64)
    h64 = h.to(torch.float64)
    sens = torch.as_tensor(sens).to(device=weight.device, dtype=torch.float64).expand_as(w64)
    codes, luts, swept_rows = seed_codes.to(torch.int64), {seed_bits: seed_table}, {}
    for bits in range(seed_bits + 1, parent_bits + 1):
        split_codes, split_table = split_children(w64, sens, codes, luts[bits - 1], bits - 1)

        def fit(new_codes, start_table, bits=bits):
            if refit:
                return refit_table(w64, new_codes, start_table, h64)[0].to(torch.float64)
            return cluster_means(w64, sens, new_codes, start_table, bits)

        best_codes, best_table = split_codes, fit(split_codes, split_table)
        best_err = _stored_errors(w64, best_codes, best_table, h64)
        kept = torch.zeros(w64.shape[0], dtype=torch.bool, device=weight.device)
        table = split_table
        for _ in range(sweeps):
            swept = child_sweep(weight, u, perm, codes, table, block_size, band)
            table = fit(swept, table)
            err = _stored_errors(w64, swept, table, h64)
            better = err < best_err
            best_codes = torch.where(better[:, None], swept, best_codes)
            best_table = torch.where(better[:, None], table, best_table)
            best_err = torch.minimum(err, best_err)
            kept |= better
        codes, luts[bits] = best_codes, best_table
        swept_rows[bits] = int(kept.sum())
    return codes, luts, swept_rows
