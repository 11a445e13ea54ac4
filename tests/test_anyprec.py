"""Any-precision (SqueezeLLM seed + incremental upscaling) and its bitplane format."""

import pytest
import torch

from factories import tiny_causal_lm
from quantkit import bitfamily
from quantkit.errors import QuantkitError
from quantkit.formats.anyprec import AnyPrecisionTensor, pack_bitplanes, unpack_bitplanes
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.methods import make_method
from quantkit.methods.kmeans import weighted_kmeans_1d


def _rows(rows=24, n=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 0.05
    x[:, :4] *= 8  # a few outliers per row, as in LLM weights
    w = torch.rand(rows, n, generator=g) ** 2 + 1e-3
    return x, w


def _stats(d, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, d, generator=g) * torch.rand(d, generator=g) * 3
    return {"xtx": x.t() @ x, "nsamples": 4, "ntokens": 64}


def test_weighted_kmeans_matches_sklearn_inertia():
    from sklearn.cluster import KMeans

    x, w = _rows(rows=96)
    centroids, codes, inertia = weighted_kmeans_1d(x, w, 8)
    # the reported inertia is the inertia of the returned assignment
    direct = (w.double() * (x.double() - torch.gather(centroids, 1, codes)) ** 2).sum(1)
    assert torch.allclose(direct, inertia, rtol=1e-9)
    ref = [KMeans(8, n_init="auto", random_state=r).fit(
        x[r].double().numpy()[:, None], sample_weight=w[r].double().numpy()).inertia_ for r in range(x.shape[0])]
    ratio = inertia / torch.tensor(ref, dtype=torch.float64)
    assert inertia.sum() <= 1.01 * sum(ref), ratio
    assert ratio.median() <= 1.01, ratio


@pytest.mark.parametrize("bits,d", [(8, 576), (3, 100), (1, 32), (5, 33)])
def test_bitplane_round_trip(bits, d):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (7, d), generator=g)
    planes = pack_bitplanes(codes, bits)
    assert planes.shape == (bits, 7, (d + 31) // 32) and planes.dtype == torch.int32
    assert torch.equal(unpack_bitplanes(planes, d), codes)
    for top in range(1, bits + 1):  # the top planes alone give the top bits
        assert torch.equal(unpack_bitplanes(planes, d, top), codes >> (bits - top))
    # plane 0 is the most significant bit; bit j of word w is column 32w + j
    column1_top_bit = (planes[0, :, 0].to(torch.int64) & 0xFFFFFFFF) >> 1 & 1
    assert column1_top_bit.tolist() == ((codes[:, 1] >> (bits - 1)) & 1).tolist()


def _anyprec(weight, stats, seed=3, parent=8, sensitivity="activation"):
    # the k-means tables: what the upscaling tests are about (the output refit has its own tests below)
    method = make_method("anyprec", seed_bits=seed, parent_bits=parent, sensitivity=sensitivity, table_refit="none",
                         upscale="split")
    return method.quantize(weight, stats)[0]


def test_codes_are_nested_and_tables_agree():
    torch.manual_seed(0)
    weight = torch.randn(48, 100) * 0.02
    weight[3, 7] = 0.5
    stats = _stats(100)
    qt = _anyprec(weight, stats)
    parent = qt.codes()
    for b in range(3, 9):
        code_b = qt.codes(b)
        assert torch.equal(code_b, parent >> (8 - b))  # nested, for every weight
        # the b-bit dequantization from the parent artifact equals the one from the b-bit table
        expected = torch.gather(qt.luts[b].float(), 1, code_b)
        assert torch.equal(qt.dequantize(torch.float32, bits=b), expected)
    # each split refines its parent cluster: error falls with every extra bit
    errs = [(qt.dequantize(bits=b) - weight).pow(2).mul(stats["xtx"].diagonal()).sum().item() for b in range(3, 9)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    # splitting never moves the seed's boundaries: the seed is the squeezellm result at 3 bits
    sq, _ = make_method("squeezellm", bits=3).quantize(weight, stats)
    assert torch.equal(sq.dequantize(), qt.dequantize(bits=3))
    with pytest.raises(QuantkitError):
        qt.dequantize(bits=2)


def test_state_dict_round_trip_and_bits():
    weight = torch.randn(16, 96)
    qt = _anyprec(weight, None, 2, 4, "none")
    again = quantized_tensor_from_state_dict(qt.meta(), qt.state_dict())
    assert isinstance(again, AnyPrecisionTensor)
    for b in (2, 3, 4):
        assert torch.equal(again.dequantize(bits=b), qt.dequantize(bits=b))
    assert qt.bits_per_weight() == bitfamily.anyprec_bits(2, 4, 96)
    assert qt.bits_read(3) == bitfamily.anyprec_read_bits(3, 96) == 3 + 8 * 16 / 96
    sq, _ = make_method("squeezellm", bits=3, sensitivity="none").quantize(weight, None)
    assert sq.bits_per_weight() == bitfamily.codebook_bits(3, 96)


def test_upscaled_error_close_to_independent():
    """A 4-bit model upscaled from a 3-bit seed should lose little to an independent 4-bit k-means."""
    weight = torch.randn(64, 256) * 0.02
    stats = _stats(256)
    diag = stats["xtx"].diagonal()
    up = _anyprec(weight, stats, 3, 4).dequantize(bits=4)
    ind = make_method("squeezellm", bits=4).quantize(weight, stats)[0].dequantize()
    err = lambda w: (w - weight).pow(2).mul(diag).sum().item()  # noqa: E731
    assert err(up) <= 1.15 * err(ind), (err(up), err(ind))


def test_tiny_llama_every_width(tiny_llama_dir, tmp_path, data_dir):
    from quantkit.pipeline import evaluate_ppl, load_for_eval, quantize_checkpoint
    from quantkit.runtime import QuantLinear, load_quantized

    out = tmp_path / "ap"
    quantize_checkpoint(str(tiny_llama_dir), out, "anyprec", {"seed_bits": 2, "parent_bits": 4}, nsamples=4,
                        seqlen=32, data_dir=data_dir, progress=False)
    report = bitfamily.measured_bits(out)
    for row in report["modules"]:
        assert row["bits_per_weight"] == row["formula"]  # d = 64 or 160: % 32 == 0
        assert set(row["read_bits"]) == {2, 3, 4}
    reference, _, _ = load_for_eval(str(tiny_llama_dir))
    for param in reference.parameters():  # the artifact keeps unquantized tensors in fp16
        param.data = param.data.half().float()
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    model = load_quantized(out)
    qlinears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    logits = {}
    served = load_quantized(out, bits=3)  # served width chosen at load time
    for b in (2, 3, 4):
        for name, module in qlinears.items():
            module.set_bits(b)  # switch in place, no reload
            reference.get_submodule(name).weight.data = module.qtensor().dequantize(torch.float32, bits=b)
        want = reference(ids).logits
        if b == 3:
            assert torch.allclose(served(ids).logits, want, atol=1e-5, rtol=1e-5)
        logits[b] = model(ids).logits
        assert torch.allclose(logits[b], want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[2], logits[4])
    results = evaluate_ppl(str(out), ["wikitext2"], seqlen=64, max_windows=2, data_dir=data_dir, progress=False, bits=3)
    assert results[0]["served_bits"] == 3 and torch.isfinite(torch.tensor(results[0]["ppl"]))
    with pytest.raises(QuantkitError):
        load_quantized(out, bits=5)


def test_cli_quantize_and_eval_bits(tiny_llama_dir, tmp_path, data_dir):
    import json

    from click.testing import CliRunner

    from quantkit.cli import main

    out = tmp_path / "ap"
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--method", "anyprec", "--seed-bits", "2",
                                  "--parent-bits", "3", "--sensitivity", "none", "--table-refit", "none",
                                  "--upscale", "split", "--out", str(out), "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["seed_bits"] == 2 and cfg["parent_bits"] == 3 and cfg["sensitivity"] == "none"
    result = runner.invoke(main, ["eval", "ppl", "--model", str(out), "--bits", "2", "--seqlen", "64",
                                  "--max-windows", "1", "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["eval", "ppl", "--model", str(out), "--bits", "4", "--seqlen", "64",
                                  "--max-windows", "1", "--data-dir", str(data_dir)])
    assert result.exit_code == 2 and "not stored" in result.output
    result = runner.invoke(main, ["bitfamily", str(out)])
    assert result.exit_code == 0 and "read when serving" in result.output, result.output
    result = runner.invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--method", "rtn", "--seed-bits", "2",
                                  "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "does not apply" in result.output


def test_fisher_sensitivity_matches_per_window_autograd():
    from quantkit.engine.fisher import fisher_sensitivity

    model = tiny_causal_lm("llama", vocab=96, hidden=32, intermediate=64, seed=0)
    ids = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(0))
    fisher = fisher_sensitivity(model, ids)
    assert "lm_head" not in fisher and len(fisher) == 2 * 7
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())
    name = "model.layers.1.mlp.down_proj"
    weight = model.get_submodule(name).weight
    expected = torch.zeros_like(weight)
    for row in ids:
        model.zero_grad()
        model(row[None], labels=row[None]).loss.backward()
        expected += weight.grad.pow(2)
    assert torch.allclose(fisher[name], expected, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("amx,avx512_bf16,expected", [(False, False, torch.float32), (True, False, torch.bfloat16),
                                                     (False, True, torch.bfloat16)])
def test_fisher_cpu_dtype_follows_the_hardware(monkeypatch, amx, avx512_bf16, expected):
    """bf16 only where the CPU multiplies it natively: emulated bf16 was 2.2x slower than fp32 here."""
    from quantkit.engine import fisher

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert fisher.cpu_default_dtype() == expected


def test_fisher_sensitivity_through_the_pipeline(tiny_llama_dir, tmp_path, data_dir):
    from quantkit.pipeline import quantize_checkpoint
    from quantkit.runtime import load_quantized

    out = tmp_path / "ap-fisher"
    summary = quantize_checkpoint(str(tiny_llama_dir), out, "anyprec",
                                  {"seed_bits": 2, "parent_bits": 3, "sensitivity": "fisher"}, nsamples=2,
                                  seqlen=32, data_dir=data_dir, progress=False)
    assert summary["sensitivity_seconds"] >= 0 and summary["settings"]["sensitivity"] == "fisher"
    model = load_quantized(out, bits=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).logits).all()


def test_non_finite_fisher_is_refused(tiny_llama_dir, tmp_path, data_dir, monkeypatch):
    from quantkit.engine import fisher
    from quantkit.pipeline import quantize_checkpoint

    def overflowed(model, calib_ids, names, device):  # as squared fp16 gradients that overflow would give
        return {name: torch.full_like(model.get_submodule(name).weight, float("inf")) for name in names}

    monkeypatch.setattr(fisher, "fisher_sensitivity", overflowed)
    out = tmp_path / "ap-fisher"
    with pytest.raises(QuantkitError, match="Fisher sensitivity is not finite"):
        quantize_checkpoint(str(tiny_llama_dir), out, "anyprec", {"seed_bits": 2, "parent_bits": 3,
                            "sensitivity": "fisher"}, nsamples=2, seqlen=32, data_dir=data_dir, progress=False)
    assert not out.exists()


def test_preset_is_the_paper_setting_with_method_defaults():
    from pathlib import Path

    import yaml

    from quantkit.cli import quantize

    preset = Path(__file__).resolve().parents[1] / "configs" / "anyprec-3to8.yaml"
    values = {k.replace("-", "_"): v for k, v in yaml.safe_load(preset.read_text()).items()}
    assert set(values) <= {p.name for p in quantize.params}
    assert values.pop("method") == "anyprec"
    method = make_method("anyprec", **values)
    assert (method.seed_bits, method.parent_bits, method.sensitivity) == (3, 8, "fisher")
    assert method.config()["upscale"] == make_method("anyprec").config()["upscale"]  # the method's default


@pytest.mark.parametrize("bad", ["weight_nan", "weight_inf", "sens_inf", "sens_negative"])
def test_torch_kmeans_refuses_non_finite_input(bad):
    # the torch path (used when the C++ extension is unavailable) must fail as clearly as the C++ one
    x, w = _rows(rows=3, n=40)
    if bad.startswith("weight"):
        x[1, 5] = float("nan") if bad == "weight_nan" else float("inf")
    else:
        w[2, 7] = float("inf") if bad == "sens_inf" else -1.0
    with pytest.raises(QuantkitError, match="not finite|negative"):
        weighted_kmeans_1d(x, w, 4)


# ---- output-aware table refit -------------------------------------------------------------------

def _correlated_problem(k=24, d=160, seed=0):
    from gptq_helpers import correlated_inputs, hessian_stats

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(k, d, generator=gen) * 0.02, hessian_stats(correlated_inputs(3 * d, d, gen))


def _output_errors(weight, w_hat, xtx):
    delta = weight - w_hat
    return ((delta @ xtx) * delta).sum(dim=1)


def test_table_refit_never_raises_a_rows_output_error_and_helps_overall():
    from quantkit.methods.table_refit import refit_table

    weight, stats = _correlated_problem()
    settings = {"seed_bits": 3, "parent_bits": 6, "upscale": "split"}
    plain, _ = make_method("anyprec", table_refit="none", **settings).quantize(weight, stats)
    refit, info = make_method("anyprec", refit_seed=True, **settings).quantize(weight, stats)
    seed_kept, _ = make_method("anyprec", **settings).quantize(weight, stats)
    # without refit_seed the seed keeps its k-means table (independent SqueezeLLM), the widths above are refitted
    assert torch.equal(seed_kept.luts[3], plain.luts[3])
    assert all(torch.equal(seed_kept.luts[b], refit.luts[b]) for b in range(4, 7))
    assert torch.equal(plain.planes, refit.planes)  # codes fixed: only the tables move
    for b in range(3, 7):
        before = _output_errors(weight, plain.dequantize(bits=b), stats["xtx"])
        after = _output_errors(weight, refit.dequantize(bits=b), stats["xtx"])
        assert bool((after <= before).all()) and after.sum() < 0.99 * before.sum(), b
        assert info["table_refit_rows"][b] == int((after < before).sum())
    # with H diagonal the output error is the diagonally weighted error: the weighted cluster means that
    # k-means already stores are its least-squares table, so nothing moves beyond the fp16 rounding
    diag = torch.diag(stats["xtx"].diagonal())
    codes = plain.codes(4)
    table, _ = refit_table(weight, codes, plain.luts[4].float(), diag)
    torch.testing.assert_close(table, plain.luts[4].float(), rtol=2**-10, atol=1e-6)


def test_squeezellm_table_refit_is_opt_in():
    weight, stats = _correlated_problem(seed=1)
    assert make_method("squeezellm").config()["table_refit"] == "none"
    assert make_method("squeezellm", sensitivity="none").stats == ()
    assert make_method("squeezellm", sensitivity="none", table_refit="output").stats == ("hessian",)
    plain, _ = make_method("squeezellm", bits=4).quantize(weight, stats)
    refit, _ = make_method("squeezellm", bits=4, table_refit="output").quantize(weight, stats)
    assert _output_errors(weight, refit.dequantize(), stats["xtx"]).sum() < \
        _output_errors(weight, plain.dequantize(), stats["xtx"]).sum()
