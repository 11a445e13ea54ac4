"""Finished layers' packed tensors wait on disk, not in memory (quantkit/engine/spill.py), and the artifact is
written from there one tensor at a time (quantkit/tensorfile.py): the same bytes as the in-memory path and
as safetensors' own save_file, no packed tensor of a finished layer alive, nothing left behind."""

import gc
import hashlib
import json
import struct
import threading
import types
import weakref

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from factories import save_tiny, tiny_causal_lm
from quant_logs import strip_volatile
from quantkit import tensorfile
from quantkit.artifact import float_tensors, read_header, write_artifact
from quantkit.cli import main
from quantkit.engine import driver, spill
from quantkit.engine.checkpoint import checkpoint_dir
from quantkit.methods import make_method
from quantkit.models import adapter_for
from quantkit.pipeline import quantize_checkpoint

LAYERS = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one thread


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tiny_tokenizer):
    model = tiny_causal_lm("llama", vocab=len(tiny_tokenizer), layers=LAYERS, max_positions=256, seed=7)
    return save_tiny(model, tiny_tokenizer, tmp_path_factory.mktemp("llama4"))


def _mixed_tensors():
    """Every dtype an artifact can hold, an empty tensor and a scalar, names out of order."""
    g = torch.Generator().manual_seed(0)
    tensors = {"z.int32": torch.randint(-2**31, 2**31 - 1, (7, 3), generator=g, dtype=torch.int32),
               "a.fp16": torch.randn(5, 4, generator=g).half(), "m.bf16": torch.randn(9, generator=g).bfloat16(),
               "b.fp32": torch.randn(2, 2, 2, generator=g), "c.u8": torch.randint(0, 255, (11,), generator=g,
                                                                                   dtype=torch.uint8),
               "d.i64": torch.arange(3), "e.i16": torch.arange(5, dtype=torch.int16), "f.bool": torch.arange(6) > 2,
               "g.i8": torch.arange(-3, 3, dtype=torch.int8),
               "h.fp64": torch.randn(3, generator=g, dtype=torch.float64),
               "empty": torch.zeros(0, 4, dtype=torch.float16), "scalar": torch.tensor(2.5)}
    return tensors


def _library_bytes(tensors, metadata, path):
    """save_file's file with the metadata keys sorted: the frozen reference of the files written before
    tensorfile existed (the library wrote them, and the header was rewritten with sorted keys, same length)."""
    save_file(tensors, str(path), metadata=metadata)
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(text) <= size
    return data[:8] + text + b" " * (size - len(text)) + data[8 + size :]


def test_tensor_files_are_the_bytes_save_file_writes(tmp_path):
    tensors = _mixed_tensors()
    metadata = {"zeta": "1", "format": "pt", "alpha": "é"}
    want = _library_bytes(tensors, metadata, tmp_path / "library.safetensors")

    in_memory = {name: tensorfile.TensorBytes.of(t) for name, t in tensors.items()}
    digest = tensorfile.write_tensor_file(tmp_path / "memory.safetensors", in_memory, metadata)
    got = (tmp_path / "memory.safetensors").read_bytes()
    assert got == want
    assert digest == hashlib.sha256(got).hexdigest()

    # the same tensors as byte ranges of a file already written, read in chunks smaller than a tensor
    path = tmp_path / "memory.safetensors"
    ranges = tensorfile.file_entries(path, read_header(path))
    assert not any(e.tensor is not None for e in ranges.values())
    saved = tensorfile.CHUNK_BYTES
    tensorfile.CHUNK_BYTES = 5
    try:
        tensorfile.write_tensor_file(tmp_path / "ranges.safetensors", ranges, metadata)
        assert tensorfile.contents_digest(ranges) == tensorfile.contents_digest(in_memory)
    finally:
        tensorfile.CHUNK_BYTES = saved
    assert (tmp_path / "ranges.safetensors").read_bytes() == want
    for name, tensor in tensors.items():
        loaded = ranges[name].load()
        assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape and torch.equal(loaded, tensor)

    # a tensor that reaches the host one row at a time (checkpointed activations) gives the same file
    by_rows = {name: tensorfile.TensorBytes.by_rows(t) if t.dim() else tensorfile.TensorBytes.of(t)
               for name, t in tensors.items()}
    tensorfile.write_tensor_file(tmp_path / "rows.safetensors", by_rows, metadata)
    assert (tmp_path / "rows.safetensors").read_bytes() == want


def _rtn_model_and_store(tmp_path, layers=3):
    model = tiny_causal_lm("llama", layers=layers, seed=2)
    method = make_method("rtn", bits=3, group_size=32)
    memory, _ = driver.quantize_model(tiny_causal_lm("llama", layers=layers, seed=2), adapter_for(model), method,
                                      progress=False)
    store = spill.QuantizedStore(tmp_path / "spill")
    stored, _ = driver.quantize_model(model, adapter_for(model), method, progress=False, store=store)
    assert stored is store
    return model, memory, store


def test_a_store_writes_the_in_memory_artifact_across_shards(tmp_path):
    model, memory, store = _rtn_model_and_store(tmp_path)
    assert list(store) == list(memory)
    for name, qt in memory.items():
        back = store[name]
        assert back.meta() == qt.meta()
        assert all(torch.equal(back.state_dict()[k], v) for k, v in qt.state_dict().items())
    outs = {}
    for kind, qtensors in (("memory", memory), ("store", store)):
        outs[kind] = write_artifact(tmp_path / kind, model_config=model.config.to_dict(), tokenizer=None,
                                    qtensors=qtensors, float_tensors=float_tensors(model, qtensors),
                                    quantization_config={"method": "rtn"}, quant_log={}, max_shard_bytes=20_000)
    files = sorted(p.name for p in outs["memory"].iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) >= 3
    assert files == sorted(p.name for p in outs["store"].iterdir())
    for name in files:
        assert (outs["memory"] / name).read_bytes() == (outs["store"] / name).read_bytes(), name
    store.remove()
    assert not (tmp_path / "spill").exists()


def _tensor_bytes_reachable(root) -> int:
    """Bytes of the torch tensors reachable from `root` through Python references."""
    seen, todo, total = set(), [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
            continue
        todo.extend(gc.get_referents(obj))
    return total


@pytest.mark.parametrize("method,nsamples", [("rtn", 0), ("gptq", 2)])
def test_no_packed_tensor_of_a_finished_layer_stays_alive(method, nsamples, tmp_path, monkeypatch, tiny_tokenizer):
    """Every packed tensor the engine makes is watched (weakref): when layer i is handed to the store, none
    of layers < i − WRITES_IN_FLIGHT is alive any more (the layers before it may wait for the writer
    thread), and once the store has settled none is; the in-memory path, the control, keeps them all (so
    the watch does see tensors that stay). The spill files are written off the engine's thread."""
    model = tiny_causal_lm("llama", layers=LAYERS, vocab=len(tiny_tokenizer), seed=4)
    quantizer = make_method(method, bits=4, group_size=32)
    calib = torch.randint(0, len(tiny_tokenizer), (nsamples, 16), generator=torch.Generator().manual_seed(0)) \
        if nsamples else None
    watched = {}  # layer index -> [weakref of a packed tensor]
    original = driver._quantize_linear

    def watching(method_, name, linear, stats, device):
        qtensor, entry = original(method_, name, linear, stats, device)
        index = int(name.split(".")[2])
        watched.setdefault(index, []).extend(weakref.ref(t) for t in qtensor.state_dict().values())
        return qtensor, entry

    def alive(indices):
        gc.collect()
        return sum(ref() is not None for i in indices for ref in watched.get(i, []))

    monkeypatch.setattr(driver, "_quantize_linear", watching)
    store = spill.QuantizedStore(tmp_path / "spill")
    add_layer = store.add_layer
    still_alive = []

    def checked_add_layer(index, layer_q, path=None):
        still_alive.append(alive(range(index - spill.WRITES_IN_FLIGHT)))
        add_layer(index, layer_q, path)

    writers = []
    write = store._write
    store._write = lambda *args: writers.append(threading.current_thread()) or write(*args)

    store.add_layer = checked_add_layer
    result, _ = driver.quantize_model(model, adapter_for(model), quantizer, calib, progress=False, store=store)
    del store.add_layer
    # the stored files hold the packed bytes instead: as many as the in-memory path keeps alive
    stored = sum(e.nbytes for e in store.stored_tensors().values())
    assert len(watched) == LAYERS and all(len(refs) >= 7 * 2 for refs in watched.values())
    assert still_alive == [0] * LAYERS
    assert alive(range(LAYERS)) == 0
    assert len(result) == 7 * LAYERS and _tensor_bytes_reachable(result) == 0
    assert len(writers) == LAYERS and threading.current_thread() not in writers

    watched.clear()
    model = tiny_causal_lm("llama", layers=LAYERS, vocab=len(tiny_tokenizer), seed=4)
    in_memory, _ = driver.quantize_model(model, adapter_for(model), quantizer, calib, progress=False)
    assert alive(range(LAYERS)) == sum(len(refs) for refs in watched.values())
    assert _tensor_bytes_reachable(in_memory) == stored > 0


def _comparable(artifact):
    files = {}
    for path in sorted(artifact.iterdir()):
        files[path.name] = strip_volatile(json.loads(path.read_text())) if path.name == "quant_log.json" \
            else path.read_bytes()
    return files


def _siblings(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith((out.name, f".{out.name}")))


@pytest.mark.parametrize("method,params,nsamples,fmt,checkpoint", [
    ("gptq", {"bits": 3, "group_size": 32, "clip_search": False}, 2, None, False),
    ("gptq", {"bits": 3, "group_size": 32, "clip_search": False}, 2, None, True),  # the checkpoint's files reused
    ("rtn", {"bits": 3, "group_size": 32}, 0, "bcq", False),  # converted layer by layer into another store
])
def test_spilled_and_in_memory_runs_write_the_same_artifact(method, params, nsamples, fmt, checkpoint, llama4_dir,
                                                            small_data, tmp_path, monkeypatch):
    created = []
    original = spill.QuantizedStore._write

    def recording(self, index, tensors, modules):
        created.append(self.directory.name)
        return original(self, index, tensors, modules)

    monkeypatch.setattr(spill.QuantizedStore, "_write", recording)
    outs = {}
    for spilled in (True, False):
        outs[spilled] = tmp_path / f"spill-{spilled}"
        quantize_checkpoint(str(llama4_dir), outs[spilled], method, params, nsamples=nsamples, seqlen=32,
                            calib="ptb", device="cpu", data_dir=small_data, progress=False, fmt=fmt,
                            checkpoint=checkpoint, spill=spilled)
        assert _siblings(outs[spilled]) == [outs[spilled].name]  # no spill or checkpoint directory left
    assert _comparable(outs[True]) == _comparable(outs[False])
    if checkpoint:
        assert created == []  # the layers were read from the checkpoint's files, not written again
    else:
        assert len(created) == LAYERS * (2 if fmt else 1)


def test_a_failed_spilled_run_leaves_nothing(llama4_dir, tmp_path, monkeypatch):
    """A layer that fails after others were spilled, and a spill write that fails: one error line, no
    spill directory, no output."""
    out = tmp_path / "q"
    rtn = type(make_method("rtn", bits=3, group_size=32))
    original, calls, written = rtn.quantize, [], []
    original_write = spill.QuantizedStore._write

    def fails_in_layer_2(self, weight, stats):
        calls.append(1)
        if len(calls) > 2 * 7:  # a Llama block has 7 linears
            raise torch.OutOfMemoryError("deliberate")
        return original(self, weight, stats)

    def recording(self, index, tensors, modules):
        path = original_write(self, index, tensors, modules)
        written.append(path)
        return path

    args = ["quantize", "--model", str(llama4_dir), "--out", str(out), "--method", "rtn", "--device", "cpu",
            "--no-checkpoint"]
    with monkeypatch.context() as m:
        m.setattr(rtn, "quantize", fails_in_layer_2)
        m.setattr(spill.QuantizedStore, "_write", recording)
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "out of memory" in result.output, result.output
    assert len(written) == 2 and written[0].parent.name.startswith(f".{out.name}.spill-")
    assert _siblings(out) == []

    def enospc(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(spill, "write_tensor_file", enospc)
        result = CliRunner().invoke(main, args)
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "could not write the quantized tensors of layer 0" in lines[0] and "No space left" in lines[0]
    assert _siblings(out) == [] and not checkpoint_dir(out).exists()


def test_a_killed_runs_spill_directory_goes_with_the_next_run(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "q"
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead = tmp_path / f".q.spill-{int(finished.stdout)}"
    alive = tmp_path / f".q.spill-{os.getppid()}"
    other = tmp_path / f".qq.spill-{int(finished.stdout)}"
    for path in (dead, alive, other):
        path.mkdir()
        (path / "layer-00000.safetensors").write_bytes(b"x")
    spill.remove_stale_spills(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])
