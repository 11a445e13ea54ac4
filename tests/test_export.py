"""Export to the GPTQ and compressed-tensors formats: the exported tensors, decoded by compressed-tensors'
own unpacking code and by an independent GPTQ decoder written here, equal quantkit's dequantized
weights exactly; transformers loads the compressed-tensors export with the same logits as
quantkit.load; what a target cannot take is refused in one line with nothing written."""

import json

import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.export import check_whole_groups, export_artifact
from quantkit.export import compressed_tensors as ct_export
from quantkit.export import gptq as gptq_export
from quantkit.formats.uniform import UniformQuantizedTensor
from quantkit.methods.rtn import rtn_quantize

K, D = 64, 256


def _uniform(bits, group_size, sym, g_idx=False, seed=0):
    weight = torch.randn(K, D, generator=torch.Generator().manual_seed(seed))
    codes, scales, zeros, g = rtn_quantize(weight, bits, group_size, sym)
    perm = None
    if g_idx:  # act-order without static groups: columns visit the groups in a shuffled order
        perm = torch.randperm(D, generator=torch.Generator().manual_seed(seed + 1)) // g
        codes = torch.randint(0, 2**bits, (K, D), generator=torch.Generator().manual_seed(seed + 2))
    return UniformQuantizedTensor.from_codes(codes, scales, zeros, bits, g, sym, g_idx=perm)


def _settings(qt, group_size):
    return {"bits": qt.bits, "group_size": group_size, "sym": qt.sym, "act_order_g_idx": qt.g_idx is not None,
            "in_features": [D], "out_features": [K]}


GRID = [(bits, group, sym) for bits in (2, 3, 4, 8) for group in (32, 64, 128, -1) for sym in (True, False)]


@pytest.mark.parametrize("bits,group_size,sym", GRID)
def test_compressed_tensors_own_decoder_gives_quantkit_weights(bits, group_size, sym):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    qt = _uniform(bits, group_size, sym)
    config = ct_export.quantization_config(_settings(qt, group_size), None, lambda: ["lm_head"])
    scheme = QuantizationScheme(targets=["Linear"],
                                weights=QuantizationArgs(**config["config_groups"]["group_0"]["weights"]))
    decoded = PackedQuantizationCompressor.decompress(dict(ct_export.module_tensors(qt)), scheme)["weight"]
    assert ct.__version__ and decoded.dtype == torch.float16
    assert torch.equal(decoded, qt.dequantize(torch.float16))


def _bitstream_columns(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Independent GPTQ-layout decoder: packed [words, n] int32, each column an LSB-first bitstream of
    `count` values -> uint [count, n]. Value i holds stream bits [i·bits, (i+1)·bits)."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    out = np.zeros((count, packed.shape[1]), dtype=np.int64)
    for i in range(count):
        for b in range(bits):
            bit = i * bits + b
            out[i] |= ((words[bit // 32] >> (bit % 32)) & 1) << b
    return out


@pytest.mark.parametrize("bits,group_size,sym,checkpoint_format",
                         [(b, g, s, f) for b, g, s in GRID for f in ("gptq", "gptq_v2") if s or f == "gptq_v2"])
def test_gptq_layout_decodes_to_quantkit_weights(bits, group_size, sym, checkpoint_format):
    qt = _uniform(bits, group_size, sym)
    gptq_export.check(_settings(qt, group_size), checkpoint_format)
    t = {k: v.numpy() for k, v in gptq_export.module_tensors(qt, checkpoint_format).items()}
    groups = D // (D if group_size == -1 else group_size)
    assert t["qweight"].shape == (D * bits // 32, K) and t["qzeros"].shape == (groups, K * bits // 32)
    assert t["scales"].shape == (groups, K) and t["g_idx"].shape == (D,)
    q = _bitstream_columns(t["qweight"], bits, D)  # [D, K]
    z = _bitstream_columns(t["qzeros"].T, bits, K).T  # [groups, K]
    if checkpoint_format == "gptq":
        z = z + 1
    g = t["g_idx"].astype(np.int64)
    weight = (q - z[g]) * t["scales"].astype(np.float32)[g]  # [D, K]
    assert np.array_equal(weight.T.astype(np.float32), qt.dequantize(torch.float32).numpy())


def test_gptq_act_order_g_idx_is_kept():
    qt = _uniform(4, 32, sym=True, g_idx=True)
    t = gptq_export.module_tensors(qt, "gptq")
    assert torch.equal(t["g_idx"], qt.g_idx)
    assert gptq_export.quantization_config(_settings(qt, 32), "gptq")["desc_act"] is True


@pytest.mark.parametrize("to,settings,checkpoint_format,message", [
    ("gptq", {"bits": 4, "group_size": 32, "sym": False}, "gptq", "asymmetric weights: vLLM's GPTQ kernels"),
    ("gptq", {"bits": 5, "group_size": 32, "sym": True}, "gptq", "packs 2/3/4/8-bit codes, not 5-bit"),
    ("gptq", {"bits": 4, "group_size": 48, "sym": True}, "gptq", "does not divide the input width 256"),
    ("gptq", {"bits": 3, "group_size": -1, "sym": True, "in_features": [80]}, "gptq", "does not fill whole int32"),
    ("compressed-tensors", {"bits": 4, "group_size": 48, "sym": False}, None, "does not divide the input width"),
    ("compressed-tensors", {"bits": 4, "group_size": 32, "sym": True, "act_order_g_idx": True}, None,
     "act-order without static groups"),
])
def test_refusals_name_the_reason(to, settings, checkpoint_format, message):
    full = {"act_order_g_idx": False, "in_features": [D], "out_features": [K], **settings}
    with pytest.raises(QuantkitError, match=message.replace("/", ".").replace("(", ".")) as err:
        check_whole_groups(full, to)
        (gptq_export if to == "gptq" else ct_export).check(full, checkpoint_format)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def rtn_artifacts(tiny_llama_dir, tmp_path_factory):
    from quantkit.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("export-src")
    outs = {}
    for sym in (True, False):
        outs[sym] = root / ("sym" if sym else "asym")
        quantize_checkpoint(str(tiny_llama_dir), outs[sym], "rtn", {"bits": 4, "group_size": 32, "sym": sym},
                            nsamples=0, device="cpu", progress=False, checkpoint=False)
    return outs


ASYM_LOAD_BUG = pytest.mark.xfail(
    strict=False, reason="with transformers 5.24 and compressed-tensors 0.20 (not with transformers 5.17), the "
                        "modules of a compressed checkpoint are built with unpacked [out, groups] zero points while "
                        "the library's own compressor writes them packed [out*bits/32, groups]; transformers then "
                        "re-initialises them")


@pytest.mark.parametrize("sym", [True, pytest.param(False, marks=ASYM_LOAD_BUG)])
def test_transformers_loads_compressed_tensors_export_with_quantkit_logits(rtn_artifacts, tmp_path, sym):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.loader import load_quantized

    out = tmp_path / "ct"
    summary = export_artifact(rtn_artifacts[sym], out, "compressed-tensors")
    assert summary["modules_exported"] == 14
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_quantized(rtn_artifacts[sym], dtype=torch.float32)
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    # compressed-tensors dequantizes in the scales' fp16, quantkit in fp32: weights differ by at most
    # one fp16 rounding, so the logits agree to a tight bound, not bit for bit
    assert (a - b).abs().max() <= 2e-3 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_export_writes_gptq_checkpoint_and_refuses_other_methods(rtn_artifacts, tiny_llama_dir, tmp_path):
    out = tmp_path / "gptq"
    export_artifact(rtn_artifacts[True], out, "gptq")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == json.loads((out / "quantize_config.json").read_text())
    assert config["quant_method"] == "gptq" and config["bits"] == 4 and config["checkpoint_format"] == "gptq"
    assert (out / "tokenizer_config.json").is_file() and (out / "model.safetensors").is_file()
    with pytest.raises(QuantkitError, match="already exists"):
        export_artifact(rtn_artifacts[True], out, "gptq")
    export_artifact(rtn_artifacts[True], out, "gptq", overwrite=True)  # an earlier export may be replaced

    bad = tmp_path / "refused"
    with pytest.raises(QuantkitError, match="asymmetric"):
        export_artifact(rtn_artifacts[False], bad, "gptq")
    assert not bad.exists() and not list(tmp_path.glob(".refused*"))
    with pytest.raises(QuantkitError, match="not a quantkit artifact|has no config.json"):
        export_artifact(tmp_path / "nothing-here", bad, "gptq")


def test_cli_export_and_its_one_line_refusal(rtn_artifacts, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["export", str(rtn_artifacts[False]), "--to", "gptq", "--out", str(tmp_path / "g")])
    assert result.exit_code == 2 and not (tmp_path / "g").exists()
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--to compressed-tensors" in errors[0]
    result = runner.invoke(main, ["export", str(rtn_artifacts[False]), "--to", "gptq", "--checkpoint-format",
                                  "gptq_v2", "--out", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]["sym"] is False
