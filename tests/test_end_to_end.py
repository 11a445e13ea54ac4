"""quantize -> artifact -> reload -> eval on tiny llama- and OPT-style models built from configs."""

import json

import pytest
import torch

from quantkit import bitfamily
from quantkit.artifact import read_config
from quantkit.errors import QuantkitError
from quantkit.pipeline import evaluate_ppl, load_for_eval, quantize_checkpoint
from quantkit.runtime import QuantLinear, load_quantized


@pytest.fixture(params=["tiny_llama_dir", "tiny_opt_dir"])
def tiny_dir(request):
    return request.getfixturevalue(request.param)


def _rtn(src, out, data_dir, nsamples=0, overwrite=False, **settings):
    params = {"bits": 4, "group_size": 32, "sym": False, **settings}
    return quantize_checkpoint(str(src), out, "rtn", params, nsamples=nsamples, seqlen=32, data_dir=data_dir,
                               overwrite=overwrite, progress=False)


def test_quantize_reload_eval(tiny_dir, tmp_path, data_dir):
    out = tmp_path / "art"
    summary = _rtn(tiny_dir, out, data_dir, nsamples=4)
    expected_linears = 7 if "llama" in str(tiny_dir) else 6  # q k v o gate up down / q k v out fc1 fc2
    assert summary["modules_quantized"] == 2 * expected_linears
    model = load_quantized(out)
    qlinears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(qlinears) == summary["modules_quantized"]

    # the reloaded model equals the float model with the dequantized weights put back
    reference, _, _ = load_for_eval(str(tiny_dir))
    for param in reference.parameters():  # the artifact keeps unquantized tensors in fp16
        param.data = param.data.half().float()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            reference.get_submodule(name).weight.data = module.dequantized_weight(torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)

    log = json.loads((out / "quant_log.json").read_text())
    assert all(entry["output_mse"] >= 0 for entry in log["modules"])
    assert log["calibration"]["nsamples"] == 4 and log["calibration"]["seed"] == 0

    results = evaluate_ppl(str(out), ["wikitext2"], seqlen=64, max_windows=2, data_dir=data_dir, progress=False)
    assert results[0]["windows"] == 2 and torch.isfinite(torch.tensor(results[0]["ppl"]))
    assert results[0]["protocol"] == "gptq-wikitext2"


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, False), (3, 32, False), (2, 64, True), (4, -1, False)])
def test_measured_bits_equal_the_formula(tiny_llama_dir, tmp_path, data_dir, bits, group_size, sym):
    out = tmp_path / "art"
    _rtn(tiny_llama_dir, out, data_dir, bits=bits, group_size=group_size, sym=sym)
    report = bitfamily.measured_bits(out)
    for row in report["modules"]:
        assert row["bits_per_weight"] == row["formula"]
    d = 64  # every tiny-llama linear but down_proj has 64 inputs
    row = next(r for r in report["modules"] if r["module"].endswith("q_proj"))
    g = d if group_size == -1 else group_size
    assert row["bits_per_weight"] == pytest.approx(bits + ((0 if sym else bits) + 16) / g)


def test_reloaded_codes_equal_quantizer_codes(tiny_llama_dir, tmp_path, data_dir):
    from quantkit.methods import make_method
    from quantkit.models import load_model, resolve_source

    out = tmp_path / "art"
    _rtn(tiny_llama_dir, out, data_dir, bits=3, group_size=32)
    float_model = load_model(resolve_source(str(tiny_llama_dir)))
    name = "model.layers.1.mlp.down_proj"
    weight = float_model.get_submodule(name).weight.float()
    expected, _ = make_method("rtn", bits=3, group_size=32).quantize(weight, None)
    stored = load_quantized(out).get_submodule(name).qtensor()
    assert torch.equal(stored.codes(), expected.codes())
    assert torch.equal(stored.scales, expected.scales)


def test_existing_output_is_kept_without_overwrite(tiny_llama_dir, tmp_path, data_dir):
    out = tmp_path / "art"
    _rtn(tiny_llama_dir, out, data_dir)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(QuantkitError, match="already exists"):
        _rtn(tiny_llama_dir, out, data_dir, bits=2)
    assert (out / "model.safetensors").read_bytes() == before
    assert not list(tmp_path.glob(".art.tmp-*"))


def test_altered_artifact_is_detected(tiny_llama_dir, tmp_path, data_dir):
    out = tmp_path / "art"
    _rtn(tiny_llama_dir, out, data_dir)
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(QuantkitError, match="model.safetensors: checksum mismatch"):
        load_quantized(out)
    load_quantized(out, verify=False)  # opt-out still loads (the flipped byte is inside a tensor)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(QuantkitError, match="model.safetensors"):
        load_quantized(out, verify=False)


def test_artifact_config_keeps_rope_base(tiny_llama_dir, tmp_path, data_dir):
    out = tmp_path / "art"
    _rtn(tiny_llama_dir, out, data_dir)
    qcfg = read_config(out)["quantization_config"]
    assert qcfg["quant_method"] == "quantkit" and qcfg["method"] == "rtn" and qcfg["bits"] == 4
    model = load_quantized(out)
    assert model.model.rotary_emb.inv_freq[1].item() == pytest.approx(100000.0 ** (-2 / 16), rel=1e-5)


def test_overwrite_replaces_only_when_complete(tiny_llama_dir, tmp_path, data_dir):
    out = tmp_path / "art"
    _rtn(tiny_llama_dir, out, data_dir)
    _rtn(tiny_llama_dir, out, data_dir, bits=2, overwrite=True)
    assert read_config(out)["quantization_config"]["bits"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
