"""The command-line contract: results as JSON, one-line errors with a non-zero exit."""

import json

import pytest
from click.testing import CliRunner

from factories import save_tiny, tiny_causal_lm
from quantkit.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(result, fragment):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
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
    (payload,) = json.loads(jpath.read_text())["results"]
    assert payload["ppl"] > 1 and payload["protocol"] == "gptq-ptb-new" and payload["seqlen"] == 64
    made = payload["quantized_with"]  # the artifact's calibration travels with its perplexity
    assert made["method"] == "rtn" and made["settings"]["bits"] == 3 and made["calibration"]["nsamples"] == 2
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
    _one_line_error(run("quantize", "--model", tmp_path / "nothing.gguf", "--out", tmp_path / "q"),
                    "GGUF file not found")
    _one_line_error(run("eval", "ppl", "--model", tmp_path), "has no config.json")


def test_unsupported_architecture_names_what_was_expected(tmp_path):
    save_tiny(tiny_causal_lm("bert", layers=1, hidden=32, heads=2, vocab=64), None, tmp_path / "bert")
    result = run("quantize", "--model", tmp_path / "bert", "--out", tmp_path / "q")
    assert result.exit_code == 2
    assert "unsupported architecture 'bert'" in result.output and "LlamaForCausalLM" in result.output


@pytest.mark.requires("no_cuda")
def test_cuda_requested_without_cuda(tiny_llama_dir, tmp_path):
    _one_line_error(run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "q", "--device", "cuda"),
                    "no CUDA device")


def test_preset_option_foreign_to_the_method_is_refused(tiny_llama_dir, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("method: gptq\nact-order: true\n")
    result = run("quantize", "--model", tiny_llama_dir, "--preset", preset, "--method", "rtn", "--out", tmp_path / "q")
    _one_line_error(result, "--act-order does not apply to --method rtn")


@pytest.mark.parametrize("text,fragment", [
    ("- method\n", "a preset is a mapping"),
    ("method: [1\n", "not valid YAML"),
    ("seqlen: abc\n", "seqlen: 'abc' is not a valid integer"),
    ("sizes: 3\n", "unknown option 'sizes'"),
])
def test_bad_preset_fails_with_one_line(tiny_llama_dir, tmp_path, text, fragment):
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    _one_line_error(run("quantize", "--model", tiny_llama_dir, "--preset", preset, "--out", tmp_path / "q"), fragment)
    assert not (tmp_path / "q").exists()


def test_preset_keys_are_option_names(tiny_llama_dir, tmp_path):
    # `model` is --model (parameter src); values are converted as the option converts them
    preset = tmp_path / "p.yaml"
    preset.write_text(f"model: {tiny_llama_dir}\nmethod: rtn\nbits: '3'\ngroup-size: 32\nsym: true\n")
    out = tmp_path / "q"
    result = run("quantize", "--preset", preset, "--out", out)
    assert result.exit_code == 0, result.output
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (cfg["bits"], cfg["group_size"], cfg["sym"]) == (3, 32, True)


def test_overwrite_replaces_only_an_artifact(tiny_llama_dir, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    _one_line_error(run("quantize", "--model", tiny_llama_dir, "--out", precious, "--overwrite"),
                    "not a quantkit artifact")
    assert (precious / "thesis.txt").read_text() == "years of work"
    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_llama_dir, "--bits", 3, "--out", out).exit_code == 0
    result = run("quantize", "--model", tiny_llama_dir, "--bits", 4, "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable by others as the umask allows
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("convert", out, "--to", "bcq", "--out", empty, "--overwrite").exit_code == 0
    _one_line_error(run("convert", out, "--to", "bcq", "--out", precious, "--overwrite"), "not a quantkit artifact")


def test_damaged_artifact_files_fail_with_one_line(tiny_llama_dir, tmp_path):
    import shutil

    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_llama_dir, "--bits", 3, "--out", out).exit_code == 0
    truncated = tmp_path / "truncated"
    shutil.copytree(out, truncated)
    with open(truncated / "model.safetensors", "r+b") as fh:
        fh.truncate(fh.seek(0, 2) // 2)
    for command in (["inspect", truncated], ["bitfamily", truncated]):
        _one_line_error(run(*command), "model.safetensors")
    bad_log = tmp_path / "bad_log"
    shutil.copytree(out, bad_log)
    (bad_log / "quant_log.json").write_text('{"modules": [')
    _one_line_error(run("inspect", bad_log), "quant_log.json")
    _one_line_error(run("convert", bad_log, "--to", "bcq", "--out", tmp_path / "c"), "quant_log.json")
    assert not (tmp_path / "c").exists()
    not_an_object = tmp_path / "list_config"
    not_an_object.mkdir()
    (not_an_object / "config.json").write_text("[1, 2]")
    _one_line_error(run("eval", "ppl", "--model", not_an_object), "not a Hugging Face model config")


@pytest.mark.parametrize("args,fragment", [
    (["eval", "ppl", "--batch-size", 0], "--batch-size"),
    (["eval", "ppl", "--batch-size", -1], "--batch-size"),
    (["eval", "ppl", "--dataset", "foo"], "--dataset"),
    (["bitfamily", "--group-size", 0], "--group-size"),
    (["bitfamily", "--d-min", -3], "--d-min"),
    (["bitfamily", "--per-module"], "--per-module applies only with ARTIFACT"),
])
def test_bad_option_values_fail_with_one_line(args, fragment):
    _one_line_error(run(*args), fragment)


def test_every_model_is_found_before_any_is_evaluated(tiny_llama_dir, tmp_path, monkeypatch):
    from quantkit import pipeline

    def evaluate_ppl(*args, **kwargs):
        raise AssertionError("a model was evaluated although a later --model does not exist")

    monkeypatch.setattr(pipeline, "evaluate_ppl", evaluate_ppl)
    _one_line_error(run("eval", "ppl", "--model", tiny_llama_dir, "--model", tmp_path / "nope"), "model not found")


def test_resume_needs_the_checkpoint(tiny_llama_dir, tmp_path):
    _one_line_error(run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "q", "--resume", "--no-checkpoint"),
                    "--no-checkpoint")


def test_load_accepts_dtype_names(tiny_llama_dir, tmp_path):
    import torch

    import quantkit

    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_llama_dir, "--bits", 3, "--out", out).exit_code == 0
    assert next(quantkit.load(out, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(quantkit.load(out, dtype=torch.float32).parameters()).dtype == torch.float32
    with pytest.raises(quantkit.errors.QuantkitError, match="unknown dtype"):
        quantkit.load(out, dtype="float8")
