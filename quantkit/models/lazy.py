"""Decoder blocks materialised from the checkpoint's safetensors shards one at a time.

The model is built on the meta device (models.loading.empty_model); the tensors outside the decoder blocks
(embeddings, final norm, head) are read at once, and each block's parameters are read from the
memory-mapped shards only when the engine reaches that block (`load`), then dropped back to the meta device
once its quantized tensors are taken (`release`: the quantized linears' weights go; the few small tensors
the artifact stores in float, norms, biases, a MoE router, stay). Host memory is then about the tensors
outside the blocks + one block + the calibration activations + one layer's packed tensors (the finished
layers' wait on disk, engine/spill.py), not the model.

On a GPU the engine reads one block ahead (`prefetch`): block i + 1 is read from the shards by a background
thread (plain file reads, which leave the interpreter to the engine), copied to the GPU on a side stream and
checked there while block i computes, so the reads leave the clock. The host then still holds at most one
block (the one on its way to the GPU); the GPU holds two. On the CPU there is no read-ahead: it would hold
two blocks in host memory.

A checkpoint whose tensor names are not the model's own (ones transformers renames or merges while it loads,
e.g. Mixtral's `block_sparse_moe.experts.*.w1`), or that holds a dtype the block reader does not know, is loaded
whole instead (`open_lazy` returns None and says why in the log). Missing or truncated shards are refused up
front by `check_shards`.
"""

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn as nn

from quantkit.artifact import read_header
from quantkit.errors import QuantkitError
from quantkit.tensorfile import file_entries

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def shard_files(directory) -> list:
    """The safetensors files of a checkpoint directory: those its index names, else every *.safetensors."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise QuantkitError(f"could not load model weights from {directory}: {INDEX} is unreadable ({exc})") \
                from None
        return sorted(set(weight_map.values()))
    return sorted(p.name for p in directory.glob("*.safetensors"))


def check_shards(directory) -> dict:
    """{tensor name: shard file name} of the checkpoint at `directory`, after checking that every shard
    exists and holds all the bytes its header promises; a missing or truncated shard is one QuantkitError."""
    directory = Path(directory)
    where = {}
    for name in shard_files(directory):
        path = directory / name
        if not path.is_file():
            raise QuantkitError(f"could not load model weights from {directory}: shard {name} is missing "
                                f"(listed in {INDEX})")
        try:
            header = read_header(path)
        except QuantkitError as exc:
            raise QuantkitError(f"could not load model weights from {directory}: shard {name} is damaged "
                                f"({str(exc).split(': ', 1)[-1].split(';')[0]})") from None
        size = path.stat().st_size
        with open(path, "rb") as fh:
            data_start = 8 + int.from_bytes(fh.read(8), "little")
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        if data_start + end > size:
            raise QuantkitError(f"could not load model weights from {directory}: shard {name} is truncated "
                                f"({size} bytes, its header needs {data_start + end})")
        for key in header:
            if key != "__metadata__":
                where[key] = name
    return where


def _explicit(device) -> torch.device:
    """`device` with its index: a bare "cuda" means this thread's current GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class LazyBlocks:
    """Materialises and releases the decoder blocks of a meta-device model (see the module docstring)."""

    def __init__(self, model, layers_path, directory, dtype, keys, files):
        self.model, self.layers_path = model, layers_path
        self.directory, self.dtype, self.keys = Path(directory), dtype, keys  # keys: param -> (file, tensor)
        self.files = files  # shard file -> {tensor: TensorBytes}, from the headers (tensorfile.file_entries)
        self.seconds = 0.0  # the engine's time in load(): reading, or waiting for a read ahead to finish
        self.ahead_seconds = 0.0  # reads ahead, in the background thread
        self._ahead = None  # (block index, device, Future of its checked tensors)
        self._reader = None
        self._streams = {}  # device -> the reader's CUDA stream

    def _read(self, names, device=None) -> dict:
        """{param: tensor in the compute dtype on `device`}, each read with a plain file read into a fresh
        tensor (the interpreter is free while the bytes arrive), then checked for NaN/Inf where it lands."""
        out, finite = {}, []
        for name in names:
            fname, key = self.keys[name]
            value = self.files[fname][key].load().to(device=device, dtype=self.dtype)
            finite.append(torch.isfinite(value).all())
            out[name] = value
        if finite and not bool(torch.stack(finite).all()):  # one synchronisation per block, not per tensor
            name, value = next((n, v) for (n, v), ok in zip(out.items(), finite) if not ok)
            raise QuantkitError(f"model tensor {name} contains {(~torch.isfinite(value)).sum().item()} NaN/Inf values; "
                                "the checkpoint is damaged")
        return out

    def _read_ahead(self, names, device):
        """_read in the reader thread; on a GPU on a stream of its own, so that the copies and the check do
        not queue behind the engine's work (the check synchronises that stream: the block is complete)."""
        start = time.perf_counter()
        if device.type == "cuda":
            # this thread's current GPU is 0 until set: switching streams from it would open a CUDA context on
            # GPU 0 for every rank of a torchrun job
            with torch.cuda.device(device):
                # one stream for every block: the allocator reuses memory freed by the same stream only, so a
                # stream per block left each block's memory reserved (32 GiB reserved for a 7B model)
                if device not in self._streams:
                    self._streams[device] = torch.cuda.Stream(device)
                with torch.cuda.stream(self._streams[device]):
                    tensors = self._read(names, device)
        else:
            tensors = self._read(names, device)
        self.ahead_seconds += time.perf_counter() - start
        return tensors

    def _assign(self, tensors):
        for name, value in tensors.items():
            module_name, _, leaf = name.rpartition(".")
            self.model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(value, requires_grad=False)

    def load_outside(self):
        """Read every parameter outside the decoder blocks and tie the head to the embeddings if the
        config says so."""
        prefix = self.layers_path + "."
        names = [n for n, p in self.model.named_parameters() if not n.startswith(prefix) and n in self.keys]
        self._assign(self._read(names))
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        left = [n for n, p in self.model.named_parameters() if p.device.type == "meta" and not n.startswith(prefix)]
        if left:
            raise QuantkitError(f"could not load model weights from {self.directory}: no tensor for {left[0]}")

    def _block_params(self, index):
        block = f"{self.layers_path}.{index}."
        return [n for n, _ in self.model.named_parameters() if n.startswith(block)]

    def load(self, index, device=None):
        """Read decoder block `index` in the compute dtype, onto `device` (default: the CPU), or take it from
        the read ahead started for it."""
        start = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (index, _explicit(device or "cpu")):
            tensors = ahead[2].result()  # a read that failed raises its error here, at its block
            if ahead[1].type == "cuda":
                current = torch.cuda.current_stream(ahead[1])
                for value in tensors.values():
                    value.record_stream(current)  # made on the reader's stream, used and freed on this one
        else:
            if ahead is not None:
                ahead[2].exception()  # a read ahead of another block: waited for and dropped, its error too
            tensors = self._read(self._block_params(index), device)
        self._assign(tensors)
        self.seconds += time.perf_counter() - start

    def prefetch(self, index, device):
        """Start reading block `index` onto `device` in the background; load(index, device) takes it. The
        engine asks for this on a GPU only: on the CPU the block read ahead would be a second block in host
        memory. Nothing happens for an index past the last block."""
        if index >= len(self.model.get_submodule(self.layers_path)):
            return
        device = _explicit(device)  # the reader thread's current GPU is not this thread's
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-block-reader")
        future = self._reader.submit(self._read_ahead, self._block_params(index), device)
        self._ahead = (index, device, future)

    def close(self):
        """Wait for a read ahead in flight (its tensors are dropped) and stop the reader thread."""
        if self._ahead is not None:
            self._ahead[2].exception()
            self._ahead = None
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    def load_floats(self, index, quantized=()):
        """Read only what the artifact stores in float from block `index` (a block a resumed run restored
        from its checkpoint: its quantized linears, named in `quantized`, are not needed)."""
        drop = {f"{name}.weight" for name in quantized}
        self._assign(self._read([n for n in self._block_params(index) if n not in drop]))

    def release(self, index, quantized=()):
        """Put block `index`'s parameters back on the meta device, except those the artifact stores in
        float: `quantized` names the block's quantized linears (full module names), whose weights go."""
        drop = {f"{name}.weight" for name in quantized}
        for name in self._block_params(index):
            if name in drop:
                module_name, _, leaf = name.rpartition(".")
                module = self.model.get_submodule(module_name)
                old = module._parameters[leaf]
                module._parameters[leaf] = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"),
                                                        requires_grad=False)


def _checkpoint_key(name, keys, base_prefix):
    """The checkpoint's name for model parameter `name` (checkpoints may omit the base model's prefix)."""
    if name in keys:
        return name
    if base_prefix and name.startswith(base_prefix + ".") and name[len(base_prefix) + 1:] in keys:
        return name[len(base_prefix) + 1:]
    if base_prefix and f"{base_prefix}.{name}" in keys:
        return f"{base_prefix}.{name}"
    return None


def open_lazy(source, dtype):
    """(model on the meta device with its outside tensors read, LazyBlocks, adapter) for a local safetensors
    checkpoint, or None (logged) where its tensor names are not the model's own."""
    from transformers import AutoConfig

    from quantkit.models.adapters import adapter_for
    from quantkit.models.loading import empty_model
    from quantkit.runtime.experts import replace_fused_experts

    where = check_shards(source.path)
    if not where:
        log.info("%s has no safetensors shards; loading it whole", source.display)
        return None
    try:
        files = {fname: file_entries(Path(source.path) / fname, read_header(Path(source.path) / fname))
                 for fname in sorted(set(where.values()))}
    except ValueError as exc:  # a dtype the block reader does not know
        log.warning("%s; loading %s whole instead of one decoder block at a time", exc, source.display)
        return None
    model = empty_model(AutoConfig.from_pretrained(source.path), dtype)
    replace_fused_experts(model, copy_weights=False)
    adapter = adapter_for(model)
    keys, missing = {}, []
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, _ in model.named_parameters(remove_duplicate=False):
        key = _checkpoint_key(name, where, getattr(model, "base_model_prefix", ""))
        if key is not None:
            keys[name] = (where[key], key)
        elif not (tied and name == "lm_head.weight"):
            missing.append(name)
    if missing:
        log.warning("the tensor names of %s are not the model's own (no %s); loading it whole instead of one "
                    "decoder block at a time", source.display, missing[0])
        return None
    blocks = LazyBlocks(model, adapter.layers_path, source.path, dtype, keys, files)
    blocks.load_outside()
    model.config.use_cache = False
    return model.eval(), blocks, adapter
