"""GPTQ (Frantar et al., 2022): column-by-column quantization with Hessian-based error feedback.

For a linear with inputs X, H = 2·XᵀX/nsamples. Columns are quantized in order; the rounding
error of column i, divided by the i-th diagonal entry of the upper Cholesky factor U of H⁻¹,
is spread over the not-yet-quantized columns through row i of U (the OBS update). Updates are
applied lazily: inside a block of `block_size` columns immediately, to the columns after the
block once per block (one matmul), which gives the same result as updating everything at once.

Groups: a group's scale/zero are computed when its first column is reached, from the *current*
(error-updated) weights of the whole group — also when the group runs past the current block,
whose pending updates are then applied to those columns first. The reference code instead reads
W as it stood at the start of the block (without the updates of the block's earlier columns), so
for groups that start inside a block (g not a multiple of block_size, e.g. g = 32 with blocks of
128) its parameters come from stale weights and its results depend on the block size; ours do
not. When every group starts a block (the usual g = 128, block 128) the two are identical.

act_order processes columns by descending H_ii. Codes are always stored in the original column
order. Without static groups a group is a run of g consecutive *processed* columns, so the
artifact carries g_idx (column -> group). With static_groups every group's scale/zero come up
front from the original weights in original column order, so group = column // g and no g_idx
is stored (it would be redundant, and the plain layout keeps the fast kernel path).
"""

import logging
import weakref

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.uniform import (
    UniformQuantizedTensor,
    num_groups,
    quantize_codes,
    uniform_params,
)
from quantkit.kernels import gptq_cuda
from quantkit.methods.base import Method, effective_group_size, register_method
from quantkit.methods.configs import GPTQConfig
from quantkit.methods.rtn import group_params

log = logging.getLogger(__name__)

DAMP_RETRIES = 4  # each retry multiplies the damping by 10


def prepare_hessian(xtx, nsamples, weight):
    """H = 2·xtx/nsamples on the weight's device and dtype; dead inputs (H_ii = 0) get H_ii = 1
    and their weight column zeroed (no calibration token ever used them). Returns (H, W) copies."""
    if nsamples < 1:
        raise QuantkitError("gptq needs calibration statistics from at least one sample")
    h = xtx.to(device=weight.device, dtype=weight.dtype) * (2.0 / nsamples)
    w = weight.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    return h, w


def inverse_cholesky(h, damp):
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp·mean(diag H); when a factorisation fails
    (H indefinite or too ill-conditioned for the dtype), retry with damp ×10. Returns (U, damp used).
    On the CPU by the reference's three factorisations, on CUDA by the reversed Cholesky (half the time:
    docs/gptq-kernel.md)."""
    mean_diag = torch.diagonal(h).mean()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    factor = reversed_cholesky_factor if h.is_cuda else three_factorisations_factor
    for attempt in range(DAMP_RETRIES + 1):
        upper = factor(h + (damp * mean_diag) * eye)
        if upper is not None and torch.isfinite(upper).all():
            if attempt:
                log.warning("gptq: Cholesky factorisation needed damp=%g", damp)
            return upper, damp
        damp *= 10
    raise QuantkitError(f"gptq: Hessian is not positive definite even with damp={damp / 10:g}; "
                        "check the calibration data or raise --damp")


def three_factorisations_factor(a):
    """U upper with UᵀU = A⁻¹ as the GPTQ reference computes it: L = chol(A), A⁻¹ from L, U = chol(A⁻¹, upper).
    None where a factorisation fails."""
    lower, info = torch.linalg.cholesky_ex(a)
    if info.item():
        return None
    upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    return None if info.item() else upper


def reversed_cholesky_factor(a):
    """The same U with one factorisation and one triangular inverse: with J the reversal of the indices,
    chol(J A J) = L' gives A⁻¹ = J L'⁻ᵀ L'⁻¹ J = (J L'⁻¹ J)ᵀ (J L'⁻¹ J), and J L'⁻¹ J is upper triangular with a
    positive diagonal, so it is U. None where the factorisation fails."""
    lower, info = torch.linalg.cholesky_ex(a.flip(0, 1))
    if info.item():
        return None
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1)


def ordered_inverse(h, act_order, damp):
    """(perm, U, damp used) for H [d, d]: the processing order of the columns (descending H_ii with act_order,
    by a stable sort so that it is the same on every device; else None) and the upper Cholesky factor of the
    damped H⁻¹ in that order (inverse_cholesky)."""
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    u, damp = inverse_cholesky(h if perm is None else h[perm][:, perm], damp)
    return perm, u, damp


def gptq_quantize(weight, h_inv, bits, group_size, sym, act_order=False, static_groups=False, block_size=128,
                  perm=None, clip_search=False):
    """Quantize weight [k, d] given U = upper Cholesky of H⁻¹ (already permuted when act_order).

    perm: processing order of the original columns (act_order), else None. Works in the dtype of
    `weight` (fp32 from the engine; fp64 works too). Returns (codes [k, d] in original column
    order, scales [k, G], zeros [k, G], g_idx or None, loss tensor = Σ (w-q)²/U_ii² / 2).
    """
    k, d = weight.shape
    g = effective_group_size(group_size, d)
    groups = num_groups(d, g)
    w = weight.clone() if perm is None else weight[:, perm]
    col_group = None  # static groups: the group of each processed column
    if static_groups:  # from the original weights, original column order, every group in one batched search
        scales, zeros = group_params(weight, g, bits, sym, clip_search)
        orig = range(d) if perm is None else perm.tolist()
        col_group = [c // g for c in orig]
    else:
        scales = torch.empty(k, groups, dtype=w.dtype, device=w.device)
        zeros = torch.empty_like(scales)
    codes = torch.empty(k, d, dtype=torch.int64, device=w.device)

    # on CUDA the fused k-OOC kernel runs the column loop (kernels/gptq_cuda.py); None = unavailable
    loss = gptq_cuda.gptq_columns(w, h_inv, bits, g, sym, scales, zeros, codes, block_size, col_group,
                                  clip_search) if w.is_cuda else None
    if loss is None:
        loss = _column_loop(w, h_inv, bits, g, sym, scales, zeros, codes, block_size, col_group, clip_search)

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if not static_groups and groups > 1:
            g_idx = inv // g  # original column -> group of its processing position
    return codes, scales, zeros, g_idx, loss


def _column_loop(w, h_inv, bits, g, sym, scales, zeros, codes, block_size, col_group, clip_search):
    """The PyTorch GPTQ column loop (the reference the CUDA kernel is held to): quantizes w [k, d] in
    place column by column, filling codes and, for dynamic groups (col_group None), scales/zeros;
    returns the summed OBS loss."""
    d = w.shape[1]
    static_groups = col_group is not None
    loss = torch.zeros((), dtype=w.dtype, device=w.device)
    for i1 in range(0, d, block_size):
        i2 = min(i1 + block_size, d)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = h_inv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if static_groups:
                j = col_group[c]
            else:
                j = c // g
                if c % g == 0:  # a group starts: params from its current weights
                    cur = w1[:, i : i + g]
                    end = min(d, c + g)
                    if end > i2:  # the rest of the group lies after this block: apply pending updates
                        rest = w[:, i2:end] - err1[:, :i] @ h_inv[i1:c, i2:end]
                        cur = torch.cat([cur, rest], dim=1)
                    scales[:, j], zeros[:, j] = uniform_params(cur, bits, sym, clip_search)
            s, z = scales[:, j], zeros[:, j]
            col = w1[:, i]
            q = quantize_codes(col, s, z, bits)
            codes[:, c] = q.to(torch.int64)
            e = (col - (q - z) * s) / u1[i, i]
            w1[:, i:].addr_(e, u1[i, i:], alpha=-1)
            err1[:, i] = e
        loss += err1.pow(2).sum() / 2  # the OBS losses (w - q)²/U_ii² / 2 of this block
        w[:, i2:].addmm_(err1, h_inv[i1:i2, i2:], alpha=-1)  # the fused form the CUDA driver uses, same rounding
    return loss


@register_method(GPTQConfig)
class GPTQ(Method):
    stats = ("hessian",)

    def quantize(self, weight, stats):
        h, w = prepare_hessian(stats["xtx"], stats["nsamples"], weight)
        perm, h_inv, damp = self._ordered_inverse(stats, h)
        codes, scales, zeros, g_idx, loss = gptq_quantize(
            w, h_inv, self.bits, self.group_size, self.sym, self.act_order, self.static_groups, self.block_size, perm,
            self.clip_search)
        g = effective_group_size(self.group_size, weight.shape[1])
        qt = UniformQuantizedTensor.from_codes(codes, scales, zeros, self.bits, g, self.sym, g_idx=g_idx)
        return qt, {"damp": damp, "gptq_loss": loss.item()}

    def _ordered_inverse(self, stats, h):
        """ordered_inverse of H, kept for the next call with the same statistics: the linears of a group (q/k/v,
        gate/up) share one stats object, and H depends on it alone (prepare_hessian changes no entry by the
        weight), so they share U. Only the last one is kept, and only while its statistics live: the engine
        drops a group's statistics after the group, and down_proj's U (~0.5 GB) must not outlive them into the
        next block's forwards."""
        xtx = stats["xtx"]
        key = (stats["nsamples"], xtx._version, h.dtype, h.device, self.act_order, float(self.damp))
        last = self.__dict__.get("_last_inverse")
        if last is not None and last[0]() is xtx and last[1] == key:
            return last[2]
        result = ordered_inverse(h, self.act_order, float(self.damp))
        entry = (weakref.ref(xtx), key, result)
        self.__dict__["_last_inverse"] = entry
        weakref.finalize(xtx, _forget_inverse, self.__dict__, id(entry))
        return result


def _forget_inverse(method_dict, entry_id):
    """Drop GPTQ's kept U when its statistics die, unless a newer one has replaced it (a reused id only costs a
    recomputation)."""
    entry = method_dict.get("_last_inverse")
    if entry is not None and id(entry) == entry_id:
        del method_dict["_last_inverse"]
