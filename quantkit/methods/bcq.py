"""Group-wise binary-coding quantization (nuQmm §III.A, LUT-GEMM §3.3).

Per group of g consecutive input weights of a row, w ≈ Σ_{i<q} α_i·b_i (+ z). Two solvers:
  output (default): minimises the calibration output error inside GPTQ's column sweep
      (methods/bcq_output.py);
  weight: minimises ‖w − ŵ‖² (nuQmm eq. 1), below.

Weight-error solver (Xu et al., 2018): greedy initialisation (z = group mean if offset; then for i = 1..q:
b_i = sign(r), α_i = mean|r|, r −= α_i·b_i), then alternating rounds:
  1. given the codes B, solve [α; z] by least squares (per-group normal equations BᵀB x = Bᵀw);
  2. given α and z, give each weight the nearest of the 2^q representable values Σ α_i·s_i + z.
A group takes a round's solution only if its error falls (the solve's tiny ridge or ties could
nudge it up), so the total error is non-increasing; rounds stop early once it stops falling.
Everything is batched over all [k, G] groups of the matrix: groups are padded to g columns
and a mask keeps the padding of a partial last group out of every sum.
"""

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.bcq import BCQQuantizedTensor
from quantkit.formats.uniform import num_groups
from quantkit.methods.base import Method, effective_group_size, register_method
from quantkit.methods.bcq_output import output_bcq_fit
from quantkit.methods.configs import BCQConfig
from quantkit.methods.gptq import ordered_inverse, prepare_hessian

_STOP_REL = 1e-6  # a round that lowers the error by less than this fraction ends the solve
_RIDGE = 1e-9  # relative ridge (fp64 solve): keeps the normal equations solvable when planes coincide


@dataclass
class BCQFit:
    signs: torch.Tensor  # bool [q, k, d], True = +1
    alpha: torch.Tensor  # fp32 [k, G, q], fp16-representable, ≥ 0
    offset: torch.Tensor  # fp32 [k, G], fp16-representable, or None
    group_size: int
    history: list  # total squared error: greedy, then after each alternating round (fp32 α, z)
    error: float  # total squared error of the stored (fp16) α, z and their nearest codes
    norm: float  # ‖W‖², for relative errors


def _sign_table(q, device):
    """[2^q, q] ±1: row c is the code of value index c (bit i of c set -> plane i is +1)."""
    c = torch.arange(2**q, device=device)
    return (((c[:, None] >> torch.arange(q, device=device)) & 1) * 2 - 1).to(torch.float32)


def _values(alpha, z, table):
    """The 2^q representable values of every group [k, G, 2^q]; index c has code table[c]."""
    return alpha @ table.t() + z.unsqueeze(-1)


def _group_error(Wg, M, idx, values):
    """Squared error per group [k, G]. Wg [k, G, g], M [G, g], idx [k, G, g] value indices."""
    return ((Wg - values.gather(-1, idx)) ** 2 * M).sum(-1)


def _nearest(Wg, values):
    """Index [k, G, g] of the representable value nearest each weight (bucketing by midpoints)."""
    values, order = values.sort(-1)
    mids = (values[..., 1:] + values[..., :-1]) / 2
    return order.gather(-1, torch.searchsorted(mids, Wg))


def _least_squares(Wg, M, idx, table, offset):
    """Per-group LS fit of α (and z) for fixed codes: returns alpha [k, G, q], z [k, G].

    The normal equations only need, per group, how many weights use each of the 2^q codes (H)
    and their sum (S): BᵀB = Xᵀ diag(H) X and Bᵀw = Xᵀ S, with X the code table (plus a ones
    column for the offset). So one scatter over the weights replaces [k, G, g, q] products.
    """
    k, G, _ = Wg.shape
    V, q = table.shape
    H = torch.zeros(k, G, V, device=Wg.device).scatter_add_(-1, idx, M.expand_as(Wg).contiguous())
    S = torch.zeros(k, G, V, device=Wg.device).scatter_add_(-1, idx, Wg * M)
    X = torch.cat([table, torch.ones(V, 1, device=table.device)], 1) if offset else table  # [V, p]
    gram = (X.t() @ (H.unsqueeze(-1) * X)).double()  # [k, G, p, p]
    rhs = (S @ X).double()  # [k, G, p]
    eye = torch.eye(X.shape[1], dtype=gram.dtype, device=gram.device)
    gram = gram + _RIDGE * M.sum(-1).double()[:, None, None] * eye
    sol = torch.linalg.solve(gram, rhs.unsqueeze(-1)).squeeze(-1).float()
    return sol[..., :q], (sol[..., q] if offset else torch.zeros_like(sol[..., 0]))


def bcq_fit(weight, bits, group_size, offset=False, rounds=15) -> BCQFit:
    """Greedy + alternating BCQ of `weight` [k, d] (fp32, any device), batched over all groups."""
    if not torch.isfinite(weight).all():
        raise QuantkitError("BCQ: the weight contains NaN or Inf")
    k, d = weight.shape
    g = effective_group_size(group_size, d)
    G = num_groups(d, g)
    dev = weight.device
    Wg = torch.nn.functional.pad(weight.to(torch.float32), (0, G * g - d)).reshape(k, G, g)
    M = (torch.arange(G * g, device=dev) < d).reshape(G, g).to(torch.float32)  # 0 on padding
    count = M.sum(-1)  # [G]
    table = _sign_table(bits, dev)

    # greedy initialisation (Guo et al. 2017, as used by Xu et al. 2018); codes kept as value
    # indices idx (bit i of idx set <=> b_i = +1)
    z = (Wg * M).sum(-1) / count if offset else torch.zeros(k, G, device=dev)
    r = (Wg - z.unsqueeze(-1)) * M
    idx = torch.zeros(k, G, g, dtype=torch.int64, device=dev)
    alphas = []
    for i in range(bits):
        plus = r >= 0
        a = r.abs().sum(-1) / count
        r = (r - a.unsqueeze(-1) * torch.where(plus, 1.0, -1.0)) * M
        idx |= plus.to(torch.int64) << i
        alphas.append(a)
    alpha = torch.stack(alphas, -1)
    err = _group_error(Wg, M, idx, _values(alpha, z, table))
    history = [err.sum().item()]

    for _ in range(rounds):
        new_alpha, new_z = _least_squares(Wg, M, idx, table, offset)
        values = _values(new_alpha, new_z, table)
        new_idx = _nearest(Wg, values)
        new_err = _group_error(Wg, M, new_idx, values)
        keep = new_err < err  # per-group guard: the error never rises (ties keep the simpler old fit)
        alpha = torch.where(keep.unsqueeze(-1), new_alpha, alpha)
        z = torch.where(keep, new_z, z)
        idx = torch.where(keep.unsqueeze(-1), new_idx, idx)
        err = torch.minimum(new_err, err)
        history.append(err.sum().item())
        if history[-2] - history[-1] <= _STOP_REL * history[-2]:
            break

    # store fp16, with α ≥ 0 ((α, b) and (−α, −b) are the same term), then re-pick the codes so
    # they are the nearest ones for the stored values
    alpha = alpha.abs().half().float()
    z = z.half().float()
    values = _values(alpha, z, table)
    idx = _nearest(Wg, values)
    final = _group_error(Wg, M, idx, values).sum().item()
    planes = torch.arange(bits, device=dev)[:, None, None, None]
    signs = ((idx.unsqueeze(0) >> planes) & 1).bool().reshape(bits, k, G * g)[:, :, :d]
    return BCQFit(signs=signs, alpha=alpha, offset=z if offset else None, group_size=g, history=history,
                  error=final, norm=(weight.to(torch.float32) ** 2).sum().item())


def weight_start(bits, group_size, offset, rounds):
    """w -> (α, z, value indices) of the weight-error fit: the output-aware solver's other start."""

    def fit(weight):
        f = bcq_fit(weight, bits, group_size, offset, rounds)
        shifts = torch.arange(bits, device=weight.device)[:, None, None]
        idx = (f.signs.to(torch.int64) << shifts).sum(dim=0)
        z = f.offset if offset else torch.zeros_like(f.alpha[..., 0])
        return f.alpha, z, idx

    return fit


@register_method(BCQConfig)
class BCQ(Method):
    output_format = "bcq"  # what quantize() returns; the pipeline refuses --format uniform for it

    @property
    def stats(self):
        return ("hessian",) if self.solver == "output" else ()

    def quantize(self, weight, stats):
        if self.solver == "output":
            return self._quantize_output(weight, stats)
        fit = bcq_fit(weight, self.bits, self.group_size, self.offset, self.rounds)
        qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, fit.offset, fit.group_size)
        norm = max(fit.norm, 1e-30)
        # errors relative to ‖W‖²: greedy start, and the stored result
        return qt, {"bcq_rounds": len(fit.history) - 1, "bcq_greedy_error": fit.history[0] / norm,
                    "bcq_error": fit.error / norm}

    def _quantize_output(self, weight, stats):
        if not torch.isfinite(weight).all():
            raise QuantkitError("BCQ: the weight contains NaN or Inf")
        h, w = prepare_hessian(stats["xtx"], stats["nsamples"], weight)
        perm, u, damp = ordered_inverse(h, self.act_order, float(self.damp))
        fit = output_bcq_fit(w, h, u, perm, self.bits, self.group_size, self.offset, self.block_size, self.refits,
                             self.clip_search, self.init, weight_start(self.bits, self.group_size, self.offset,
                                                                       self.rounds))
        qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, fit.offset, fit.group_size)
        norm = max(fit.norm, 1e-30)
        # output errors relative to tr(W H Wᵀ): after the start's first sweep, and the stored result
        return qt, {"damp": damp, "bcq_start": fit.start, "bcq_rounds": len(fit.history) - 1,
                    "bcq_start_output_error": fit.history[0] / norm, "bcq_output_error": fit.error / norm}
