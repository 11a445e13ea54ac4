"""OOC, GPTQ(h, l, p, s): GPTQ at l bits with one odd group whose most salient columns get h bits.

One "odd" group per matrix (or per output row) has its p·g most salient columns quantized at h bits
under their own scale/zero (k-OOC paper, sections 3.2-3.3, algorithm 1).

For a [k, d] weight with H = 2·XᵀX/n (prepare_hessian):
  1. salient score per column S(i) = H_ii·Σ_j W_ji²; group score = Σ over the group's columns;
  2. candidates = the top ⌈s·⌈d/g⌉⌉ groups by score (s = 0: no candidates, the result *is*
     GPTQ(l) with the same settings, returned in the uniform format); groups narrower than n = round(p·g) columns (a
     short partial last group) are never candidates;
  3. the clear columns of a candidate group are its n columns with the highest S(i) (ties: lower
     column first). Salience is the paper's column metric (section 2); it is known before any
     quantization, so the clear set is fixed per candidate and stored once per matrix, not per row;
  4. each candidate runs the GPTQ of the method's settings, by default quantkit's default GPTQ
     (act-order, static groups, clip search), in which the odd group's low scale/zero come from its
     non-clear columns and its high (h-bit) scale/zero from its clear columns (the other tier's
     columns zeroed; the range always contains 0, so that changes neither range nor clip error):
     with static groups from the original weights up front (ooc_gptq_static), with dynamic groups
     from the current weights when the group starts (ooc_gptq, the textbook GPTQ of the paper with
     --no-act-order --no-static-groups --no-clip-search). Every column is quantized with its own
     tier's parameters and the OBS error feedback is unchanged;
  5. the probe loss of a result is L = ‖X ΔWᵀ‖² = tr(ΔW·XᵀX·ΔWᵀ) with ΔW = W - W_q and XᵀX the
     *calibration* Gram the engine gathered (the engine gives no held-out probe; the paper probes
     one calibration window, we use all of them). Plain GPTQ(l) competes too: per matrix the
     option with the lowest total L wins (GPTQ(l) winning stores the uniform format); per row
     (per_row=True) every output row takes its own best option — rows are independent given H, so
     Σ_r min_option L_r ≤ min_option Σ_r L_r: per-row never loses to per-matrix on L.
     A row that keeps GPTQ(l) is stored exactly in the OOC layout: its "clear" columns keep their
     l-bit codes, re-based into the h-bit slot under the group's own scale (needs h ≥ l).

The candidates run as p-OOC-Batch (the paper's selection parallel): their copies are stacked [c, k, d]
and one column loop updates all of them with batched tensor ops. On CUDA the fused kernel of
kernels/gptq_cuda.py runs the dynamic-group loop without clip search; static groups and clip search run
the PyTorch loops on the device (the kernel takes neither together with clear columns). The two-flow
ensemble OOC(h,l,p,s) is quantkit/ensemble.py.
"""

import math

import torch

from quantkit.formats.ooc import OOCQuantizedTensor
from quantkit.formats.uniform import UniformQuantizedTensor, num_groups, uniform_params
from quantkit.kernels import gptq_cuda
from quantkit.methods.base import Method, effective_group_size, register_method
from quantkit.methods.configs import OOCConfig
from quantkit.methods.error_feedback import column_sweep
from quantkit.methods.gptq import gptq_quantize, ordered_inverse, prepare_hessian


def clear_count(p, g):
    """n = round(p·g) clear columns (half up), at least 1."""
    return max(1, int(math.floor(p * g + 0.5)))


def select_candidates(h, w, g, scan, n_clear):
    """(candidate groups [c] in descending group score, clear columns [c, n] ascending) from the
    salient scores S(i) = H_ii·Σ_j W_ji²."""
    d = w.shape[1]
    groups = num_groups(d, g)
    score = torch.diagonal(h) * w.pow(2).sum(dim=0)
    group_score = torch.zeros(groups, dtype=score.dtype, device=score.device)
    group_score.index_add_(0, torch.arange(d, device=score.device) // g, score)
    count = min(groups, math.ceil(scan * groups - 1e-9)) if scan > 0 else 0
    widths = torch.tensor([min(d, (j + 1) * g) - j * g for j in range(groups)], device=score.device)
    order = [j for j in torch.argsort(group_score, descending=True, stable=True).tolist() if widths[j] >= n_clear]
    chosen = order[:count]
    cols = []
    for j in chosen:
        start, end = j * g, min(d, (j + 1) * g)
        top = torch.argsort(score[start:end], descending=True, stable=True)[:n_clear]
        cols.append(torch.sort(top).values + start)
    if not chosen:
        return [], torch.empty(0, n_clear, dtype=torch.int64, device=w.device)
    return chosen, torch.stack(cols)


def ooc_gptq(w, h_inv, low_bits, high_bits, g, sym, clear_mask, block_size=128, clip_search=False):
    """GPTQ with dynamic groups on a stack of candidate copies w [c, k, d] (fp32/fp64), where candidate m
    quantizes the columns with clear_mask[m] (all in one group) at high_bits under their own scale/zero.

    Returns (codes [c, k, d] int64 — h-bit codes at clear columns, l-bit elsewhere —, scales and zeros
    [c, k, G] of the low tier, hscales and hzeros [c, k] of the high tier, dequantized weight [c, k, d]).
    A candidate with an empty mask is exactly gptq_quantize's GPTQ(l) (act_order/static groups off).
    """
    # on CUDA the fused kernel runs the candidates, forking them from a shared GPTQ(l) run and chunking
    # them by free memory (kernels/gptq_cuda.py); None = run the loop below. The kernel has no clip search
    # with clear columns, so that setting runs the loop.
    fused = None
    if w.is_cuda and not clip_search:
        fused = gptq_cuda.ooc_columns(w, h_inv, low_bits, high_bits, g, sym, clear_mask, block_size)
    if fused is not None:
        return fused
    c, k, d = w.shape
    w = w.clone()
    groups = num_groups(d, g)
    scales = torch.empty(c, k, groups, dtype=w.dtype, device=w.device)
    zeros = torch.empty_like(scales)
    hscales = torch.ones(c, k, dtype=w.dtype, device=w.device)
    hzeros = torch.zeros_like(hscales)
    codes = torch.empty(c, k, d, dtype=torch.int64, device=w.device)
    dq = torch.empty_like(w)
    maxq_low, maxq_high = 2**low_bits - 1, 2**high_bits - 1
    maxq = torch.where(clear_mask, maxq_high, maxq_low).to(w.dtype)  # [c, d]

    for i1 in range(0, d, block_size):
        i2 = min(i1 + block_size, d)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = h_inv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col_index = i1 + i
            j = col_index // g
            if col_index % g == 0:  # a group starts: both tiers' params from its current weights
                cur = w1[:, :, i : i + g]
                end = min(d, col_index + g)
                if end > i2:  # the rest of the group lies after this block: apply pending updates
                    rest = w[:, :, i2:end] - err1[:, :, :i] @ h_inv[i1:col_index, i2:end]
                    cur = torch.cat([cur, rest], dim=2)
                width = cur.shape[2]
                mask = clear_mask[:, None, col_index : col_index + width]
                # the range always contains 0, so zeroing the other tier's columns leaves it unchanged (and
                # 0 is on every grid, so it adds nothing to the clip search's error either)
                s, z = uniform_params(cur.masked_fill(mask, 0).reshape(c * k, width), low_bits, sym, clip_search)
                scales[:, :, j], zeros[:, :, j] = s.reshape(c, k), z.reshape(c, k)
                odd = clear_mask[:, col_index : col_index + width].any(dim=1)
                if odd.any():
                    sh, zh = uniform_params(cur[odd].masked_fill(~mask[odd], 0).reshape(-1, width), high_bits, sym,
                                            clip_search)
                    hscales[odd], hzeros[odd] = sh.reshape(-1, k), zh.reshape(-1, k)
            is_clear = clear_mask[:, col_index, None]
            s = torch.where(is_clear, hscales, scales[:, :, j])
            z = torch.where(is_clear, hzeros, zeros[:, :, j])
            col = w1[:, :, i]
            q = torch.minimum(torch.clamp(torch.round(col / s) + z, min=0), maxq[:, col_index, None])
            codes[:, :, col_index] = q.to(torch.int64)
            deq = (q - z) * s
            dq[:, :, col_index] = deq
            e = (col - deq) / u1[i, i]
            w1[:, :, i:] -= e[:, :, None] * u1[i, i:]
            err1[:, :, i] = e
        w[:, :, i2:] -= err1 @ h_inv[i1:i2, i2:]
    return codes, scales, zeros, hscales, hzeros, dq


def static_tier_params(w, low_bits, high_bits, g, sym, clear_mask, clip_search):
    """Static groups: both tiers' params of every candidate from the original weights w [k, d], up front
    (as gptq_quantize's static groups). Returns scales, zeros [c, k, G] and hscales, hzeros [c, k]: every
    group as in GPTQ(l) but the candidate's odd group, whose low params come from its non-clear columns
    and whose high params from its clear columns (the other tier's columns zeroed, as in ooc_gptq)."""
    c, d = clear_mask.shape
    k = w.shape[0]
    groups = num_groups(d, g)
    base = [uniform_params(w[:, j * g : (j + 1) * g], low_bits, sym, clip_search) for j in range(groups)]
    scales = torch.stack([s for s, _ in base], dim=1).expand(c, k, groups).clone()
    zeros = torch.stack([z for _, z in base], dim=1).expand(c, k, groups).clone()
    hscales = torch.ones(c, k, dtype=w.dtype, device=w.device)
    hzeros = torch.zeros_like(hscales)
    for m in range(c):
        cols = clear_mask[m].nonzero().flatten()
        if cols.numel() == 0:
            continue
        j = int(cols[0]) // g
        cur, mask = w[:, j * g : (j + 1) * g], clear_mask[m, None, j * g : (j + 1) * g]
        scales[m, :, j], zeros[m, :, j] = uniform_params(cur.masked_fill(mask, 0), low_bits, sym, clip_search)
        hscales[m], hzeros[m] = uniform_params(cur.masked_fill(~mask, 0), high_bits, sym, clip_search)
    return scales, zeros, hscales, hzeros


def ooc_gptq_static(w, h_inv, low_bits, high_bits, g, sym, clear_mask, block_size=128, perm=None, clip_search=False):
    """ooc_gptq with static groups (and act-order when perm is given): candidate m of w [k, d] (original
    column order; h_inv already permuted) runs GPTQ with every column's tier params known up front
    (static_tier_params), columns in the order perm. Same results as ooc_gptq, in original column order.
    A candidate with an empty mask is exactly gptq_quantize's GPTQ(l) with the same settings: the loop
    below is its static-group loop on the candidates' stacked rows [c·k, d]."""
    c, d = clear_mask.shape
    k = w.shape[0]
    scales, zeros, hscales, hzeros = static_tier_params(w, low_bits, high_bits, g, sym, clear_mask, clip_search)
    order = torch.arange(d, device=w.device) if perm is None else perm
    clear = clear_mask[:, order]  # [c, d] in processing order
    col_group = (order // g).tolist()
    maxq = torch.where(clear, 2**high_bits - 1, 2**low_bits - 1).to(w.dtype)
    work = w[:, order].expand(c, k, d).reshape(c * k, d).clone()
    codes = torch.empty(c, k, d, dtype=torch.int64, device=w.device)
    dq = torch.empty(c, k, d, dtype=w.dtype, device=w.device)

    def round_two_tier(col_index, col):
        j = col_group[col_index]
        is_clear = clear[:, col_index, None]
        s = torch.where(is_clear, hscales, scales[:, :, j]).reshape(c * k)
        z = torch.where(is_clear, hzeros, zeros[:, :, j]).reshape(c * k)
        top = maxq[:, col_index, None].expand(c, k).reshape(c * k)
        q = torch.minimum(torch.clamp(torch.round(col / s) + z, min=0), top)
        codes[:, :, col_index] = q.to(torch.int64).reshape(c, k)
        deq = (q - z) * s
        dq[:, :, col_index] = deq.reshape(c, k)
        return deq

    column_sweep(work, h_inv, round_two_tier, block_size)
    if perm is not None:
        inv = torch.argsort(perm)
        codes, dq = codes[:, :, inv], dq[:, :, inv]
    return codes, scales, zeros, hscales, hzeros, dq


def row_losses(weight, dq, gram):
    """ΔW_r·XᵀX·ΔW_rᵀ per row: [..., k] for dq [..., k, d]."""
    delta = weight - dq
    return ((delta @ gram) * delta).sum(dim=-1)


@register_method(OOCConfig)
class OOC(Method):
    stats = ("hessian",)

    def run_candidates(self, w, h_inv, g, clear_mask, perm=None):
        """The results of every candidate (clear_mask [c, d]), all at once from the shared w [k, d]: ooc_gptq
        (dynamic groups), or ooc_gptq_static (static groups, act-order when perm is given)."""
        if self.static_groups:
            return ooc_gptq_static(w, h_inv, self.low_bits, self.high_bits, g, self.sym, clear_mask, self.block_size,
                                   perm, self.clip_search)
        return ooc_gptq(w.expand(clear_mask.shape[0], -1, -1), h_inv, self.low_bits, self.high_bits, g, self.sym,
                        clear_mask, self.block_size, self.clip_search)

    def quantize(self, weight, stats):
        k, d = weight.shape
        g = effective_group_size(self.group_size, d)
        h, w = prepare_hessian(stats["xtx"], stats["nsamples"], weight)
        perm, h_inv, damp = ordered_inverse(h, self.act_order, float(self.damp))
        codes, scales, zeros, _, loss = gptq_quantize(w, h_inv, self.low_bits, self.group_size, self.sym,
                                                      self.act_order, self.static_groups, self.block_size, perm,
                                                      self.clip_search)
        base = UniformQuantizedTensor.from_codes(codes, scales, zeros, self.low_bits, g, self.sym)
        info = {"damp": damp, "gptq_loss": loss.item()}
        n = clear_count(self.clear_fraction, g)
        cand_groups, cand_cols = select_candidates(h, w, g, self.scan, n)
        if not cand_groups:
            info["odd_group"] = None
            return base, info

        gram = stats["xtx"].to(device=weight.device, dtype=weight.dtype)
        base_dq = base.dequantize(weight.dtype)
        clear_mask = torch.zeros(len(cand_groups), d, dtype=torch.bool, device=weight.device)
        clear_mask.scatter_(1, cand_cols, True)
        c_codes, c_scales, c_zeros, c_hs, c_hz, c_dq = self.run_candidates(w, h_inv, g, clear_mask, perm)
        losses = torch.cat([row_losses(weight, base_dq, gram)[None], row_losses(weight, c_dq, gram)])  # [1+c, k]
        totals = losses.sum(dim=1)
        info.update({"ooc_candidates": cand_groups, "probe_loss_gptq": totals[0].item(),
                     "probe_loss_candidates": totals[1:].tolist()})
        if self.per_row:
            choice = torch.argmin(losses, dim=0)  # first minimum: GPTQ(l) on ties
        else:
            choice = torch.full((k,), int(torch.argmin(totals)), dtype=torch.int64, device=weight.device)
        info["probe_loss"] = losses.gather(0, choice[None])[0].sum().item()
        if not bool((choice > 0).any()):
            info["odd_group"] = None
            return base, info

        # stack the options (0 = GPTQ(l), m = candidate m-1) and take each row's
        base_scales, base_zeros = scales, zeros
        # GPTQ(l) rows in the OOC layout: the clear columns of list 0 keep their l-bit values in the h tier
        list0 = cand_cols[0]
        j0 = cand_groups[0]
        base_hs = base_scales[:, j0]
        base_hz = base_zeros[:, j0] if not self.sym else torch.full_like(base_hs, 2 ** (self.high_bits - 1))
        base_hcodes = codes[:, list0] - (base_zeros[:, j0, None] if not self.sym else 2 ** (self.low_bits - 1)) \
            + base_hz[:, None]
        rows = torch.arange(k, device=weight.device)
        cand = (choice - 1).clamp_min(0)  # candidate index of each row (list 0 for GPTQ(l) rows)
        is_base = choice == 0
        sel_codes = torch.where(is_base[:, None], codes, c_codes[cand, rows])
        sel_scales = torch.where(is_base[:, None], base_scales, c_scales[cand, rows])
        sel_zeros = torch.where(is_base[:, None], base_zeros, c_zeros[cand, rows])
        row_cols = cand_cols[cand]  # [k, n]
        sel_hcodes = torch.where(is_base[:, None], base_hcodes, sel_codes.gather(1, row_cols))
        sel_hs = torch.where(is_base, base_hs, c_hs[cand, rows])
        sel_hz = torch.where(is_base, base_hz, c_hz[cand, rows])
        if self.per_row:
            table, row_choice = cand_cols, cand
            info["rows_per_option"] = torch.bincount(choice, minlength=1 + len(cand_groups)).tolist()
        else:
            best = int(choice[0]) - 1
            table, row_choice = cand_cols[best : best + 1], None
            info["odd_group"] = cand_groups[best]
        qt = OOCQuantizedTensor.from_codes(sel_codes, sel_scales, sel_zeros, sel_hcodes, sel_hs, sel_hz, table,
                                           row_choice, self.low_bits, self.high_bits, g, self.sym)
        return qt, info
