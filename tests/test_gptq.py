"""GPTQ: equivalence with RTN at H = I, wins over RTN on correlated inputs, blocked == plain,
act-order artifacts, dead inputs, the Cholesky retry, settings, and the engine end to end."""

import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch
import yaml

from factories import tiny_causal_lm
from gptq_helpers import PLAIN, correlated_inputs, hessian_stats, quantize_to_artifact
from quantkit.artifact import read_config, read_tensors, split_module_tensors
from quantkit.engine import quantize_model
from quantkit.errors import QuantkitError
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.formats.uniform import quantize_codes, uniform_params
from quantkit.methods import make_method
from quantkit.methods.gptq import GPTQ
from quantkit.methods.rtn import RTN, rtn_quantize
from quantkit.models import adapter_for

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def plain_gptq(weight, xtx, nsamples, bits, group_size, sym, damp=0.01, act_order=False, static_groups=False):
    """Textbook GPTQ: one column at a time, every later column updated immediately; returns codes."""
    h = 2 * xtx / nsamples
    w = weight.clone()
    k, d = w.shape
    g = d if group_size == -1 else min(group_size, d)
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(d)
    static = [uniform_params(w[:, j : j + g], bits, sym) for j in range(0, d, g)]
    w, h = w[:, perm], h[perm][:, perm]
    h = h + damp * torch.diagonal(h).mean() * torch.eye(d, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.linalg.inv(h)).mT  # upper factor of H^-1
    codes = torch.zeros(k, d, dtype=torch.int64)
    for c in range(d):
        if static_groups:
            s, z = static[int(perm[c]) // g]
        elif c % g == 0:
            s, z = uniform_params(w[:, c : c + g], bits, sym)
        q = quantize_codes(w[:, c], s, z, bits)
        codes[:, perm[c]] = q.long()
        e = (w[:, c] - (q - z) * s) / u[c, c]
        w[:, c:] -= e[:, None] * u[c, c:][None, :]
    return codes


def output_error(x, w, w_hat):
    return (x @ (w - w_hat).t()).pow(2).sum().item()


@pytest.mark.parametrize("shape,bits,group_size,sym", [
    ((16, 576), 4, 128, False),  # SmolLM2 width: four full groups and a partial one
    ((8, 100), 3, 32, True),
    ((8, 64), 2, -1, False),
    ((4, 40), 8, 128, False),  # group larger than the row: per-channel
])
def test_identity_hessian_equals_rtn(shape, bits, group_size, sym):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen)
    d = shape[1]
    stats = {"xtx": torch.eye(d) * 8 / 2, "nsamples": 8, "ntokens": 8 * d}  # H = 2·xtx/n = I
    qt, info = GPTQ(bits=bits, group_size=group_size, sym=sym, **PLAIN).quantize(weight, stats)
    codes, scales, zeros, g = rtn_quantize(weight, bits, group_size, sym)
    assert torch.equal(qt.codes().long(), codes)
    assert torch.equal(qt.scales, scales.half())
    assert torch.equal(qt.zeros()[:, : scales.shape[1]], zeros)
    ref, _ = RTN(bits=bits, group_size=group_size, sym=sym).quantize(weight, None)
    for key, tensor in ref.state_dict().items():
        assert torch.equal(qt.state_dict()[key], tensor), key
    assert qt.g_idx is None and info["damp"] == 0.01 and info["gptq_loss"] > 0


def test_beats_rtn_on_correlated_inputs():
    ratios = []
    for seed, (k, d, bits, group_size, act_order) in enumerate([
        (32, 96, 3, 32, False), (32, 128, 4, -1, False), (24, 200, 3, 64, True),
        (16, 576, 4, 128, False), (16, 160, 2, 32, True), (48, 64, 4, 16, False),
    ]):
        gen = torch.Generator().manual_seed(seed)
        x = correlated_inputs(4 * d, d, gen)
        weight = torch.randn(k, d, generator=gen)
        method = GPTQ(bits=bits, group_size=group_size, **{**PLAIN, "act_order": act_order})
        qt, _ = method.quantize(weight, hessian_stats(x))
        rtn, _ = RTN(bits=bits, group_size=group_size).quantize(weight, None)
        e_gptq = output_error(x, weight, qt.dequantize())
        e_rtn = output_error(x, weight, rtn.dequantize())
        assert e_gptq <= e_rtn, (seed, e_gptq, e_rtn)
        ratios.append(e_gptq / e_rtn)
    assert sum(ratios) / len(ratios) < 0.8, ratios


@pytest.mark.parametrize("d,group_size,block_size,act_order,static_groups", [
    (100, 32, 128, False, False),   # groups start inside a block
    (100, 24, 16, False, False),    # groups cross block ends; partial last group
    (96, -1, 32, False, False),     # per-channel
    (100, 32, 16, True, False),     # act-order, g_idx
    (100, 32, 16, True, True),      # act-order + static groups
    (70, 32, 128, False, True),     # static groups, no act-order
])
def test_blocked_equals_plain(d, group_size, block_size, act_order, static_groups):
    gen = torch.Generator().manual_seed(d + group_size + block_size)
    x = correlated_inputs(3 * d, d, gen, torch.float64)
    x[:, 5] = 0  # a dead input too
    weight = torch.randn(12, d, generator=gen, dtype=torch.float64)
    stats = hessian_stats(x)
    method = GPTQ(bits=3, group_size=group_size, act_order=act_order, static_groups=static_groups, clip_search=False,
                  block_size=block_size)
    qt, _ = method.quantize(weight, stats)
    expected = plain_gptq(weight, stats["xtx"], stats["nsamples"], 3, group_size, False,
                          act_order=act_order, static_groups=static_groups)
    assert torch.equal(qt.codes().long(), expected)
    assert (qt.g_idx is not None) == (act_order and not static_groups)


def test_block_size_does_not_change_result_fp32():
    gen = torch.Generator().manual_seed(1)
    x = correlated_inputs(400, 200, gen)
    weight = torch.randn(32, 200, generator=gen)
    results = [GPTQ(bits=4, group_size=48, block_size=b, **PLAIN).quantize(weight, hessian_stats(x))[0].codes()
               for b in (7, 64, 128)]
    for other in results[1:]:  # fp32 rounding of the lazy updates may flip a rare tie
        assert (other != results[0]).float().mean() < 1e-3


@pytest.mark.parametrize("static_groups", [True, False])
def test_act_order_artifact_round_trip(tmp_path, static_groups):
    from quantkit.runtime import load_quantized

    model = tiny_causal_lm(intermediate=128, seed=0)
    method = make_method("gptq", bits=3, group_size=24, act_order=True, static_groups=static_groups)
    out, qtensors, entries = quantize_to_artifact(model, method, tmp_path / "art")
    modules = read_config(out)["quantization_config"]["modules"]
    per_module, _ = split_module_tensors(read_tensors(out), modules)
    loaded = load_quantized(out)
    for name, meta in modules.items():
        qt = quantized_tensor_from_state_dict(meta, per_module[name])
        assert ("g_idx" in per_module[name]) == (not static_groups)
        # the engine put the dequantized weight back into the model: the artifact must give the same
        assert torch.equal(qt.dequantize(), model.get_submodule(name).weight)
        assert torch.equal(loaded.get_submodule(name).dequantized_weight(torch.float32), qt.dequantize())
    assert all("damp" in e and "gptq_loss" in e for e in entries)


def test_dead_inputs():
    gen = torch.Generator().manual_seed(3)
    x = correlated_inputs(200, 64, gen)
    dead = [0, 7, 63]
    x[:, dead] = 0
    weight = torch.randn(16, 64, generator=gen)
    for act_order in (False, True):
        qt, info = GPTQ(bits=3, group_size=16, **{**PLAIN, "act_order": act_order}).quantize(weight, hessian_stats(x))
        w_hat = qt.dequantize()
        assert torch.isfinite(w_hat).all() and info["damp"] == 0.01
        assert torch.equal(w_hat[:, dead], torch.zeros(16, 3))  # unused inputs: weight zeroed
    # every input dead: H becomes I, the whole weight is zeroed
    qt, _ = GPTQ(bits=4).quantize(weight, {"xtx": torch.zeros(64, 64), "nsamples": 2, "ntokens": 64})
    assert torch.equal(qt.dequantize(), torch.zeros(16, 64))


def test_cholesky_retry():
    d = 32
    v = torch.ones(d) / d**0.5
    h = torch.eye(d) - 1.05 * torch.outer(v, v)  # one eigenvalue -0.05: fails at damp 0.01, fine at 0.1
    weight = torch.randn(8, d, generator=torch.Generator().manual_seed(4))
    qt, info = GPTQ(bits=4, group_size=16, **PLAIN).quantize(weight, {"xtx": h * 2, "nsamples": 4, "ntokens": 64})
    assert info["damp"] == pytest.approx(0.1)
    assert torch.isfinite(qt.dequantize()).all()
    with pytest.raises(QuantkitError, match="damp"):  # never positive definite
        GPTQ().quantize(weight, {"xtx": -torch.eye(d), "nsamples": 4, "ntokens": 64})


def test_linears_reading_one_input_share_the_inverse(monkeypatch):
    """q/k/v (one stats object) compute U once; each result equals a fresh method's; new statistics, even equal
    ones in another tensor, compute it again."""
    from quantkit.methods import gptq as gptq_module

    gen = torch.Generator().manual_seed(5)
    x = correlated_inputs(300, 64, gen)
    x[:, 3] = 0  # a dead input: each weight's column 3 is zeroed, the shared H is fixed up once
    stats = hessian_stats(x)
    weights = [torch.randn(16, 64, generator=gen) for _ in range(3)]
    calls = []
    real = gptq_module.ordered_inverse
    monkeypatch.setattr(gptq_module, "ordered_inverse", lambda *a: calls.append(1) or real(*a))
    shared = GPTQ(bits=3, group_size=16)
    got = [shared.quantize(w, stats) for w in weights]
    assert len(calls) == 1
    fresh = [GPTQ(bits=3, group_size=16).quantize(w, stats) for w in weights]
    assert len(calls) == 4
    for (qt, info), (ref, ref_info) in zip(got, fresh):
        assert info == ref_info
        assert all(torch.equal(qt.state_dict()[k], v) for k, v in ref.state_dict().items())
    shared.quantize(weights[0], {**stats, "xtx": stats["xtx"].clone()})
    assert len(calls) == 5
    kept_stats = {**stats, "xtx": stats["xtx"].clone()}
    shared.quantize(weights[0], kept_stats)
    kept_stats["xtx"].mul_(2)  # changed in place (statistics are read-only; still not reused stale)
    shared.quantize(weights[0], kept_stats)
    assert len(calls) == 7
    del kept_stats
    gc.collect()
    assert "_last_inverse" not in shared.__dict__  # that call's statistics are gone, and their U with them
    shared.quantize(weights[1], stats)
    assert len(calls) == 8
    kept = weakref.ref(shared.__dict__["_last_inverse"][2][1])
    assert kept() is not None  # kept while its statistics live
    del stats, got, fresh
    gc.collect()
    assert kept() is None and "_last_inverse" not in shared.__dict__


def test_reversed_cholesky_is_the_references_factor():
    """U from one factorisation and a triangular inverse (what CUDA runs) equals the reference's three
    factorisations: upper triangular, UᵀU = A⁻¹; and it fails where A is not positive definite."""
    from quantkit.methods.gptq import reversed_cholesky_factor, three_factorisations_factor

    gen = torch.Generator().manual_seed(6)
    x = correlated_inputs(400, 96, gen, torch.float64)
    a = x.T @ x + 0.01 * torch.eye(96, dtype=torch.float64)
    u, reference = reversed_cholesky_factor(a), three_factorisations_factor(a)
    assert torch.equal(u, torch.triu(u)) and bool((torch.diagonal(u) > 0).all())
    assert torch.allclose(u, reference, rtol=0, atol=1e-10 * reference.abs().max().item())
    assert torch.allclose(u.T @ u @ a, torch.eye(96, dtype=torch.float64), atol=1e-8)
    indefinite = a - 2 * torch.linalg.eigvalsh(a)[-1] * torch.eye(96, dtype=torch.float64)
    assert reversed_cholesky_factor(indefinite) is None and three_factorisations_factor(indefinite) is None


@pytest.mark.requires("cuda")
def test_cuda_inverse_factor_is_accurate_in_fp32():
    """The CUDA path's U in fp32 against the fp64 reference: the error of an fp32 factorisation, no more."""
    from quantkit.methods.gptq import inverse_cholesky, three_factorisations_factor

    gen = torch.Generator().manual_seed(7)
    x = correlated_inputs(3000, 1024, gen, torch.float64)
    h = x.T @ x
    reference = three_factorisations_factor(h + 0.01 * torch.diagonal(h).mean() * torch.eye(1024, dtype=h.dtype))
    u, damp = inverse_cholesky(h.float().cuda(), 0.01)
    assert damp == 0.01
    assert (u.double().cpu() - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 1}, "--bits"), ({"group_size": -5}, "--group-size"), ({"damp": 0.0}, "--damp"),
    ({"damp": 2.0}, "--damp"), ({"block_size": 0}, "--block-size"), ({"act_order": "yes"}, "act_order"),
    ({"percdamp": 0.1}, "does not take"),
])
def test_validation(kwargs, match):
    with pytest.raises(QuantkitError, match=match):
        make_method("gptq", **kwargs)


def test_presets_and_cli_options():
    from quantkit.cli import quantize

    options = {p.name for p in quantize.params}
    presets = sorted(CONFIGS.glob("gptq-*.yaml"))
    assert {p.name for p in presets} >= {"gptq-w4g128.yaml", "gptq-w3g128.yaml", "gptq-w2g128.yaml",
                                        "gptq-w4g128-actorder.yaml"}
    for preset in presets:
        values = {k.replace("-", "_"): v for k, v in yaml.safe_load(preset.read_text()).items()}
        assert set(values) <= options, preset
        assert values.pop("method") == "gptq"
        make_method("gptq", **values)
    defaults = {p.name: p.default for p in quantize.params}
    for key in GPTQ.params:  # unset options leave the method's own defaults in force
        assert defaults[key] is None, key


def test_engine_gptq_beats_rtn_on_tiny_llama():
    model = tiny_causal_lm(intermediate=128, seed=1)
    adapter = adapter_for(model)
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    logs = {}
    for name in ("rtn", "gptq"):
        method = make_method(name, bits=3, group_size=32)
        _, entries = quantize_model(copy.deepcopy(model), adapter, method, calib, progress=False)
        logs[name] = {e["module"]: e for e in entries}
    wins = [logs["gptq"][m]["output_mse"] <= logs["rtn"][m]["output_mse"] for m in logs["rtn"]]
    assert sum(wins) >= 0.8 * len(wins), wins
    assert all(e["damp"] == 0.01 and e["gptq_loss"] > 0 for e in logs["gptq"].values())


@pytest.mark.requires("cuda")
@pytest.mark.parametrize("static_groups", [False, True])  # with static groups no g_idx is stored
def test_cuda_matches_cpu(static_groups):
    gen = torch.Generator().manual_seed(5)
    x = correlated_inputs(300, 150, gen, torch.float64)
    weight = torch.randn(24, 150, generator=gen, dtype=torch.float64)
    method = GPTQ(bits=3, group_size=32, act_order=True, static_groups=static_groups)
    cpu, _ = method.quantize(weight, hessian_stats(x))
    stats = {k: v.cuda() if torch.is_tensor(v) else v for k, v in hessian_stats(x).items()}
    gpu, _ = method.quantize(weight.cuda(), stats)
    assert torch.equal(gpu.codes().cpu(), cpu.codes())
    assert (gpu.g_idx is None) == (cpu.g_idx is None) == static_groups
    if not static_groups:
        assert torch.equal(gpu.g_idx.cpu(), cpu.g_idx)
