"""Decoder blocks materialised from the checkpoint's safetensors shards one at a time.

The model is built on the meta device (models.loading.empty_model); the tensors outside the decoder blocks
(embeddings, final norm, head) are read at once, and each block's parameters are read from the
memory-mapped shards only when the engine reaches that block (`load`), then dropped back to the meta device
once its quantized tensors are taken (`release`: the quantized linears' weights go; the few small tensors
the artifact stores in float, norms, biases, a MoE router, stay). Host memory is then about the tensors
outside the blocks + one block + the calibration activations + one layer's packed tensors (the finished
layers' wait on disk, engine/spill.py), not the model.

A checkpoint whose tensor names are not the model's own (ones transformers renames or merges while it loads,
e.g. Mixtral's `block_sparse_moe.experts.*.w1`) is loaded whole instead (`open_lazy` returns None and says
why in the log). Missing or truncated shards are refused up front by `check_shards`.
"""

import json
import logging
import time
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from quantkit.artifact import read_header
from quantkit.errors import QuantkitError

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


class LazyBlocks:
    """Materialises and releases the decoder blocks of a meta-device model (see the module docstring)."""

    def __init__(self, model, layers_path, directory, dtype, keys):
        self.model, self.layers_path = model, layers_path
        self.directory, self.dtype, self.keys = Path(directory), dtype, keys  # keys: param -> (file, tensor)
        self.seconds = 0.0  # spent reading blocks

    def _read(self, names) -> dict:
        by_file = {}
        for name in names:
            by_file.setdefault(self.keys[name][0], []).append(name)
        out = {}
        for fname, group in sorted(by_file.items()):
            with safe_open(str(self.directory / fname), framework="pt") as fh:
                for name in group:
                    out[name] = fh.get_tensor(self.keys[name][1]).to(self.dtype)
        return out

    def _assign(self, tensors, device=None):
        for name, value in tensors.items():
            if device is not None:
                value = value.to(device)
            # on the device where there is one: on the host this pass over a 7B block took most of a second
            # with one thread (torchrun's default), longer than reading the block
            if not torch.isfinite(value).all():
                raise QuantkitError(f"model tensor {name} contains {(~torch.isfinite(value)).sum().item()} NaN/Inf "
                                    "values; the checkpoint is damaged")
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
        """Read decoder block `index` in the compute dtype, onto `device` (default: the CPU)."""
        start = time.perf_counter()
        self._assign(self._read(self._block_params(index)), device)
        self.seconds += time.perf_counter() - start

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
    blocks = LazyBlocks(model, adapter.layers_path, source.path, dtype, keys)
    blocks.load_outside()
    model.config.use_cache = False
    return model.eval(), blocks, adapter
