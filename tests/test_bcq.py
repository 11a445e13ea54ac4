"""BCQ: the alternating solver, the kernel layout, uniform -> BCQ conversion, artifacts and the CLI."""

import json

import pytest
import torch
from click.testing import CliRunner

from factories import tiny_causal_lm
from quantkit import bitfamily
from quantkit.artifact import float_tensors, read_config, read_tensors, split_module_tensors, write_artifact
from quantkit.cli import main
from quantkit.engine import quantize_model
from quantkit.errors import QuantkitError
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.formats.bcq import BCQQuantizedTensor, bcq_from_uniform, pack_planes, unpack_planes
from quantkit.formats.uniform import UniformQuantizedTensor
from quantkit.methods import make_method
from quantkit.methods.bcq import bcq_fit
from quantkit.methods.rtn import rtn_quantize
from quantkit.models import adapter_for
from quantkit.runtime import QuantLinear, load_quantized


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
    method = make_method("bcq", bits=3, group_size=64, offset=True, rounds=4)
    assert method.stats == () and method.config() == {"bits": 3, "group_size": 64, "offset": True, "rounds": 4}
    w = _matrix("gaussian")
    qt, info = method.quantize(w, None)
    assert qt.meta()["format"] == "bcq" and 1 <= info["bcq_rounds"] <= 4
    assert 0 < info["bcq_error"] < info["bcq_greedy_error"]
    for bad in ({"bits": 0}, {"bits": 9}, {"rounds": -1}, {"offset": "yes"}, {"group_size": -5}):
        with pytest.raises(Exception, match="--"):
            make_method("bcq", **bad)


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
    method = make_method("bcq", bits=3, group_size=32, offset=offset, rounds=5)
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
    result = _run("quantize", "--model", tiny_llama_dir, "--method", "bcq", "--bits", 2, "--group-size", 32,
                  "--offset", "--rounds", 3, "--out", out)
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
    preset.write_text("method: bcq\nbits: 2\ngroup-size: 64\noffset: true\nrounds: 2\n")
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
