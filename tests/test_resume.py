"""Kill-and-resume: a quantize run killed after layer k and continued with --resume writes the same
artifact, byte for byte, as a run that was never interrupted."""

import json
import os
import subprocess

import pytest

import kill_after_layer
from factories import save_tiny, tiny_causal_lm
from quant_logs import strip_volatile
from quantkit.engine import checkpoint as ckpt
from quantkit.errors import QuantkitError
from quantkit.pipeline import quantize_checkpoint

LAYERS = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one thread


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tiny_tokenizer):
    """A 4-layer tiny llama, so that kills can land before, between and after layers."""
    model = tiny_causal_lm("llama", vocab=len(tiny_tokenizer), layers=LAYERS, max_positions=256,
                           tie_word_embeddings=True, seed=3)
    return save_tiny(model, tiny_tokenizer, tmp_path_factory.mktemp("llama4"))


SETTINGS = {
    "gptq": ("gptq", {"bits": 3, "group_size": 32, "clip_search": False}, 4),
    "rtn": ("rtn", {"bits": 4, "group_size": 32}, 0),  # no calibration: nothing but tensors to restore
    "rtn-calib": ("rtn", {"bits": 4, "group_size": 32}, 4),  # calibration only for the log's output errors
}


def _cli_args(model_dir, out, key, small_data):
    method, params, nsamples = SETTINGS[key]
    args = ["quantize", "--model", str(model_dir), "--method", method, "--out", str(out), "--nsamples", str(nsamples),
            "--seqlen", "32", "--calib", "ptb", "--device", "cpu", "--data-dir", str(small_data)]
    for name, value in params.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            args += [f"--{flag}" if value else f"--no-{flag}"]
        else:
            args += [f"--{flag}", str(value)]
    return args


def _quantize(model_dir, out, key, small_data, **kwargs):
    method, params, nsamples = SETTINGS[key]
    return quantize_checkpoint(str(model_dir), out, method, params, nsamples=nsamples, seqlen=32, calib="ptb",
                               device="cpu", data_dir=small_data, progress=False, **kwargs)


def _killed_run(model_dir, out, key, small_data, layer, phase="committed", resume=False):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [*kill_after_layer.command(layer, phase), *_cli_args(model_dir, out, key, small_data)]
    args += ["--resume"] if resume else []
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == kill_after_layer.KILLED_EXIT, result.stderr[-2000:]
    assert not out.exists()
    return json.loads((ckpt.checkpoint_dir(out) / ckpt.STATE).read_text())


def comparable(artifact):
    """{file: bytes} of every file, quant_log.json compared without its volatile keys."""
    files = {}
    for path in sorted(artifact.rglob("*")):
        if path.is_file():
            rel = str(path.relative_to(artifact))
            files[rel] = strip_volatile(json.loads(path.read_text())) if rel == "quant_log.json" else path.read_bytes()
    return files


@pytest.fixture(scope="module")
def clean_runs(llama4_dir, small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    outs = {}
    for key in SETTINGS:
        outs[key] = root / key
        _quantize(llama4_dir, outs[key], key, small_data, checkpoint=False)
    return outs


def _assert_identical(resumed, clean):
    got, want = comparable(resumed), comparable(clean)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from the uninterrupted run"
    assert not ckpt.checkpoint_dir(resumed).exists()  # removed once the artifact is in place


def test_gptq_killed_twice_resumes_identically(llama4_dir, small_data, tmp_path, clean_runs):
    out = tmp_path / "q"
    state = _killed_run(llama4_dir, out, "gptq", small_data, layer=0)
    assert state["layers_done"] == 1 and len(state["inputs"]) == 1
    # second run: resumes at layer 1, then dies after writing layer 2's files but before committing them
    state = _killed_run(llama4_dir, out, "gptq", small_data, layer=2, phase="uncommitted", resume=True)
    assert state["layers_done"] == 2
    assert (ckpt.checkpoint_dir(out) / "layer-00002.safetensors").is_file()  # written, never committed
    summary = _quantize(llama4_dir, out, "gptq", small_data, resume=True)
    assert summary["resumed_at_layer"] == 2
    _assert_identical(out, clean_runs["gptq"])


@pytest.mark.parametrize("key,layer", [("gptq", LAYERS - 1), ("rtn", 1), ("rtn-calib", 2)])
def test_killed_after_layer_resumes_identically(llama4_dir, small_data, tmp_path, clean_runs, key, layer):
    out = tmp_path / "q"
    state = _killed_run(llama4_dir, out, key, small_data, layer=layer)
    assert state["layers_done"] == layer + 1
    has_inputs = SETTINGS[key][2] > 0 and layer < LAYERS - 1
    assert len(state["inputs"]) == (1 if has_inputs else 0)
    summary = _quantize(llama4_dir, out, key, small_data, resume=True)
    assert summary["resumed_at_layer"] == layer + 1
    _assert_identical(out, clean_runs[key])


def _interrupt_after(monkeypatch, layer):
    """Ctrl-C right after `layer` is committed (in-process: KeyboardInterrupt, not a kill)."""
    original = ckpt.LayerCheckpoint.commit

    def commit(self, index, *args, **kwargs):
        original(self, index, *args, **kwargs)
        if index == layer:
            raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.LayerCheckpoint, "commit", commit)


def test_interrupt_keeps_layers_and_resume_checks_settings(llama4_dir, small_data, tmp_path, clean_runs, monkeypatch):
    out = tmp_path / "q"
    with monkeypatch.context() as m:
        _interrupt_after(m, 1)
        with pytest.raises(KeyboardInterrupt):
            _quantize(llama4_dir, out, "gptq", small_data)
    partial = ckpt.checkpoint_dir(out)
    assert json.loads((partial / ckpt.STATE).read_text())["layers_done"] == 2 and not out.exists()

    with pytest.raises(QuantkitError, match="holds an interrupted run .2 layers done.; pass --resume"):
        _quantize(llama4_dir, out, "gptq", small_data)
    method, params, nsamples = SETTINGS["gptq"]
    with pytest.raises(QuantkitError, match="made with other settings .settings: "):
        quantize_checkpoint(str(llama4_dir), out, method, {**params, "bits": 4}, nsamples=nsamples, seqlen=32,
                            calib="ptb", device="cpu", data_dir=small_data, progress=False, resume=True)
    with pytest.raises(QuantkitError, match="calibration_windows"):  # other windows: another seed
        quantize_checkpoint(str(llama4_dir), out, method, params, nsamples=nsamples, seqlen=32, calib="ptb", seed=1,
                            device="cpu", data_dir=small_data, progress=False, resume=True)
    assert partial.is_dir()  # a refused resume leaves the checkpoint alone

    layer_file = partial / "layer-00001.safetensors"
    data = bytearray(layer_file.read_bytes())
    data[-1] ^= 0x01
    layer_file.write_bytes(bytes(data))
    with pytest.raises(QuantkitError, match="layer-00001.safetensors: checkpoint file missing or altered"):
        _quantize(llama4_dir, out, "gptq", small_data, resume=True)
    data[-1] ^= 0x01
    layer_file.write_bytes(bytes(data))

    _quantize(llama4_dir, out, "gptq", small_data, resume=True)
    _assert_identical(out, clean_runs["gptq"])


def test_overwrite_starts_over_and_resume_without_checkpoint_starts_afresh(llama4_dir, small_data, tmp_path, clean_runs,
                                                                        monkeypatch):
    out = tmp_path / "q"
    with monkeypatch.context() as m:
        _interrupt_after(m, 0)
        with pytest.raises(KeyboardInterrupt):
            _quantize(llama4_dir, out, "rtn", small_data)
    summary = _quantize(llama4_dir, out, "rtn", small_data, overwrite=True)
    assert "resumed_at_layer" not in summary
    _assert_identical(out, clean_runs["rtn"])
    other = tmp_path / "fresh"
    summary = _quantize(llama4_dir, other, "rtn", small_data, resume=True)
    assert "resumed_at_layer" not in summary
    _assert_identical(other, clean_runs["rtn"])


def test_cli_interrupt_says_what_was_kept(llama4_dir, small_data, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from quantkit.cli import main

    out = tmp_path / "q"
    _interrupt_after(monkeypatch, 0)
    result = CliRunner().invoke(main, _cli_args(llama4_dir, out, "gptq", small_data))
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "interrupted; the finished layers are kept in" in lines[0] and "--resume" in lines[0]
    monkeypatch.undo()
    result = CliRunner().invoke(main, _cli_args(llama4_dir, out, "gptq", small_data) + ["--resume"])
    assert result.exit_code == 0, result.output
