"""Output-aware refit of per-row lookup tables (SqueezeLLM / any-precision), codes fixed.

k-means fits each row's table to a diagonal weighting of the error (the sensitivity). Given the codes,
the table that minimises the calibration output error of the row instead,

    min_t (w_r − O_r t)·H·(w_r − O_r t)ᵀ,   O_r [d, 2^b] one-hot of the row's codes,   H = 2·XᵀX/n,

solves (O_rᵀ H O_r) t = O_rᵀ H w_r: M[u, v] = Σ over the row's columns coded u and v of H. Storage is
unchanged (a table per width is stored anyway), so every width of an any-precision artifact gets its own
refit. A small ridge pulls each entry towards its k-means value (relative weight RIDGE of the mean
diagonal), which keeps an unused code's entry where it was and the system solvable. A row keeps its
refitted table only if, rounded to fp16 as stored, it lowers that row's output error.
"""

import torch

RIDGE = 1e-6
_CHUNK = 1 << 23  # elements of the [rows, d, 2^b] intermediate per row chunk


def refit_table(weight, codes, table, h):
    """weight [k, d] (float), codes [k, d] int in [0, V), table [k, V], h [d, d] -> (table [k, V] fp32,
    fp16-representable; rows refitted [k] bool)."""
    k, d = weight.shape
    V = table.shape[1]
    dtype = torch.float64
    h = h.to(dtype)
    w = weight.to(dtype)
    old = table.to(dtype)
    codes = codes.to(torch.int64)
    new = torch.empty_like(old)
    wh = w @ h
    step = max(1, _CHUNK // (d * V))
    for r0 in range(0, k, step):
        c = codes[r0 : r0 + step]
        n = c.shape[0]
        # per_col[r, x, v] = Σ_{y coded v} H[x, y]; gram[r, u, v] = Σ_{x coded u} per_col[r, x, v]
        per_col = torch.zeros(n, d, V, dtype=dtype, device=w.device)
        per_col.scatter_add_(2, c[:, None, :].expand(n, d, d), h.expand(n, d, d))
        gram = torch.zeros(n, V, V, dtype=dtype, device=w.device)
        gram.scatter_add_(1, c[:, :, None].expand(n, d, V), per_col)
        rhs = torch.zeros(n, V, dtype=dtype, device=w.device).scatter_add_(1, c, wh[r0 : r0 + step])
        lam = RIDGE * torch.diagonal(gram, dim1=1, dim2=2).mean(dim=1).clamp_min(1e-30)
        eye = torch.eye(V, dtype=dtype, device=w.device)
        sol = torch.linalg.solve(gram + lam[:, None, None] * eye, (rhs + lam[:, None] * old[r0 : r0 + step])[..., None])
        new[r0 : r0 + step] = sol[..., 0]
    new = new.to(torch.float16).to(dtype)
    before = _row_errors(w, old.to(torch.float16).to(dtype).gather(1, codes), h)
    after = _row_errors(w, new.gather(1, codes), h)
    better = torch.isfinite(after) & (after < before)
    return torch.where(better[:, None], new, old).float(), better


def _row_errors(w, w_hat, h):
    delta = w - w_hat
    return ((delta @ h) * delta).sum(dim=1)
