"""The command-line contract: results as JSON, one-line errors with a non-zero exit."""

import json

import pytest
from click.testing import CliRunner

from quantkit.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(result, fragment):
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], result.output


def test_quantize_eval_inspect_bitfamily(tiny_llama_dir, tmp_path, data_dir):
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--bits", 3, "--group-size", 32,
                 "--out", out, "--nsamples", 2, "--seqlen", 32, "--data-dir", data_dir)
    assert result.exit_code == 0, result.output
    jpath = tmp_path / "ppl.json"
    result = run("eval", "ppl", "--model", out, "--dataset", "ptb", "--seqlen", 64, "--max-windows", 2,
                 "--json", jpath, "--data-dir", data_dir)
    assert result.exit_code == 0, result.output
    payload = json.loads(jpath.read_text())
    assert payload["ppl"] > 1 and payload["protocol"] == "gptq-ptb-new" and payload["seqlen"] == 64
    result = run("inspect", out, "--json")
    assert result.exit_code == 0 and json.loads(result.output)["method"] == "rtn"
    result = run("bitfamily", out, "--json")
    report = json.loads(result.output)
    assert report["bits_per_weight"] > 3


def test_preset_supplies_defaults(tiny_llama_dir, tmp_path, data_dir):
    preset = tmp_path / "p.yaml"
    preset.write_text("method: rtn\nbits: 2\ngroup-size: 32\n")
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_llama_dir, "--preset", preset, "--bits", 3, "--out", out)
    assert result.exit_code == 0, result.output
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["bits"] == 3 and cfg["group_size"] == 32  # explicit option wins over the preset


@pytest.mark.parametrize("args,fragment", [
    (["--bits", 9], "--bits must be an integer in 2..8"),
    (["--bits", 1], "--bits must be an integer in 2..8"),
    (["--group-size", -5], "--group-size must be a positive integer"),
    (["--method", "nope"], "unknown method"),
    (["--nsamples", 1, "--seqlen", 100000], "exceeds the model's context"),
])
def test_bad_settings_fail_with_one_line(tiny_llama_dir, tmp_path, args, fragment):
    out = tmp_path / "q"
    _one_line_error(run("quantize", "--model", tiny_llama_dir, "--out", out, *args), fragment)
    assert not out.exists()


def test_missing_model(tmp_path):
    _one_line_error(run("quantize", "--model", tmp_path / "nothing.gguf", "--out", tmp_path / "q"), "GGUF file not found")
    _one_line_error(run("eval", "ppl", "--model", tmp_path), "has no config.json")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    result = run("quantize", "--model", tmp_path / "gpt2", "--out", tmp_path / "q")
    assert result.exit_code == 2
    assert "unsupported architecture 'gpt2'" in result.output and "llama" in result.output and "opt" in result.output


def test_cuda_requested_without_cuda(tiny_llama_dir, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    _one_line_error(run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "q", "--device", "cuda"),
                    "no CUDA device")


def test_preset_option_foreign_to_the_method_is_refused(tiny_llama_dir, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("method: gptq\nact-order: true\n")
    result = run("quantize", "--model", tiny_llama_dir, "--preset", preset, "--method", "rtn", "--out", tmp_path / "q")
    _one_line_error(result, "--act-order does not apply to --method rtn")
