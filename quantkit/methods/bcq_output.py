"""Output-aware BCQ: binary codes chosen inside GPTQ's column sweep, scales refitted on the output error.

The weight-error solver (methods/bcq.py, `bcq_fit`) minimises ‖W − Ŵ‖² group by group; this one minimises
the calibration output error of the layer, as ShiftAddLLM does for multi-bit BCQ:

    L(Ŵ) = tr((W − Ŵ)·H·(W − Ŵ)ᵀ) = Σ_r Δ_r H Δ_rᵀ,   H = 2·XᵀX/n   (gptq.prepare_hessian),

a sum over output rows that are independent of each other given H. Each group (row r, columns
j·g .. j·g+g−1, the last one possibly partial) has q scales α ≥ 0 and optionally an offset z, so its
2^q representable values are Σ_i α_i·s_i + z, s ∈ {−1, +1}^q. Three steps:

  start   every group's α (and z) from the original weights, before any column is quantized (GPTQ's
          static groups), in fp16. The default start is the uniform grid of the default GPTQ: the
          clip-searched asymmetric scale s and integer zero z_u give α_i = 2^(i−1)·s and
          z = s·((2^q − 1)/2 − z_u) (LUT-GEMM appendix C: a q-bit uniform grid is a BCQ grid), so the
          first sweep is GPTQ at q bits with act-order, static groups and clip search, up to the fp16
          rounding of z. Without an offset the grid must be symmetric about 0: the midrise grid
          (c − (2^q − 1)/2)·s, c = 0..2^q−1, with the same clipping search. The other start is the
          weight-error solver's fit (its α, z and codes).
  sweep   given α, z: GPTQ's column loop (act-order, lazy block updates, damping with retries) where
          each column takes, per row, the nearest of its group's representable values and its error
          is pushed through the Cholesky factor of H⁻¹ onto the columns not yet quantized.
  refit   given the codes: per row, the least-squares α, z of all its groups together under H
          (normal equations Aᵀ H A θ = Aᵀ H w_r, A = the row's sign planes and ones, one column per
          group and plane: (q + offset)·G unknowns). A negative α_i flips plane i of that group
          ((α, b) and (−α, −b) are the same term), so the stored α stay ≥ 0 as the format states;
          then α, z are rounded to fp16, and L is measured with the rounded values.
A round is refit then sweep, `rounds` times, and one last refit. Every step is kept per row only
where it lowers that row's L (measured with the fp16 values the artifact stores), so L never rises
from the start; with init="best" both starts run and every row keeps the better one.

With H ∝ I the sweep has no error feedback (U is diagonal), so it gives exactly the nearest codes,
and the refit decouples into the per-group least squares of the weight-error solver: the two solvers
then take the same steps, up to the order of floating-point sums and the guard (per row here, per
group there).
"""

from dataclasses import dataclass

import torch

from quantkit.formats.uniform import CLIP_GRID, CLIP_MAX_SHRINK, CLIP_NORM, MIN_SCALE, num_groups, uniform_params
from quantkit.methods.base import effective_group_size
from quantkit.methods.error_feedback import column_sweep

_STOP_REL = 1e-7  # a round that lowers the total error by less than this fraction ends the alternation
_RIDGE = 1e-9  # relative ridge of the refit's normal equations (planes can coincide inside a group)
_CHUNK = 1 << 25  # elements of the refit's [rows, planes, G, d] intermediate per row chunk


@dataclass
class OutputBCQFit:
    signs: torch.Tensor  # bool [q, k, d], True = +1
    alpha: torch.Tensor  # fp32 [k, G, q], fp16-representable, ≥ 0
    offset: torch.Tensor  # fp32 [k, G], fp16-representable, or None
    group_size: int
    history: list  # total L of the first start, after each round and the last refit (+ the per-row best of both)
    error: float  # L of the stored result
    norm: float  # tr(W H Wᵀ), for relative errors
    start: str  # which start won most rows ("uniform" or "weight")


def _to_fp16(t):
    return t.half().float()


def uniform_start(w, bits, g, offset, clip_search):
    """α [k, G, q] and z [k, G] (fp16-representable) of the uniform grids of w's groups (module notes)."""
    k, d = w.shape
    G = num_groups(d, g)
    pow2 = torch.exp2(torch.arange(bits, device=w.device, dtype=w.dtype) - 1)
    scale = torch.empty(k, G, dtype=w.dtype, device=w.device)
    z = torch.zeros_like(scale)
    for j in range(G):
        group = w[:, j * g : (j + 1) * g]
        if offset:
            s, zu = uniform_params(group, bits, False, clip_search)
            scale[:, j], z[:, j] = s, s * ((2**bits - 1) / 2 - zu)
        else:
            scale[:, j] = midrise_scale(group, bits, clip_search)
    return _to_fp16(scale.unsqueeze(-1) * pow2), _to_fp16(z)


def midrise_scale(w, bits, clip_search):
    """Step s (fp16) per row of the symmetric grid (c − (2^q − 1)/2)·s that spans max|w|, or, with
    clip_search, the shrunk span minimising Σ|w − q(w)|^2.4 (the uniform clipping search's rule)."""
    levels = 2**bits
    peak = w.abs().amax(dim=1)
    peak = torch.where(peak == 0, torch.ones_like(peak), peak)

    def step(shrink):
        return (shrink * peak * 2 / (levels - 1)).clamp_min(MIN_SCALE).to(torch.float16).to(w.dtype)

    scale = step(1.0)
    if not clip_search:
        return scale
    best = torch.full_like(scale, float("inf"))
    for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
        s = step(1 - i / CLIP_GRID)
        q = (torch.floor(w / s[:, None]).clamp(-levels // 2, levels // 2 - 1) + 0.5) * s[:, None]
        err = (q - w).abs().pow(CLIP_NORM).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s, scale)
    return scale


def sign_table(bits, device, dtype=torch.float32):
    """[2^q, q] ±1: row c is the code of value index c (bit i of c set -> plane i is +1)."""
    c = torch.arange(2**bits, device=device)
    return (((c[:, None] >> torch.arange(bits, device=device)) & 1) * 2 - 1).to(dtype)


def grid_values(alpha, z, bits):
    """The 2^q representable values [k, G, 2^q] of every group; index c has the code sign_table[c]."""
    return alpha @ sign_table(bits, alpha.device, alpha.dtype).t() + z.unsqueeze(-1)


def reconstruct(values, idx, g):
    """Ŵ [k, d] from the group values [k, G, V] and value indices idx [k, d]."""
    k, G, V = values.shape
    col_group = torch.arange(idx.shape[1], device=idx.device) // g
    return values.reshape(k, G * V).gather(1, col_group * V + idx)


def output_error(w, w_hat, h):
    """Per-row L: Δ_r H Δ_rᵀ, [k]."""
    delta = w - w_hat
    return ((delta @ h) * delta).sum(dim=1)


def sweep(w, u, perm, values, g, block_size):
    """GPTQ's column loop on a fixed grid: every weight takes the nearest value of its group's grid
    values [k, G, V] after the error feedback of the columns before it. u: upper Cholesky factor of
    H⁻¹ in processing order; perm: processing order of the original columns (None: 0..d−1).
    Returns the value indices [k, d] in original column order."""
    k, d = w.shape
    ordered, order = values.sort(dim=-1)
    mids = (ordered[..., 1:] + ordered[..., :-1]) / 2
    work = w.clone() if perm is None else w[:, perm]
    cols = torch.arange(d, device=w.device) if perm is None else perm
    col_group = (cols // g).tolist()
    idx = torch.empty(k, d, dtype=torch.int64, device=w.device)

    def nearest(c, col):
        j = col_group[c]
        pos = (mids[:, j] < col[:, None]).sum(dim=1, keepdim=True)  # as searchsorted: ties go down
        idx[:, c] = order[:, j].gather(1, pos).squeeze(1)
        return ordered[:, j].gather(1, pos).squeeze(1)

    column_sweep(work, u, nearest, block_size)
    if perm is not None:
        idx = idx[:, torch.argsort(perm)]
    return idx


def refit(w, h, idx, bits, g, offset):
    """Least-squares α [k, G, q] and z [k, G] for the codes idx [k, d] under H (module notes), with
    negative α folded into their planes: returns (alpha ≥ 0, z, idx) with α, z rounded to fp16."""
    k, d = w.shape
    G = num_groups(d, g)
    pad = G * g - d
    shifts = torch.arange(bits, device=w.device)
    planes = (((idx.unsqueeze(1) >> shifts[:, None]) & 1) * 2 - 1).to(w.dtype)  # [k, q, d]
    if offset:
        planes = torch.cat([planes, torch.ones(k, 1, d, dtype=w.dtype, device=w.device)], dim=1)
    m = planes.shape[1]
    E = torch.nn.functional.pad(planes, (0, pad)).reshape(k, m, G, g)  # padding columns: 0, no effect
    hp = torch.nn.functional.pad(h, (0, pad, 0, pad)).reshape(G, g, G * g)
    wh = torch.nn.functional.pad(w @ h, (0, pad)).reshape(k, G, g)
    rhs = torch.einsum("rijt,rjt->rij", E, wh).reshape(k, m * G)
    # each chunk of rows builds, regularises and solves its own normal equations, so memory holds one
    # chunk's [m·G, m·G] systems, never all k of them (a 70B down_proj at q = 3 would need ~30 GB)
    sol = torch.empty(k, m * G, dtype=w.dtype, device=w.device)
    step = max(1, min(_CHUNK // (m * G * G * g), _CHUNK // (m * G) ** 2))
    for r0 in range(0, k, step):
        e = E[r0 : r0 + step]
        t = torch.einsum("rijt,jtc->rijc", e, hp).reshape(e.shape[0], m, G, G, g)  # Σ_{t∈j} E_i[t]·H[t, c]
        gram = torch.einsum("rijJt,rlJt->rijlJ", t, e).reshape(e.shape[0], m * G, m * G).double()
        diag = torch.diagonal(gram, dim1=1, dim2=2)
        ridge = _RIDGE * diag.mean(dim=1).clamp_min(1e-30)
        gram.diagonal(dim1=1, dim2=2).add_(ridge[:, None])
        sol[r0 : r0 + step] = torch.linalg.solve(gram, rhs[r0 : r0 + step].double().unsqueeze(-1)).squeeze(-1)
    sol = sol.reshape(k, m, G)
    alpha = sol[:, :bits].transpose(1, 2)  # [k, G, q]
    z = sol[:, bits] if offset else torch.zeros(k, G, dtype=w.dtype, device=w.device)
    negative = alpha < 0
    flips = (negative.to(torch.int64) << shifts).sum(dim=-1)  # [k, G]: planes to flip in each group
    idx = idx ^ flips[:, torch.arange(d, device=w.device) // g]
    return _to_fp16(alpha.abs()), _to_fp16(z), idx


def _alternate(w, h, u, perm, bits, g, offset, block_size, rounds, alpha, z, idx, history):
    """Refit / sweep rounds from (α, z, idx), each step kept per row where it lowers L. Returns the final
    (α, z, idx, per-row L)."""
    err = output_error(w, reconstruct(grid_values(alpha, z, bits), idx, g), h)
    history.append(err.sum().item())

    def keep(new_alpha, new_z, new_idx):
        nonlocal alpha, z, idx, err
        new_err = output_error(w, reconstruct(grid_values(new_alpha, new_z, bits), new_idx, g), h)
        better = torch.isfinite(new_err) & (new_err < err)
        alpha = torch.where(better[:, None, None], new_alpha, alpha)
        z = torch.where(better[:, None], new_z, z)
        idx = torch.where(better[:, None], new_idx, idx)
        err = torch.where(better, new_err, err)

    for _ in range(rounds):
        before = err.sum().item()
        keep(*refit(w, h, idx, bits, g, offset))
        keep(alpha, z, sweep(w, u, perm, grid_values(alpha, z, bits), g, block_size))
        history.append(err.sum().item())
        if before - history[-1] <= _STOP_REL * before:
            break
    keep(*refit(w, h, idx, bits, g, offset))
    history.append(err.sum().item())
    return alpha, z, idx, err


def output_bcq_fit(w, h, u, perm, bits, group_size, offset, block_size=128, rounds=4, clip_search=True,
                   init="uniform", weight_fit=None) -> OutputBCQFit:
    """Output-aware BCQ of w [k, d] (dead columns already zeroed, gptq.prepare_hessian) under H [d, d];
    u = upper Cholesky factor of (damped H)⁻¹ in the processing order perm (act-order) or None.
    init: "uniform", "weight" or "best" (both, per-row winner); weight_fit(w) -> (alpha, z, idx)
    provides the weight-error solver's start."""
    k, d = w.shape
    g = effective_group_size(group_size, d)
    starts = []
    if init in ("uniform", "best"):
        alpha, z = uniform_start(w, bits, g, offset, clip_search)
        starts.append(("uniform", alpha, z, sweep(w, u, perm, grid_values(alpha, z, bits), g, block_size)))
    if init in ("weight", "best"):
        starts.append(("weight", *weight_fit(w)))
    results, histories = [], []
    for _, alpha, z, idx in starts:
        history = []
        results.append(_alternate(w, h, u, perm, bits, g, offset, block_size, rounds, alpha, z, idx, history))
        histories.append(history)
    alpha, z, idx, err = results[0]
    wins = torch.zeros(k, dtype=torch.bool, device=w.device)
    if len(results) > 1:
        a2, z2, idx2, err2 = results[1]
        wins = err2 < err
        alpha = torch.where(wins[:, None, None], a2, alpha)
        z = torch.where(wins[:, None], z2, z)
        idx = torch.where(wins[:, None], idx2, idx)
        err = torch.where(wins, err2, err)
    start = starts[int(wins.sum().item() * 2 > k)][0] if len(starts) > 1 else starts[0][0]
    shifts = torch.arange(bits, device=w.device)
    signs = ((idx.unsqueeze(0) >> shifts[:, None, None]) & 1).bool()
    norm = output_error(w, torch.zeros_like(w), h).sum().item()
    history = histories[0] + ([err.sum().item()] if len(histories) > 1 else [])
    return OutputBCQFit(signs=signs, alpha=alpha, offset=z if offset else None, group_size=g, history=history,
                        error=err.sum().item(), norm=norm, start=start)
