"""A checkpoint read one decoder block at a time (quantkit/models/lazy.py): never two blocks' weights in
memory at once, the same artifact bytes as loading the model whole, and one-line refusals of missing or
truncated shards before anything is written."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

from factories import tiny_causal_lm
from quant_logs import strip_volatile
from quantkit.cli import main
from quantkit.models import lazy
from quantkit.pipeline import quantize_checkpoint

LAYERS = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one thread


def _sharded(arch, tokenizer, path):
    """A checkpoint of LAYERS blocks in several safetensors shards (with the index that names them)."""
    model = tiny_causal_lm(arch, layers=LAYERS, vocab=len(tokenizer), max_positions=256, seed=5)
    model.save_pretrained(path, max_shard_size="100KB")
    tokenizer.save_pretrained(path)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 3 and (path / lazy.INDEX).is_file()
    return path


def _quantize(src, out, small_data, method="gptq", **kwargs):
    nsamples = 2 if method == "gptq" else 0
    return quantize_checkpoint(str(src), out, method, {"bits": 4, "group_size": 32}, nsamples=nsamples, seqlen=32,
                               calib="ptb", device="cpu", data_dir=small_data, progress=False, checkpoint=False,
                               **kwargs)


@pytest.mark.parametrize("method", ["gptq", "rtn"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_one_block_at_a_time_and_the_same_bytes_as_a_whole_load(arch, method, tiny_tokenizer, small_data, tmp_path,
                                                                 monkeypatch):
    src = _sharded(arch, tiny_tokenizer, tmp_path / "model")
    events = []
    original_load, original_release = lazy.LazyBlocks.load, lazy.LazyBlocks.release

    def materialised(blocks):
        """Indices of the blocks with any weight of a linear in memory (not on the meta device)."""
        layers = blocks.model.get_submodule(blocks.layers_path)
        return {i for i, layer in enumerate(layers)
                if any(m.weight.device.type != "meta" for m in layer.modules() if isinstance(m, torch.nn.Linear))}

    def load(self, index, device=None):
        assert materialised(self) == set(), f"block {index} read while {materialised(self)} are in memory"
        original_load(self, index, device)
        events.append(("load", index, materialised(self)))

    def release(self, index, quantized=()):
        original_release(self, index, quantized)
        events.append(("release", index, materialised(self)))

    monkeypatch.setattr(lazy.LazyBlocks, "load", load)
    monkeypatch.setattr(lazy.LazyBlocks, "release", release)
    lazy_out, whole_out = tmp_path / "lazy", tmp_path / "whole"
    _quantize(src, lazy_out, small_data, method)
    assert events == [e for i in range(LAYERS) for e in (("load", i, {i}), ("release", i, set()))]
    events.clear()
    _quantize(src, whole_out, small_data, method, lazy=False)
    assert events == []

    files = sorted(p.name for p in lazy_out.iterdir())
    assert files == sorted(p.name for p in whole_out.iterdir())
    for name in files:
        if name == "quant_log.json":
            logs = [strip_volatile(json.loads((d / name).read_text())) for d in (lazy_out, whole_out)]
            assert logs[0] == logs[1]
        else:
            assert (lazy_out / name).read_bytes() == (whole_out / name).read_bytes(), name


def _one_line(result):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_missing_or_truncated_shards_are_refused_before_anything_is_written(tiny_tokenizer, tmp_path, monkeypatch):
    import quantkit.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer read before the refusal"))
    src = _sharded("llama", tiny_tokenizer, tmp_path / "model")
    shards = sorted(src.glob("*.safetensors"))
    out = tmp_path / "q"

    def quantize():
        return CliRunner().invoke(main, ["quantize", "--model", str(src), "--out", str(out), "--method", "rtn",
                                         "--device", "cpu"])

    data = shards[1].read_bytes()
    shards[1].write_bytes(data[:-100])
    line = _one_line(quantize())
    assert f"shard {shards[1].name} is truncated" in line and f"its header needs {len(data)}" in line
    shards[1].unlink()
    assert f"shard {shards[1].name} is missing" in _one_line(quantize())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _opened(src):
    from quantkit.models.loading import resolve_source

    model, blocks, _ = lazy.open_lazy(resolve_source(str(src)), torch.float32)
    return model, blocks


def _block_weights(model, index):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(f"model.layers.{index}.")}


def _record_readers(monkeypatch) -> list:
    """The names of the threads that run LazyBlocks._read, in call order."""
    import threading

    readers = []
    original = lazy.LazyBlocks._read

    def read(self, names, device=None):
        readers.append(threading.current_thread().name)
        return original(self, names, device)

    monkeypatch.setattr(lazy.LazyBlocks, "_read", read)
    return readers


def test_a_block_read_ahead_is_read_in_the_background_and_taken_by_its_load(tiny_tokenizer, tmp_path, monkeypatch):
    src = _sharded("llama", tiny_tokenizer, tmp_path / "model")
    model, blocks = _opened(src)
    blocks.load(1)
    expected = _block_weights(model, 1)
    blocks.release(1, [n.rpartition(".")[0] for n in expected if n.endswith("proj.weight")])
    readers = _record_readers(monkeypatch)
    blocks.prefetch(1, "cpu")
    blocks.load(1, "cpu")
    assert readers == ["quantkit-block-reader_0"] and blocks.ahead_seconds > 0
    got = _block_weights(model, 1)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in expected)

    readers.clear()  # a read ahead of another block is dropped and the block asked for is read now
    blocks.prefetch(2, "cpu")
    blocks.load(3, "cpu")
    assert readers == ["quantkit-block-reader_0", "MainThread"]
    blocks.prefetch(len(model.model.layers), "cpu")  # past the last block: nothing to read
    assert blocks._ahead is None
    blocks.close()


def test_a_damaged_block_read_ahead_fails_at_its_own_load_with_one_line(tiny_tokenizer, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    src = _sharded("llama", tiny_tokenizer, tmp_path / "model")
    weight_map = json.loads((src / lazy.INDEX).read_text())["weight_map"]
    name = "model.layers.2.mlp.up_proj.weight"
    shard = src / weight_map[name]
    tensors = load_file(shard)
    tensors[name][0, :3] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    model, blocks = _opened(src)
    readers = _record_readers(monkeypatch)
    blocks.prefetch(2, "cpu")
    blocks.load(1, "cpu")  # the damaged read ahead was for another block: dropped, block 1 loads
    assert readers == ["quantkit-block-reader_0", "MainThread"]
    readers.clear()
    blocks.prefetch(2, "cpu")
    with pytest.raises(lazy.QuantkitError, match=f"model tensor {name} contains 3 NaN/Inf values"):
        blocks.load(2, "cpu")
    assert readers == ["quantkit-block-reader_0"]  # raised from the read ahead, at its own block
    blocks.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reading ahead onto a GPU needs CUDA")
def test_reading_ahead_onto_the_gpu_gives_the_same_artifact_bytes(tiny_tokenizer, small_data, tmp_path):
    src = _sharded("llama", tiny_tokenizer, tmp_path / "model")
    outs = {lazy_: tmp_path / f"lazy-{lazy_}" for lazy_ in (True, False)}
    for lazy_, out in outs.items():
        quantize_checkpoint(str(src), out, "gptq", {"bits": 4, "group_size": 32}, nsamples=2, seqlen=32, calib="ptb",
                            device="cuda", dtype="float32", data_dir=small_data, progress=False, checkpoint=False,
                            lazy=lazy_)
    summary = json.loads((outs[True] / "quant_log.json").read_text())
    assert summary["block_read_ahead_seconds"] > 0
    for path in outs[True].iterdir():
        if path.name != "quant_log.json":
            assert path.read_bytes() == (outs[False] / path.name).read_bytes(), path.name


@pytest.mark.parametrize("caller", [None, "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_quantize_asks_for_expandable_segments_unless_the_caller_configured_the_allocator(caller, tiny_tokenizer,
                                                                                           small_data, tmp_path,
                                                                                           monkeypatch):
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    if caller is not None:
        environ[caller] = "max_split_size_mb:64"
    monkeypatch.setattr(os, "environ", environ)  # a copy: what quantize sets stays out of later tests
    src = _sharded("llama", tiny_tokenizer, tmp_path / "model")
    _quantize(src, tmp_path / "q", small_data, "rtn")
    if caller is None:
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    else:
        assert os.environ[caller] == "max_split_size_mb:64"
        assert {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ) == {caller}


def test_a_checkpoint_with_a_dtype_the_block_reader_does_not_know_is_loaded_whole(tiny_tokenizer, tmp_path,
                                                                                  monkeypatch, caplog):
    from quantkit.models.loading import resolve_source

    src = _sharded("llama", tiny_tokenizer, tmp_path / "model")  # float32 tensors
    assert lazy.open_lazy(resolve_source(str(src)), torch.float32) is not None
    from quantkit import tensorfile

    monkeypatch.setattr(tensorfile, "DTYPE_OF", {k: v for k, v in tensorfile.DTYPE_OF.items() if k != "F32"})
    with caplog.at_level("WARNING"):
        assert lazy.open_lazy(resolve_source(str(src)), torch.float32) is None
    assert "has dtype F32, which quantkit does not read; loading" in caplog.text
    assert "whole instead of one decoder block at a time" in caplog.text
