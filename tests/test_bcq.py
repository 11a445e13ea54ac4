"""BCQ: the output-aware and the weight-error solvers, the kernel layout, uniform -> BCQ conversion, artifacts and
the CLI."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from factories import tiny_causal_lm
from gptq_helpers import correlated_inputs, hessian_stats
from quantkit import bitfamily
from quantkit.artifact import float_tensors, read_config, read_tensors, split_module_tensors, write_artifact
from quantkit.cli import main
from quantkit.engine import quantize_model
from quantkit.errors import QuantkitError
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.formats.bcq import BCQQuantizedTensor, bcq_from_uniform, pack_planes, unpack_planes
from quantkit.formats.uniform import UniformQuantizedTensor
from quantkit.methods import make_method
from quantkit.methods.bcq import _least_squares, _nearest, _sign_table, bcq_fit, weight_start
from quantkit.methods.bcq_output import (
    grid_values,
    output_bcq_fit,
    output_error,
    reconstruct,
    refit,
    sweep,
    uniform_start,
)
from quantkit.methods.gptq import inverse_cholesky, prepare_hessian
from quantkit.methods.rtn import rtn_quantize
from quantkit.models import adapter_for
from quantkit.runtime import QuantLinear, load_quantized
from test_kernel_lutgemm import TOL, _emulate, _save, emulator, reference, rel_err  # noqa: F401 (emulator: a fixture)


def _matrix(kind, k=48, d=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(k, d, generator=gen) * 0.02
    # Student-t with 3 degrees of freedom: heavy tails, like LLM weight outliers
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)
    return t.sample((k, d)) * 0.02


# ---- the solver ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gaussian", "student-t"])
@pytest.mark.parametrize("bits,offset", [(2, False), (3, False), (3, True), (4, True)])
def test_alternating_error_non_increasing_and_below_greedy(kind, bits, offset):
    w = _matrix(kind)  # d = 200, g = 64: three full groups and a partial one of 8
    fit = bcq_fit(w, bits, 64, offset, rounds=15)
    hist = fit.history
    assert len(hist) >= 2
    assert all(b <= a for a, b in zip(hist, hist[1:])), hist
    assert hist[-1] < hist[0] and fit.error < hist[0]  # strictly better than greedy, also once stored in fp16
    qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, fit.offset, fit.group_size)
    err = ((qt.dequantize() - w) ** 2).sum().item()
    assert err == pytest.approx(fit.error, rel=1e-4)  # the reported error is the stored tensor's


@pytest.mark.parametrize("group_size", [32, 48, -1])
def test_one_bit_matches_closed_form(group_size):
    w = _matrix("gaussian", k=16, d=100)
    fit = bcq_fit(w, 1, group_size, offset=False, rounds=15)
    g = 100 if group_size == -1 else group_size
    groups = [w[:, s : s + g] for s in range(0, 100, g)]
    mean_abs = torch.stack([grp.abs().mean(1) for grp in groups], 1)  # α = mean|w| per (row, group)
    torch.testing.assert_close(fit.alpha[..., 0], mean_abs.half().float(), rtol=2**-10, atol=0)
    assert torch.equal(fit.signs[0], w >= 0)  # b = sign w
    assert fit.history[-1] == pytest.approx(fit.history[0], rel=1e-6)  # greedy is already optimal


def test_degenerate_groups_are_finite():
    w = torch.zeros(4, 70)
    w[1] = 0.5  # constant row: planes coincide with the offset column
    w[2, ::2] = 1.0
    for bits, offset in [(4, True), (3, False), (8, True)]:
        fit = bcq_fit(w, bits, 8, offset, rounds=5)
        qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, fit.offset, fit.group_size)
        deq = qt.dequantize()
        assert torch.isfinite(deq).all()
        assert ((deq - w) ** 2).sum() <= 1e-6


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_is_refused(value):
    w = torch.randn(4, 64)
    w[2, 3] = value
    with pytest.raises(QuantkitError, match="NaN or Inf"):
        bcq_fit(w, 3, 32, True)


def test_method_contract():
    method = make_method("bcq", bits=3, group_size=64, offset=True, rounds=4, solver="weight")
    assert method.stats == () and method.config()["rounds"] == 4 and method.config()["solver"] == "weight"
    assert make_method("bcq").stats == ("hessian",)  # the default, output-aware solver needs calibration
    w = _matrix("gaussian")
    qt, info = method.quantize(w, None)
    assert qt.meta()["format"] == "bcq" and 1 <= info["bcq_rounds"] <= 4
    assert 0 < info["bcq_error"] < info["bcq_greedy_error"]
    for bad in ({"bits": 0}, {"bits": 9}, {"rounds": -1}, {"offset": "yes"}, {"group_size": -5}, {"solver": "hessian"},
                {"refits": -1}, {"init": "greedy"}):
        with pytest.raises(Exception, match="--"):
            make_method("bcq", **bad)


# ---- the output-aware solver --------------------------------------------------------------------

def _calibrated(k=32, d=576, seed=0):
    """A weight with a few strong columns and the Hessian stats of correlated, unevenly scaled inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = correlated_inputs(2 * d, d, gen)
    w = torch.randn(k, d, generator=gen) * 0.02
    w[:, :12] *= 4
    return w, hessian_stats(x)


def _output_error(w, qt, stats):
    h, w = prepare_hessian(stats["xtx"], stats["nsamples"], w)
    return output_error(w, qt.dequantize(), h).sum().item()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bits,offset", [(2, False), (2, True), (3, False), (3, True), (4, True)])
def test_output_solver_never_above_weight_solver(seed, bits, offset):
    w, stats = _calibrated(seed=seed)  # 576 wide, g = 128: four full groups and a partial one of 64
    out, info = make_method("bcq", bits=bits, group_size=128, offset=offset).quantize(w, stats)
    ref, _ = make_method("bcq", bits=bits, group_size=128, offset=offset, solver="weight").quantize(w, stats)
    assert _output_error(w, out, stats) <= _output_error(w, ref, stats)
    # the logged error is the stored tensor's (fp16 α and z), relative to tr(W H Wᵀ)
    h, wp = prepare_hessian(stats["xtx"], stats["nsamples"], w)
    norm = output_error(wp, torch.zeros_like(wp), h).sum().item()
    assert info["bcq_output_error"] == pytest.approx(_output_error(w, out, stats) / norm, rel=1e-4)
    assert out.alpha.dtype == torch.float16 and bool((out.alpha >= 0).all())  # the format's sign convention


@pytest.mark.parametrize("init", ["uniform", "weight", "best"])
def test_output_solver_error_never_rises(init):
    w, stats = _calibrated(seed=3)
    h, wp = prepare_hessian(stats["xtx"], stats["nsamples"], w)
    u, _ = inverse_cholesky(h, 0.01)
    fit = output_bcq_fit(wp, h, u, None, 3, 128, True, rounds=4, init=init, weight_fit=weight_start(3, 128, True, 15))
    assert all(b <= a for a, b in zip(fit.history, fit.history[1:])), fit.history
    assert fit.error == fit.history[-1] < fit.history[0]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_uniform_start_is_default_gptq(bits):
    """The uniform grid is a BCQ grid: swept on it, the codes are exactly the default GPTQ's at q bits
    (act-order, static groups, clip search). Stored, the offset is rounded to fp16, which moves the grid
    by at most 2^(q-12) of a step; the greedy sweep then drifts a little (within 5 % of GPTQ's output error)."""
    w, stats = _calibrated(seed=4)
    gptq, _ = make_method("gptq", bits=bits, group_size=128).quantize(w, stats)
    h, wp = prepare_hessian(stats["xtx"], stats["nsamples"], w)
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    u, _ = inverse_cholesky(h[perm][:, perm], 0.01)
    alpha, z = uniform_start(wp, bits, 128, True, True)
    converted = bcq_from_uniform(gptq)
    assert torch.equal(alpha.permute(1, 2, 0).half(), converted.alpha) and torch.equal(z.t().half(), converted.offset)
    exact_z = gptq.scales.float() * ((2**bits - 1) / 2 - gptq.zeros())  # the grid (c − z_u)·s, not rounded
    idx = sweep(wp, u, perm, grid_values(alpha, exact_z, bits), 128, 128)
    assert torch.equal(idx, gptq.codes().long())
    idx = sweep(wp, u, perm, grid_values(alpha, z, bits), 128, 128)
    signs = ((idx.unsqueeze(0) >> torch.arange(bits)[:, None, None]) & 1).bool()
    start = BCQQuantizedTensor.from_signs(signs, alpha, z, 128)
    assert _output_error(w, start, stats) == pytest.approx(_output_error(w, gptq, stats), rel=0.05)


def test_identity_hessian_reduces_to_the_weight_solver():
    """With H = c·I the two solvers take the same steps: the sweep has no error feedback, so its codes are
    exactly the nearest values' (equal codes), and the refit is the weight solver's per-group least squares
    (equal values up to fp32 sums). Started from the weight solver's fit, the output solver only continues
    that alternation (a least-squares step after the fp16 rounding, which the weight solver ends on), so its
    error is at most c times the weight solver's and within 1 % of it."""
    w = _matrix("student-t", k=24, d=200)
    c = 2.5
    h = c * torch.eye(200)
    u, _ = inverse_cholesky(h, 0.01)
    fit = bcq_fit(w, 3, 64, True, rounds=200)
    alpha, z, idx = weight_start(3, 64, True, 200)(w)
    # sweep = nearest, for the weight solver's grid and for a perturbed one
    for a in (alpha, (alpha * 1.1).half().float()):
        values = grid_values(a, z, 3)
        g = torch.nn.functional.pad(w, (0, 56)).reshape(24, 4, 64)
        nearest = _nearest(g, values).reshape(24, 256)[:, :200]
        assert torch.equal(sweep(w, u, None, values, 64, 32), nearest)
    # refit = the weight solver's least squares (compared as representable values: the refit folds signs)
    mask = (torch.arange(256) < 200).reshape(4, 64).float()
    ls_alpha, ls_z = _least_squares(torch.nn.functional.pad(w, (0, 56)).reshape(24, 4, 64), mask,
                                    torch.nn.functional.pad(idx, (0, 56)).reshape(24, 4, 64), _sign_table(3, "cpu"),
                                    True)
    r_alpha, r_z, r_idx = refit(w, h, idx, 3, 64, True)
    torch.testing.assert_close(reconstruct(grid_values(r_alpha, r_z, 3), r_idx, 64),
                               reconstruct(grid_values(ls_alpha, ls_z, 3), idx, 64), rtol=0, atol=2e-3 * w.abs().max())
    out = output_bcq_fit(w, h, u, None, 3, 64, True, rounds=4, init="weight", weight_fit=weight_start(3, 64, True, 200))
    assert out.error <= c * fit.error * (1 + 1e-6)
    assert out.error == pytest.approx(c * fit.error, rel=1e-2)


@pytest.mark.parametrize("offset", [False, True])
def test_output_bcq_serves_the_lut_reference(offset):
    w, stats = _calibrated(k=24, seed=5)
    qt, _ = make_method("bcq", bits=3, group_size=128, offset=offset).quantize(w, stats)
    assert qt.alpha.shape == (5, 3, 24)  # 576 = 4·128 + 64: a partial last group
    x = torch.randn(576, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_lut_gemv(qt, x), qt.dequantize().double() @ x.double(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("n,offset", [(1, True), (3, False), (8, True)])
def test_output_bcq_feeds_the_emulated_kernel(emulator, tmp_path, n, offset):  # noqa: F811 (the fixture)
    """The stored tensors of the output-aware solver go to the LUT-GEMM source (host emulation) as they
    are and give dequantize-then-matmul's result."""
    w, stats = _calibrated(k=64, seed=n)
    qt, _ = make_method("bcq", bits=3, group_size=128, offset=offset).quantize(w, stats)
    x = torch.randn(n, 576, generator=torch.Generator().manual_seed(n)).half()
    names = [("qweight", qt.qweight), ("alpha", qt.alpha), ("x", x)] + ([("offset", qt.offset)] if offset else [])
    for name, t in names:
        _save(tmp_path, name, t)
    _emulate(emulator, tmp_path, ["gemm", tmp_path, n, 576, 64, 3, 128, int(offset), 0, 3, 9])
    y = torch.from_numpy(np.fromfile(tmp_path / "y.bin", dtype=np.float16).reshape(n, 64))
    assert rel_err(y, reference(x, qt)) < TOL


def test_tiny_llama_output_bcq_through_the_engine():
    model = _tiny_llama()
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    method = make_method("bcq", bits=3, group_size=32, offset=True)
    qtensors, entries = quantize_model(model, adapter_for(model), method, calib, progress=False)
    assert all(qt.format_name == "bcq" for qt in qtensors.values()) and len(qtensors) == 14
    assert all(e["bcq_output_error"] <= e["bcq_start_output_error"] for e in entries)
    with pytest.raises(QuantkitError, match="calibration"):
        quantize_model(_tiny_llama(), adapter_for(model), method, None, progress=False)


# ---- the stored layout --------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 8, 31, 32, 33, 100])
def test_pack_unpack_round_trip_and_bit_order(d):
    q, k = 3, 5
    signs = torch.rand(q, k, d, generator=torch.Generator().manual_seed(d)) > 0.5
    packed = pack_planes(signs)
    words = (d + 31) // 32
    assert packed.dtype == torch.int32 and packed.shape == (q, words, k)
    assert torch.equal(unpack_planes(packed, d), signs)
    # frozen reference of the documented layout: bit j of qweight[i, w, r] is plane i, row r, column 32w + j
    for i in range(q):
        for r in range(k):
            for w in range(words):
                word = int(packed[i, w, r]) & 0xFFFFFFFF
                expected = sum(1 << j for j in range(32) if 32 * w + j < d and signs[i, r, 32 * w + j])
                assert word == expected  # padding bits are 0


def test_state_dict_round_trip():
    fit = bcq_fit(_matrix("gaussian", k=8, d=70), 3, 32, offset=True, rounds=2)
    qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, fit.offset, fit.group_size)
    meta = json.loads(json.dumps(qt.meta()))
    assert meta == {"format": "bcq", "bits": 3, "group_size": 32, "in_features": 70, "out_features": 8, "offset": True}
    assert set(qt.state_dict()) == {"qweight", "alpha", "offset"}
    assert qt.alpha.shape == (3, 3, 8) and qt.alpha.dtype == torch.float16 and qt.offset.shape == (3, 8)
    back = quantized_tensor_from_state_dict(meta, qt.state_dict())
    assert torch.equal(back.dequantize(), qt.dequantize())
    no_offset = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, None, 32)
    assert "offset" not in no_offset.state_dict() and no_offset.meta()["offset"] is False


def _lut_gemv(qt, x):
    """Reference LUT-GEMM (mu = 8) straight from the stored words: one 256-entry LUT per 8 columns."""
    q, words, k = qt.qweight.shape
    d, g = qt.in_features, qt.group_size
    assert g % 8 == 0
    xp = torch.nn.functional.pad(x, (0, 32 * words - d)).double()  # zero-padded x: padding bits add nothing
    keys = torch.arange(256)
    table = (((keys[:, None] >> torch.arange(8)) & 1) * 2 - 1).double()  # key bit t -> sign of column t
    luts = xp.reshape(-1, 8) @ table.t()  # [4W, 256]
    u = qt.qweight.to(torch.int64) & 0xFFFFFFFF
    byte_keys = (u.unsqueeze(-1) >> (8 * torch.arange(4))) & 0xFF  # [q, W, k, 4]: sub-vector 4w + m
    partial = luts[torch.arange(4 * words).reshape(words, 1, 4), byte_keys]  # [q, W, k, 4]
    per_sub = partial.permute(0, 2, 1, 3).reshape(q, k, 4 * words)[:, :, : (d + 7) // 8]
    groups = torch.arange(per_sub.shape[-1]) * 8 // g
    y = torch.zeros(k, dtype=torch.float64)
    for grp in range(qt.alpha.shape[0]):
        sums = per_sub[:, :, groups == grp].sum(-1)  # [q, k] = b_i · x over the group
        y += (qt.alpha[grp].double() * sums).sum(0)
        if qt.offset is not None:
            y += qt.offset[grp].double() * xp[grp * g : min(d, (grp + 1) * g)].sum()
    return y


@pytest.mark.parametrize("d,g,offset", [(256, 128, False), (200, 64, True), (96, 96, True)])
def test_layout_serves_a_lut_kernel(d, g, offset):
    fit = bcq_fit(_matrix("student-t", k=24, d=d), 3, g, offset, rounds=3)
    qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, fit.offset, fit.group_size)
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_lut_gemv(qt, x), qt.dequantize().double() @ x.double(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("bits,d,g,offset", [(2, 128, 32, False), (3, 576, 128, False), (3, 576, 128, True),
                                             (4, 96, 40, True), (3, 160, 160, False)])
def test_stored_bits_equal_the_formula(bits, d, g, offset):
    fit = bcq_fit(_matrix("gaussian", k=16, d=d), bits, g, offset, rounds=1)
    qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, fit.offset, fit.group_size)
    assert qt.bits_per_weight() == bitfamily.bcq_bits(bits, g, offset, d)  # d % 32 == 0: exact, padding-free
    assert bitfamily.formula_for_meta(qt.meta()) == qt.bits_per_weight()


def test_stored_bits_with_row_padding():
    d, bits = 100, 3  # 4 words per row: 28 padding bits per plane and row, counted as stored
    fit = bcq_fit(_matrix("gaussian", k=16, d=d), bits, 64, False, rounds=1)
    qt = BCQQuantizedTensor.from_signs(fit.signs, fit.alpha, None, 64)
    assert qt.bits_per_weight() == pytest.approx(bitfamily.bcq_bits(bits, 64, False, d) + bits * 28 / d)


# ---- uniform -> BCQ (LUT-GEMM appendix C) -------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 48, -1])
@pytest.mark.parametrize("sym", [False, True])
def test_uniform_to_bcq(bits, group_size, sym):
    w = _matrix("student-t", k=12, d=100, seed=bits)  # 100 = 3·32 + 4 and 2·48 + 4: partial last groups
    codes, scales, zeros, g = rtn_quantize(w, bits, group_size, sym)
    ut = UniformQuantizedTensor.from_codes(codes, scales, zeros, bits, g, sym)
    bt = bcq_from_uniform(ut)
    assert bt.meta() == {"format": "bcq", "bits": bits, "group_size": g, "in_features": 100, "out_features": 12,
                         "offset": True}
    # frozen reference: plane i = bit i of the integer code; α_i = 2^(i-1)·s and z = s·((2^q-1)/2 - z_u), both
    # fp32-exact, stored as their fp16 roundings (α_i is exact unless s·2^(i-1) is an fp16 subnormal)
    s = ut.scales.float()
    alpha = torch.stack([s * 2.0 ** (i - 1) for i in range(bits)], 1).permute(2, 1, 0)  # [G, q, k]
    z = (s * ((2**bits - 1) / 2 - ut.zeros())).t()  # [G, k]
    assert torch.equal(bt.signs(), torch.stack([((ut.codes().long() >> i) & 1).bool() for i in range(bits)]))
    assert torch.equal(bt.alpha, alpha.half()) and torch.equal(bt.offset, z.half())
    assert ((bt.offset.float() - z).abs() <= 2.0 ** (bits - 12) * s.t()).all()  # the bound bcq_from_uniform states
    # so the dequantized weights differ from the uniform ones by at most the fp16 rounding of α and z
    cols = torch.arange(100) // g
    bound = ((bt.alpha.float() - alpha).abs().sum(1) + (bt.offset.float() - z).abs()).t()[:, cols]
    uni, bcq = ut.dequantize(), bt.dequantize()
    assert ((bcq - uni).abs() <= bound + 2**-23 * uni.abs()).all()
    if sym and bits < 8:
        assert torch.equal(bcq, uni)  # z = −s/2 and α_i = 2^(i-1)·s are exact in fp16 for normal s


def test_uniform_with_g_idx_is_refused():
    codes, scales, zeros, g = rtn_quantize(_matrix("gaussian", k=4, d=64), 4, 32, False)
    ut = UniformQuantizedTensor.from_codes(codes, scales, zeros, 4, g, False, g_idx=torch.arange(64) // 32)
    with pytest.raises(Exception, match="g_idx"):
        bcq_from_uniform(ut)


# ---- a tiny llama through the engine, the artifact and the runtime ------------------------------

def _tiny_llama():
    return tiny_causal_lm("llama", intermediate=80, max_positions=128, rope_theta=100000.0, seed=0)


def _write(model, qtensors, out, qcfg):
    config = model.config.to_dict()
    config["use_cache"] = True
    write_artifact(out, model_config=config, tokenizer=None, qtensors=qtensors,
                   float_tensors=float_tensors(model, qtensors), quantization_config=qcfg, quant_log={})


def _round_float_params(model, quantized):
    """The artifact stores unquantized tensors in fp16: do the same to the in-memory model."""
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in quantized:
            param.data = param.data.half().float()


@pytest.mark.parametrize("offset", [False, True])
def test_tiny_llama_bcq_artifact_round_trip(tmp_path, offset):
    model = _tiny_llama()  # down_proj has d = 80: a partial last group and 16 padding bits per row
    method = make_method("bcq", bits=3, group_size=32, offset=offset, rounds=5, solver="weight")
    qtensors, entries = quantize_model(model, adapter_for(model), method, None, progress=False)
    assert all(qt.format_name == "bcq" for qt in qtensors.values()) and len(qtensors) == 14
    assert all(e["bcq_error"] < e["bcq_greedy_error"] for e in entries)
    out = tmp_path / "bcq"
    _write(model, qtensors, out, {"method": "bcq", **method.config(), "format": "bcq"})
    _round_float_params(model, qtensors)

    loaded = load_quantized(out)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == 14
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)

    for row in bitfamily.measured_bits(out)["modules"]:
        d = row["shape"][1]
        if d % 32 == 0:
            assert row["bits_per_weight"] == row["formula"]
        else:  # down_proj: 96 stored columns per plane for 80 weights
            assert row["bits_per_weight"] == pytest.approx(row["formula"] + 3 * (96 - d) / d)


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, False), (3, 48, False), (2, 32, True), (4, -1, True)])
def test_converted_uniform_artifact_dequantizes_the_same(tmp_path, bits, group_size, sym):
    model = _tiny_llama()
    method = make_method("rtn", bits=bits, group_size=group_size, sym=sym)
    qtensors, _ = quantize_model(model, adapter_for(model), method, None, progress=False)
    src, dst = tmp_path / "rtn", tmp_path / "bcq"
    _write(model, qtensors, src, {"method": "rtn", **method.config()})
    result = CliRunner().invoke(main, ["convert", str(src), "--to", "bcq", "--out", str(dst)])
    assert result.exit_code == 0, result.output

    qcfg = read_config(dst)["quantization_config"]
    assert qcfg["format"] == "bcq" and qcfg["converted_from"] == str(src) and qcfg["bits"] == bits
    per_src, rest_src = split_module_tensors(read_tensors(src), read_config(src)["quantization_config"]["modules"])
    per_dst, rest_dst = split_module_tensors(read_tensors(dst), qcfg["modules"])
    assert rest_src.keys() == rest_dst.keys() and all(torch.equal(rest_src[k], rest_dst[k]) for k in rest_src)
    for name, meta in qcfg["modules"].items():
        assert meta["format"] == "bcq"
        uni = qtensors[name].dequantize()
        bcq = quantized_tensor_from_state_dict(meta, per_dst[name]).dequantize()
        torch.testing.assert_close(bcq, uni, rtol=0, atol=uni.abs().max().item() * 2**-10)
        if sym:
            assert torch.equal(bcq, uni)

    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(dst)(ids).logits, load_quantized(src)(ids).logits,
                                   rtol=1e-3, atol=1e-3)
    result = CliRunner().invoke(main, ["convert", str(src), "--to", "bcq", "--out", str(dst)])
    assert result.exit_code == 2 and "--overwrite" in result.output


# ---- the command line ---------------------------------------------------------------------------

def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_quantize_bcq_and_format(tiny_llama_dir, tmp_path):
    out = tmp_path / "bcq"
    result = _run("quantize", "--model", tiny_llama_dir, "--method", "bcq", "--solver", "weight", "--bits", 2,
                  "--group-size", 32, "--offset", "--rounds", 3, "--out", out)
    assert result.exit_code == 0, result.output
    qcfg = read_config(out)["quantization_config"]
    assert qcfg["format"] == "bcq" and qcfg["offset"] is True and qcfg["rounds"] == 3
    assert {m["format"] for m in qcfg["modules"].values()} == {"bcq"}
    assert (out / "tokenizer_config.json").is_file()

    rtn, rtn_bcq = tmp_path / "rtn", tmp_path / "rtn-bcq"
    assert _run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--bits", 3, "--out", rtn).exit_code == 0
    result = _run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--bits", 3, "--format", "bcq",
                  "--out", rtn_bcq)
    assert result.exit_code == 0, result.output
    a, b = load_quantized(rtn), load_quantized(rtn_bcq)
    for name, module in b.named_modules():
        if isinstance(module, QuantLinear):
            assert module.meta["format"] == "bcq"
            ref = a.get_submodule(name).dequantized_weight()
            torch.testing.assert_close(module.dequantized_weight(), ref, rtol=0, atol=ref.abs().max().item() * 2**-10)

    preset = tmp_path / "p.yaml"
    preset.write_text("method: bcq\nsolver: weight\nbits: 2\ngroup-size: 64\noffset: true\nrounds: 2\n")
    assert _run("quantize", "--model", tiny_llama_dir, "--preset", preset, "--out", tmp_path / "p").exit_code == 0
    assert read_config(tmp_path / "p")["quantization_config"]["group_size"] == 64


@pytest.mark.parametrize("args,fragment", [
    (("--method", "bcq", "--format", "uniform"), "--format uniform is not available for --method bcq"),
    (("--method", "rtn", "--offset"), "--offset does not apply to --method rtn"),
    (("--method", "rtn", "--rounds", 3), "--rounds does not apply to --method rtn"),
    (("--method", "bcq", "--sym"), "--sym does not apply to --method bcq"),
    (("--method", "gptq", "--no-static-groups", "--format", "bcq"), "--static-groups"),
])
def test_cli_refusals(tiny_llama_dir, tmp_path, args, fragment):
    result = _run("quantize", "--model", tiny_llama_dir, *args, "--out", tmp_path / "x")
    assert result.exit_code == 2, result.output
    assert fragment in result.output and not (tmp_path / "x").exists()
