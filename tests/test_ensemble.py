"""The two-flow OOC ensemble: each flow equals a standalone run, the lower validation loss wins,
the artifact says which flow it holds; validation windows never overlap calibration text."""

import json

import pytest
import torch
from click.testing import CliRunner

from factories import tiny_causal_lm
from quantkit.artifact import read_config, read_log
from quantkit.cli import main
from quantkit.engine import quantize_model
from quantkit.ensemble import ooc_flows, run_flows, validation_nll
from quantkit.methods import make_method
from quantkit.models import adapter_for


def _calib(seed, n=4, t=32):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def test_flows_are_gptq_low_with_the_inner_settings_and_the_ooc_method():
    ooc = make_method("ooc", low_bits=2, high_bits=3, clear_fraction=0.2, scan=0.5, group_size=32, per_row=True)
    (low_label, low), (ooc_label, same) = ooc_flows(ooc)
    assert same is ooc and low_label == "GPTQ(2)" and ooc_label == "GPTQ(3,2,0.2,0.5) per-row"
    cfg = low.config()
    assert (cfg["bits"], cfg["group_size"], cfg["act_order"], cfg["static_groups"], cfg["clip_search"]) == (
        2, 32, True, True, True)  # the default GPTQ, as the OOC method's inner GPTQ
    textbook = make_method("ooc", low_bits=2, act_order=False, static_groups=False, clip_search=False)
    cfg = ooc_flows(textbook)[0][1].config()
    assert (cfg["act_order"], cfg["static_groups"], cfg["clip_search"]) == (False, False, False)


def test_run_flows_keeps_the_lower_validation_loss_and_matches_standalone_runs():
    model = tiny_causal_lm(intermediate=128, seed=0)
    adapter = adapter_for(model)
    ooc = make_method("ooc", low_bits=2, high_bits=4, clear_fraction=0.25, scan=1.0, group_size=32)
    flows = ooc_flows(ooc)
    calib, val = _calib(1), _calib(2, n=2)
    best, reports, qtensors, _ = run_flows(model, adapter, flows, calib, val, progress=False)
    assert [r["chosen"] for r in reports].count(True) == 1 and reports[best]["chosen"]
    assert reports[best]["validation_nll"] == min(r["validation_nll"] for r in reports)
    for k, (_, method) in enumerate(flows):  # every flow's validation loss is that of a standalone run
        alone = tiny_causal_lm(intermediate=128, seed=0)
        q_alone, _ = quantize_model(alone, adapter, method, calib, progress=False)
        assert validation_nll(alone, val, "cpu") == pytest.approx(reports[k]["validation_nll"], rel=1e-6)
        if k == best:
            for name, qt in qtensors.items():
                assert torch.equal(qt.dequantize(), q_alone[name].dequantize()), name


def test_validation_windows_avoid_calibration_documents(tiny_tokenizer, data_dir):
    from quantkit.data import calibration_windows, validation_windows

    seqlen = 64
    val, protocol = validation_windows("c4", tiny_tokenizer, 4, seqlen, data_dir)
    calib, _ = calibration_windows("c4", tiny_tokenizer, 8, seqlen, 0, data_dir)
    assert val.shape == (4, seqlen) and protocol["windows"] == 4
    calib_rows = {tuple(r.tolist()) for r in calib}
    assert not any(tuple(r.tolist()) in calib_rows for r in val)
    with pytest.raises(Exception, match="validation data too short"):
        validation_windows("ptb", tiny_tokenizer, 10**6, seqlen, data_dir)


def test_cli_ensemble_writes_the_chosen_flow(tmp_path, tiny_llama_dir, data_dir):
    out = tmp_path / "ens"
    args = ["quantize", "--model", tiny_llama_dir, "--method", "ooc", "--high-bits", 3, "--scan", 1.0, "--ensemble",
            "--val-windows", 2, "--out", out, "--nsamples", 2, "--seqlen", 128, "--data-dir", data_dir,
            "--group-size", 32]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    assert "<- kept" in result.output and "flow GPTQ(2)" in result.output
    qcfg = read_config(out)["quantization_config"]
    flows = read_log(out)["ensemble"]["flows"]
    chosen = min(flows, key=lambda f: f["validation_nll"])
    assert qcfg["ensemble"]["chosen"] == chosen["flow"] and chosen["chosen"]
    formats = {m["format"] for m in qcfg["modules"].values()}
    assert formats == {"uniform"} if chosen["flow"] == "GPTQ(2)" else "ooc" in formats
    json.dumps(flows)


@pytest.mark.parametrize("args, fragment", [
    (["--method", "gptq", "--ensemble"], "--ensemble is the two-flow OOC scheme"),
    (["--method", "ooc", "--val-windows", "4"], "--val-windows applies only with --ensemble"),
    (["--method", "ooc", "--ensemble", "--val-windows", "0"], "--val-windows must be a positive integer"),
])
def test_cli_ensemble_bad_options(tmp_path, tiny_llama_dir, data_dir, args, fragment):
    out = tmp_path / "bad"
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--out", str(out), "--nsamples", "2",
                                       "--seqlen", "32", "--data-dir", str(data_dir)] + args)
    assert result.exit_code == 2 and fragment in result.output and not out.exists()
