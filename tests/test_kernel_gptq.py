"""Tests of the fused GPTQ / k-OOC kernel (kernels/gptq.cu, quantkit/kernels/gptq_cuda.py).

On the GPU: the kernel's codes equal the PyTorch loop's (gptq_quantize, ooc_gptq, run on the same GPU with the
kernel disabled) for >= 99.9 % of weights, params likewise, the layer loss within 1e-4 relative, on random and
real SmolLM2 matrices; every output buffer is poisoned before the run; the tile op is graph-capturable and
refuses bad inputs. On the CPU (no kernel): the driver (tiles, forks, chunks, output assembly) runs against a
PyTorch emulation of the tile contract and must reproduce the PyTorch methods exactly in float64.
"""

import os
from pathlib import Path

import pytest
import torch

from gptq_helpers import correlated_inputs, hessian_stats
from quantkit.formats.uniform import num_groups, uniform_params
from quantkit.kernels import gptq_cuda
from quantkit.methods.gptq import GPTQ, gptq_quantize, inverse_cholesky, prepare_hessian
from quantkit.methods.ooc import OOC, clear_count, ooc_gptq, select_candidates

pytestmark = pytest.mark.gpu

AGREE = 0.999  # the share of codes that must agree: the rest are floating-point ties


@pytest.fixture(scope="module")
def kernel(requires):
    return requires("gptq")


def _poison(monkeypatch):
    """Every buffer the kernel writes starts as NaN (floats), 255 (codes) or -1 (other integers), and so do
    the scales and zeros a dynamic-group run must fill: an element left unwritten shows."""
    import inspect

    def poisoned_empty(*size, dtype, device):
        t = torch.empty(*size, dtype=dtype, device=device)
        return t.fill_(float("nan") if t.is_floating_point() else 255 if dtype == torch.uint8 else -1)

    columns = gptq_cuda.gptq_columns
    signature = inspect.signature(columns)

    def poisoned_columns(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("col_group") is None:
            bound.arguments["scales"].fill_(float("nan"))
            bound.arguments["zeros"].fill_(float("nan"))
        return columns(*args, **kwargs)

    monkeypatch.setattr(gptq_cuda, "_empty", poisoned_empty)
    monkeypatch.setattr(gptq_cuda, "gptq_columns", poisoned_columns)


@pytest.fixture
def poisoned(monkeypatch):
    _poison(monkeypatch)


def agreement(a, b):
    return (a == b).double().mean().item()


def rel(a, b):
    return abs(float(a) - float(b)) / max(abs(float(b)), 1e-30)


def problem(k, d, seed, dtype=torch.float64, device="cpu"):
    """Random W with a few salient columns and H from correlated inputs; returns (weight, stats)."""
    gen = torch.Generator().manual_seed(seed)
    x = correlated_inputs(max(3 * d, 256), d, gen, dtype)
    weight = torch.randn(k, d, generator=gen, dtype=dtype)
    weight[:, : d // 8] *= 3
    stats = hessian_stats(x)
    stats["xtx"] = stats["xtx"].to(device)
    return weight.to(device), stats


def prepared(weight, stats, act_order=False):
    h, w = prepare_hessian(stats["xtx"], stats["nsamples"], weight)
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        h = h[perm][:, perm]
    u, _ = inverse_cholesky(h, 0.01)
    return h, w, u, perm


# ---------------------------------------------------------------------------------------------------------
# CPU: the driver against a PyTorch emulation of the tile contract


class TorchTile:
    """kernels/gptq.cu's `tile` contract in PyTorch, one column at a time over all active rows."""

    def __init__(self):
        self.tiles = []

    def tile(self, w, u, codes, err, scales, zeros, hs, hz, loss, clear, high_bits, col_group, row_lo, row_hi, k,
             i1, i2, g, low_bits, sym, clip, min_scale, clip_steps, clip_grid, clip_norm, tpr):
        assert tpr in (4, 8, 16, 32) and 0 < i2 - i1 <= gptq_cuda.TILE and row_lo % k == 0 and row_hi % k == 0
        self.tiles.append((row_lo, row_hi, i1, i2))
        d = w.shape[1]
        r = slice(row_lo, row_hi)
        unit = torch.arange(row_lo, row_hi) // k
        cmask = clear[unit].bool() if clear is not None else torch.zeros(row_hi - row_lo, d, dtype=torch.bool)
        hbits = int(high_bits[0]) if high_bits is not None else low_bits
        assert high_bits is None or bool((high_bits == hbits).all())
        maxq = torch.where(cmask, 2**hbits - 1, 2**low_bits - 1).to(w.dtype)
        if i1 == 0:
            hs[r], hz[r], loss[r] = 1, 0, 0
        wt = w[r, i1:i2].clone()
        for i in range(i2 - i1):
            c = i1 + i
            if col_group is None and c % g == 0:
                end = min(c + g, d)
                assert end <= i2 or i == 0, "a group crosses the tile end without starting the tile"
                cur = torch.cat([wt[:, i : end - i1], w[r, i2:end]], dim=1)
                m = cmask[:, c:end]
                scales[r, c // g], zeros[r, c // g] = uniform_params(cur.masked_fill(m, 0), low_bits, sym, clip)
                odd = m.any(dim=1)
                if odd.any():
                    sh, zh = uniform_params(cur[odd].masked_fill(~m[odd], 0), hbits, sym)
                    hs[row_lo + torch.nonzero(odd)[:, 0]] = sh
                    hz[row_lo + torch.nonzero(odd)[:, 0]] = zh
            j = int(col_group[c]) if col_group is not None else c // g
            s = torch.where(cmask[:, c], hs[r], scales[r, j])
            z = torch.where(cmask[:, c], hz[r], zeros[r, j])
            x = wt[:, i]
            q = torch.minimum(torch.clamp(torch.round(x / s) + z, min=0), maxq[:, c])
            e = (x - (q - z) * s) / u[c, c]
            wt[:, i:] -= e[:, None] * u[c, c:i2]
            codes[r, c] = q.to(torch.uint8)
            err[r, i] = e
            loss[r] += e * e


@pytest.fixture
def emulated(monkeypatch):
    emu = TorchTile()
    monkeypatch.setattr(gptq_cuda, "_compiled", lambda t: emu)
    _poison(monkeypatch)
    return emu


@pytest.mark.parametrize("k,d,bits,group,sym,act_order,static,clip,block", [
    (12, 300, 3, 32, False, False, False, False, 128),   # partial last tile and group
    (10, 576, 2, 128, False, False, False, False, 128),  # SmolLM2 width
    (8, 300, 4, -1, True, False, False, False, 128),     # one group per row: read past the tile
    (9, 230, 4, 100, False, False, False, False, 128),   # groups crossing block ends: tiles cut at them
    (8, 100, 3, 24, False, False, False, False, 16),     # small blocks (the reference tests use 16)
    (8, 160, 3, 32, False, True, True, True, 128),       # the method default: act-order + static + clip
    (8, 160, 3, 32, False, True, False, True, 64),       # dynamic groups with the clip search in the kernel
])
def test_driver_gptq_equals_pytorch_fp64(emulated, k, d, bits, group, sym, act_order, static, clip, block):
    weight, stats = problem(k, d, seed=d + bits)
    _, w, u, perm = prepared(weight, stats, act_order)
    ref = gptq_quantize(w, u, bits, group, sym, act_order, static, block, perm, clip)
    g = d if group == -1 else min(group, d)
    groups = num_groups(d, g)
    scales = torch.empty(k, groups, dtype=w.dtype)
    zeros = torch.empty_like(scales)
    col_group = None
    wp = w.clone() if perm is None else w[:, perm]
    if static:
        for j in range(groups):
            scales[:, j], zeros[:, j] = uniform_params(w[:, j * g : (j + 1) * g], bits, sym, clip)
        col_group = (perm // g).tolist()
    codes = torch.full((k, d), -1, dtype=torch.int64)
    loss = gptq_cuda.gptq_columns(wp, u, bits, g, sym, scales, zeros, codes, block, col_group, clip)
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    assert torch.equal(codes, ref[0])
    assert torch.equal(scales, ref[1]) and torch.equal(zeros, ref[2])
    assert loss.item() == pytest.approx(ref[4].item(), rel=1e-12)
    widths = [i2 - i1 for _, _, i1, i2 in emulated.tiles]
    assert max(widths) <= min(block, gptq_cuda.TILE) and sum(widths) == d


@pytest.mark.parametrize("fork,budget_units", [(None, None), (True, None), (False, None), (True, 3), (None, 1)])
def test_driver_ooc_equals_pytorch_fp64(emulated, fork, budget_units):
    k, d, g = 10, 340, 64  # six groups, the last partial
    weight, stats = problem(k, d, seed=3)
    h, w, u, _ = prepared(weight, stats)
    cand_groups, cols = select_candidates(h, w, g, 1.0, clear_count(0.1, g))
    mask = torch.zeros(len(cand_groups), d, dtype=torch.bool)
    mask.scatter_(1, cols, True)
    mask = torch.cat([mask, torch.zeros(1, d, dtype=torch.bool)])  # plus a candidate without clear columns
    wc = w.expand(mask.shape[0], -1, -1)
    with gptq_cuda.disabled():
        ref = ooc_gptq(wc, u, 2, 3, g, False, mask, 64)
    budget = None
    if budget_units is not None:
        budget = gptq_cuda.unit_bytes(k, d, num_groups(d, g), 8) * budget_units + gptq_cuda.transient_bytes(k, d, 8)
    got = gptq_cuda.ooc_columns(wc, u, 2, 3, g, False, mask, 64, budget=budget, fork=fork)
    for name, a, b in zip(("codes", "scales", "zeros", "hscales", "hzeros", "dq"), got, ref):
        assert torch.equal(a, b), name
    rows = {(r0, r1) for r0, r1, _, _ in emulated.tiles}
    if budget_units is not None:  # chunks: never more units at once than the budget holds
        assert max(r1 - r0 for r0, r1 in rows) <= budget_units * k


def test_driver_fork_saves_work(emulated):
    k, d, g = 6, 512, 64
    weight, stats = problem(k, d, seed=4)
    h, w, u, _ = prepared(weight, stats)
    cand_groups, cols = select_candidates(h, w, g, 1.0, clear_count(0.1, g))
    mask = torch.zeros(len(cand_groups), d, dtype=torch.bool)
    mask.scatter_(1, cols, True)
    gptq_cuda.ooc_columns(w.expand(len(cand_groups), -1, -1), u, 2, 2, g, False, mask, 128, fork=True)
    # rows × columns × columns-after processed: forking runs each candidate only from its odd group on
    work = sum((r1 - r0) * (i2 - i1) * (d - i1) for r0, r1, i1, i2 in emulated.tiles)
    plain = len(cand_groups) * k * sum((i2 - i1) * (d - i1) for i1, i2 in gptq_cuda.tile_plan(d, g, 128))
    assert work < 0.6 * plain


@pytest.mark.parametrize("d,g,block,cuts", [(576, 128, 128, ()), (300, 100, 128, ()), (1000, 1000, 128, ()),
                                            (100, 24, 16, ()), (640, 32, 128, (96, 320)), (700, None, 128, (5,))])
def test_tile_plan(d, g, block, cuts):
    tiles = gptq_cuda.tile_plan(d, g, block, cuts)
    assert tiles[0][0] == 0 and tiles[-1][1] == d
    assert all(a < b <= a + min(block, gptq_cuda.TILE) for a, b in tiles)
    assert all(b == a2 for (_, b), (a2, _) in zip(tiles, tiles[1:]))
    starts = {a for a, _ in tiles}
    assert set(range(0, d, min(block, gptq_cuda.TILE))) | set(cuts) <= starts
    if g is not None:  # a group that starts inside a tile ends inside it
        for a, b in tiles:
            assert all(min(c + g, d) <= b for c in range(a + 1, b) if c % g == 0)


def test_memory_plan():
    k, d, groups = 4096, 4096, 32
    per = gptq_cuda.unit_bytes(k, d, groups, 4)
    assert per == k * d * 5 + k * 4 * (gptq_cuda.TILE + 2 * groups + 3)
    assert gptq_cuda.candidate_chunk(k, d, groups, 4, 10 * per + gptq_cuda.transient_bytes(k, d, 4)) == 10
    assert gptq_cuda.candidate_chunk(k, d, groups, 4, 0) == 1  # never refuses to run
    assert not gptq_cuda.fork_pays([0.5])  # one candidate: the base costs what it saves
    assert gptq_cuda.fork_pays([0.0, 0.5, 0.9]) and not gptq_cuda.fork_pays([0.0, 0.0])
    assert gptq_cuda.ooc_work_units([i / 10 for i in range(10)]) < 5


def test_no_kernel_on_cpu_tensors():
    w = torch.randn(4, 16)
    u = torch.eye(16)
    scales = torch.empty(4, 1)
    assert gptq_cuda.gptq_columns(w, u, 4, 16, False, scales, scales.clone(), torch.empty(4, 16).long()) is None
    assert gptq_cuda.ooc_columns(w[None], u, 2, 3, 16, False, torch.zeros(1, 16, dtype=torch.bool)) is None


# ---------------------------------------------------------------------------------------------------------
# GPU: the compiled kernel against the PyTorch loops on the same device


GPTQ_CASES = [  # (k, d, bits, group, sym, act_order, static_groups, clip_search, block)
    (256, 576, 2, 128, False, False, False, False, 128),
    (300, 1000, 3, 128, False, False, False, False, 128),
    (128, 640, 4, 32, True, False, False, False, 128),
    (97, 300, 4, -1, False, False, False, False, 128),
    (64, 450, 3, 100, False, False, False, False, 128),
    (64, 200, 8, 24, False, False, False, False, 16),
    (256, 768, 4, 128, False, True, True, True, 128),
    (128, 512, 3, 128, True, True, False, True, 128),
    (4096, 512, 2, 128, False, False, False, False, 128),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptq_kernel_matches_pytorch(kernel, poisoned, case, dtype):
    k, d, bits, group, sym, act_order, static, clip, block = case
    weight, stats = problem(k, d, seed=k + d, dtype=dtype, device="cuda")
    method = GPTQ(bits=bits, group_size=group, sym=sym, act_order=act_order, static_groups=static, clip_search=clip,
                  block_size=block)
    with gptq_cuda.disabled():
        ref, ref_info = method.quantize(weight, stats)
    before = gptq_cuda.launches["tiles"]
    got, info = method.quantize(weight, stats)
    assert gptq_cuda.launches["tiles"] > before  # the kernel ran
    assert agreement(got.codes(), ref.codes()) >= AGREE
    assert agreement(got.scales, ref.scales) >= AGREE
    if not sym:
        assert agreement(got.zeros(), ref.zeros()) >= AGREE
    assert (got.g_idx is None) == (ref.g_idx is None)
    if got.g_idx is not None:
        assert torch.equal(got.g_idx, ref.g_idx)
    assert rel(info["gptq_loss"], ref_info["gptq_loss"]) <= 1e-4
    h = 2 * stats["xtx"] / stats["nsamples"]
    layer = [((weight - q.dequantize(dtype)) @ h * (weight - q.dequantize(dtype))).sum().item() for q in (got, ref)]
    assert rel(layer[0], layer[1]) <= 1e-4


def test_gptq_poisoned_outputs_all_written(kernel, poisoned):
    k, d, g = 200, 300, 128  # partial tile and group
    weight, stats = problem(k, d, seed=7, dtype=torch.float32, device="cuda")
    _, w, u, _ = prepared(weight, stats)
    groups = num_groups(d, g)
    scales = torch.full((k, groups), float("nan"), device="cuda")
    zeros = torch.full_like(scales, float("nan"))
    codes = torch.full((k, d), -1, dtype=torch.int64, device="cuda")
    loss = gptq_cuda.gptq_columns(w.clone(), u, 3, g, False, scales, zeros, codes)
    assert bool(((codes >= 0) & (codes <= 7)).all()) and torch.isfinite(loss)
    assert bool(torch.isfinite(scales).all() & torch.isfinite(zeros).all())


def test_threads_per_row_variants_agree(kernel, monkeypatch):
    """Every instantiation does the same arithmetic per row: identical codes (no clip search, whose sum order
    depends on the lane count)."""
    weight, stats = problem(160, 700, seed=8, dtype=torch.float32, device="cuda")
    _, w, u, _ = prepared(weight, stats)
    results = []
    for tpr in gptq_cuda.THREADS_PER_ROW:
        monkeypatch.setattr(gptq_cuda, "threads_per_row", lambda rows, tpr=tpr: tpr)
        results.append(gptq_quantize(w, u, 3, 128, False)[0])
    assert all(torch.equal(r, results[0]) for r in results[1:])


def _clip_error(w, scales, zeros, g, bits):
    """Σ |q(w) − w|^CLIP_NORM of every group under the given params, [k, G] (the clip search's objective)."""
    from quantkit.formats.uniform import CLIP_NORM, fake_quantize

    cols = torch.arange(w.shape[1], device=w.device) // g
    fq = fake_quantize(w, scales[:, cols], zeros[:, cols], bits)
    err = (fq - w).abs().pow(CLIP_NORM)
    return torch.zeros_like(scales).index_add_(1, cols, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k,d,g,bits,sym", [
    (300, 1000, 128, 4, False),  # a partial last group
    (97, 576, 576, 3, False),    # one group per row (per-channel)
    (64, 384, 32, 2, True),
    (600, 512, 128, 8, False),
])
def test_static_group_params_kernel_matches_pytorch(kernel, poisoned, dtype, k, d, g, bits, sym):
    """The static-group kernel's scales and zeros equal grouped_uniform_params' (PyTorch, same GPU): exactly
    without the clip search (min, max and exact per-group arithmetic), and with it wherever the search's
    best shrink is not a floating-point near-tie; where the two differ, their objectives agree to 1e-5."""
    from quantkit.formats.uniform import grouped_uniform_params

    gen = torch.Generator().manual_seed(k + d + bits)
    w = (torch.distributions.StudentT(3.0).sample((k, d)) * 0.02).to(dtype).cuda()
    w[:3, :g] = 0  # all-zero groups take the [-1, 1] range
    w[5, :] = w[5, int(torch.randint(d, (1,), generator=gen))]  # a constant row
    for clip in (False, True):
        ref = grouped_uniform_params(w, g, bits, sym, clip)
        got = gptq_cuda.group_params(w, g, bits, sym, clip)
        assert got is not None and all(bool(torch.isfinite(t).all()) for t in got)
        if not clip:
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            continue
        assert agreement(got[0], ref[0]) >= AGREE and agreement(got[1], ref[1]) >= AGREE
        differ = (got[0] != ref[0]) | (got[1] != ref[1])
        if differ.any():
            e_got, e_ref = _clip_error(w, *got, g, bits), _clip_error(w, *ref, g, bits)
            assert bool(((e_got - e_ref).abs() <= 1e-5 * e_ref.abs())[differ].all())


def test_static_group_params_every_lane_count_agrees(kernel, monkeypatch):
    """The kernel's 8, 16 and 32 lanes per group (a 7B layer takes 8) give the PyTorch values without the clip
    search, and agree with each other and with PyTorch on nearly every group with it."""
    from quantkit.formats.uniform import grouped_uniform_params

    w = (torch.distributions.StudentT(3.0).sample((512, 640)) * 0.02).cuda()
    for clip in (False, True):
        ref = grouped_uniform_params(w, 128, 3, False, clip)
        results = []
        for tpr in (8, 16, 32):
            monkeypatch.setattr(gptq_cuda, "threads_per_row", lambda rows, tpr=tpr: tpr)
            results.append(gptq_cuda.group_params(w, 128, 3, False, clip))
        for scales, zeros in results:
            if clip:
                assert agreement(scales, ref[0]) >= AGREE and agreement(zeros, ref[1]) >= AGREE
            else:
                assert torch.equal(scales, ref[0]) and torch.equal(zeros, ref[1])


def test_rtn_on_cuda_uses_the_group_params_kernel(kernel, monkeypatch):
    from quantkit.methods.rtn import RTN

    weight = (torch.randn(256, 640, generator=torch.Generator().manual_seed(3)) * 0.02).cuda()
    method = RTN(bits=3, group_size=128, clip_search=True)
    with gptq_cuda.disabled():
        ref, _ = method.quantize(weight, None)
    calls = []
    params = gptq_cuda.group_params
    monkeypatch.setattr(gptq_cuda, "group_params", lambda *a, **kw: calls.append(1) or params(*a, **kw))
    got, _ = method.quantize(weight, None)
    assert calls and agreement(got.codes(), ref.codes()) >= AGREE and agreement(got.scales, ref.scales) >= AGREE


def ooc_problem(k, d, g, seed, dtype, scan=1.0):
    weight, stats = problem(k, d, seed, dtype=dtype, device="cuda")
    h, w, u, _ = prepared(weight, stats)
    cand_groups, cols = select_candidates(h, w, g, scan, clear_count(0.1, g))
    mask = torch.zeros(len(cand_groups), d, dtype=torch.bool, device="cuda")
    mask.scatter_(1, cols, True)
    return w, u, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("high,sym,fork,chunk", [(2, False, None, None), (3, False, False, None),
                                                  (4, True, True, 3), (3, False, True, 1)])
def test_ooc_kernel_matches_pytorch(kernel, poisoned, dtype, high, sym, fork, chunk):
    k, d, g = 192, 1152, 128
    w, u, mask = ooc_problem(k, d, g, seed=9, dtype=dtype)
    wc = w.expand(mask.shape[0], -1, -1)
    with gptq_cuda.disabled():
        ref = ooc_gptq(wc, u, 2, high, g, sym, mask)
    budget = None
    if chunk is not None:
        budget = (gptq_cuda.unit_bytes(k, d, num_groups(d, g), w.element_size()) * chunk
                  + gptq_cuda.transient_bytes(k, d, w.element_size()))
    got = gptq_cuda.ooc_columns(wc, u, 2, high, g, sym, mask, budget=budget, fork=fork)
    for name, a, b in zip(("codes", "scales", "zeros", "hscales", "hzeros"), got, ref):
        assert agreement(a, b) >= AGREE, name
    dq, ref_dq = got[5], ref[5]
    assert torch.isfinite(dq).all()
    assert (dq - ref_dq).norm() / ref_dq.norm() < 1e-2  # the few tie flips move whole steps


@pytest.mark.parametrize("per_row", [False, True])
def test_ooc_method_matches_pytorch(kernel, per_row):
    weight, stats = problem(256, 896, seed=10, dtype=torch.float32, device="cuda")
    method = OOC(low_bits=2, high_bits=3, scan=0.5, group_size=128, per_row=per_row)
    with gptq_cuda.disabled():
        ref, ref_info = method.quantize(weight, stats)
    got, info = method.quantize(weight, stats)
    assert got.format_name == ref.format_name
    assert info["ooc_candidates"] == ref_info["ooc_candidates"]
    assert rel(info["probe_loss"], ref_info["probe_loss"]) <= 1e-4
    for a, b in zip(info["probe_loss_candidates"], ref_info["probe_loss_candidates"]):
        assert rel(a, b) <= 1e-4
    # a per-row choice between near-equal options may go the other way and swap a whole row
    assert agreement(got.dequantize(), ref.dequantize()) >= (0.99 if per_row else AGREE)


def test_engine_uses_kernel(kernel):
    import copy

    from factories import tiny_causal_lm
    from quantkit.engine import quantize_model
    from quantkit.methods import make_method
    from quantkit.models import adapter_for

    model = tiny_causal_lm(intermediate=128, seed=2)
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    for name, params in (("gptq", {"bits": 3, "group_size": 32}),
                         ("ooc", {"low_bits": 2, "high_bits": 3, "scan": 1.0, "group_size": 32})):
        method = make_method(name, **params)
        with gptq_cuda.disabled():
            ref, _ = quantize_model(copy.deepcopy(model), adapter_for(model), method, calib, device="cuda",
                                    progress=False)
        before = gptq_cuda.launches["calls"]
        got, _ = quantize_model(copy.deepcopy(model), adapter_for(model), method, calib, device="cuda",
                                progress=False)
        assert gptq_cuda.launches["calls"] > before
        for module, qt in got.items():
            assert agreement(qt.dequantize(), ref[module].dequantize()) >= 0.99, (name, module)


def test_tile_graph_capture_and_errors(kernel):
    k, d = 64, 256
    weight, stats = problem(k, d, seed=11, dtype=torch.float32, device="cuda")
    _, w, u, _ = prepared(weight, stats)
    u = u.contiguous()  # cholesky_ex(upper=True) returns a transposed view; gptq_cuda passes u.contiguous() too
    buf = gptq_cuda._Buffers(k, d, 2, torch.float32, "cuda")

    def args(work):  # rows [0, k) of one unit, columns [0, 128), g = 128, 2 bits, 8 threads per row
        return (work, u, buf.codes, buf.err, buf.scales, buf.zeros, buf.hscales, buf.hzeros, buf.loss, None, None,
                None, 0, k, k, 0, 128, 128, 2, False, False, 2.0**-20, 80, 100, 2.4, 8)

    eager = w.clone()
    kernel.tile(*args(eager))
    expected_codes, expected_err = buf.codes.clone(), buf.err.clone()
    buf.codes.fill_(255)
    torch.cuda.synchronize()
    graph_work = w.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # no allocation, no sync inside: capturable
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            kernel.tile(*args(graph_work))
    graph.replay()
    torch.cuda.synchronize()
    # the tile covers columns [0, 128): those were poisoned and must be rewritten by the replay
    assert torch.equal(buf.codes[:, :128], expected_codes[:, :128]) and torch.equal(buf.err, expected_err)
    bad = list(args(w.clone()))
    bad[0] = w.double()
    with pytest.raises(RuntimeError, match="float64|Double|dtype|must be"):
        kernel.tile(*bad)
    bad = list(args(w.clone()))
    bad[15], bad[16] = 64, 192  # the group starting at 128, inside the tile, would run past its end
    with pytest.raises(RuntimeError, match="runs past the tile end"):
        kernel.tile(*bad)
    bad[16] = 256  # wider than a tile
    with pytest.raises(RuntimeError, match="at most 128"):
        kernel.tile(*bad)


# ---------------------------------------------------------------------------------------------------------
# GPU + the real model: SmolLM2 matrices and Hessians from real activations


def smollm2_file():
    from quantkit import settings

    for path in (os.environ.get("QUANTKIT_SMOLLM2_GGUF"), settings.default_model_path()):
        if path and Path(path).is_file():
            return Path(path)
    pytest.skip("SmolLM2 GGUF not found (set QUANTKIT_SMOLLM2_GGUF)")


@pytest.fixture(scope="module")
def smollm2_layers(kernel):
    """{name: (weight fp32 cuda, stats)} for five linears of SmolLM2 with Hessians from real activations."""
    from quantkit.models.loading import load_model, load_tokenizer, resolve_source

    source = resolve_source(str(smollm2_file()))
    model = load_model(source).to("cuda")
    ids = None
    try:
        from quantkit.data.protocol import eval_tokens

        ids = eval_tokens("wikitext2", load_tokenizer(source), 512)[0][: 8 * 512].reshape(8, 512)
    except Exception:  # no texts on this machine: real weights still see real embeddings of random tokens
        ids = torch.randint(0, model.config.vocab_size, (8, 512), generator=torch.Generator().manual_seed(0))
    names = ["model.layers.0.self_attn.q_proj", "model.layers.3.mlp.up_proj", "model.layers.3.mlp.down_proj",
             "model.layers.15.self_attn.o_proj", "model.layers.29.mlp.gate_proj"]
    xtx, hooks = {}, []
    for name in names:
        module = model.get_submodule(name)

        def hook(mod, inputs, name=name):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            xtx[name] = xtx.get(name, 0) + x.t() @ x

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for row in ids:
            model(row[None].to("cuda"))
    for h in hooks:
        h.remove()
    layers = {n: (model.get_submodule(n).weight.detach().float().clone(),
                  {"xtx": xtx[n], "nsamples": ids.shape[0], "ntokens": ids.numel()}) for n in names}
    del model
    torch.cuda.empty_cache()
    return layers


@pytest.mark.integration
@pytest.mark.parametrize("params", [
    {"bits": 2, "group_size": 128, "act_order": False, "static_groups": False, "clip_search": False},
    {"bits": 3, "group_size": 128},  # the method defaults: act-order, static groups, clip search
    {"bits": 4, "group_size": -1, "act_order": True, "static_groups": False, "clip_search": True},
])
def test_smollm2_gptq(kernel, poisoned, smollm2_layers, params):
    for name, (weight, stats) in smollm2_layers.items():
        method = GPTQ(**params)
        with gptq_cuda.disabled():
            ref, ref_info = method.quantize(weight, stats)
        got, info = method.quantize(weight, stats)
        assert agreement(got.codes(), ref.codes()) >= AGREE, name
        assert rel(info["gptq_loss"], ref_info["gptq_loss"]) <= 1e-4, name


@pytest.mark.integration
def test_smollm2_ooc(kernel, poisoned, smollm2_layers):
    for name, (weight, stats) in smollm2_layers.items():
        h, w, u, _ = prepared(weight, stats)
        groups, cols = select_candidates(h, w, 128, 1.0, clear_count(0.1, 128))
        mask = torch.zeros(len(groups), w.shape[1], dtype=torch.bool, device="cuda")
        mask.scatter_(1, cols, True)
        wc = w.expand(len(groups), -1, -1)
        with gptq_cuda.disabled():
            ref = ooc_gptq(wc, u, 2, 3, 128, False, mask)
        got = ooc_gptq(wc, u, 2, 3, 128, False, mask)
        for what, a, b in zip(("codes", "scales", "zeros", "hscales", "hzeros"), got, ref):
            assert agreement(a, b) >= AGREE, (name, what)
        method = OOC(low_bits=2, high_bits=3, scan=1.0, group_size=128, per_row=True)
        with gptq_cuda.disabled():
            _, ref_info = method.quantize(weight, stats)
        _, info = method.quantize(weight, stats)
        assert rel(info["probe_loss"], ref_info["probe_loss"]) <= 1e-4, name
        for a, b in zip(info["probe_loss_candidates"], ref_info["probe_loss_candidates"]):
            assert rel(a, b) <= 1e-4, name
