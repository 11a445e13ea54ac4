"""Write, read and verify quantkit artifacts.

An artifact is a directory a Hugging Face user recognises:
  config.json          the model config plus `quantization_config` (quant_method "quantkit",
                       method settings, one meta entry per quantized module, sha256 of every
                       tensor file)
  tokenizer files
  model.safetensors    (or model-0000i-of-0000n.safetensors + index) holding, for a quantized
                       linear `m`, the format's tensors as `m.qweight`, `m.scales`, ...; every
                       other tensor in fp16; header metadata: quantkit version, format, sha256
                       of the tensor contents
  quant_log.json       per-module reconstruction error and time, calibration protocol
It is written into a temporary sibling directory and renamed into place only when complete.
Only safetensors and JSON are used (no pickle).
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit import __version__
from quantkit.errors import QuantkitError

CONFIG = "config.json"
LOG = "quant_log.json"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def tensor_digest(tensors: dict) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def float_tensors(model, quantized_modules, dtype=torch.float16) -> dict:
    """The model's tensors that are not replaced by quantized ones, cast to `dtype`.

    A tied lm_head is dropped (it is re-tied on load); shared storage cannot go to safetensors.
    """
    skip = {f"{m}.weight" for m in quantized_modules}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out, seen = {}, {}
    for name, tensor in model.state_dict().items():
        if name in skip:
            continue
        key = tensor.data_ptr()
        if tied and key in seen:
            continue
        seen[key] = name
        out[name] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
    return out


def _shard(tensors: dict, max_bytes: int):
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    return shards


def write_artifact(out_dir, *, model_config: dict, tokenizer, qtensors: dict, float_tensors: dict,
                   quantization_config: dict, quant_log: dict, overwrite=False, max_shard_bytes=DEFAULT_SHARD_BYTES):
    """Write the artifact atomically. qtensors: {module name: QuantizedTensor}."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise QuantkitError(f"{out_dir} already exists; pass --overwrite to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors = dict(float_tensors)
        modules = {}
        for name, qt in qtensors.items():
            modules[name] = qt.meta()
            for key, value in qt.state_dict().items():
                tensors[f"{name}.{key}"] = value.detach().to("cpu").contiguous()
        shards = _shard(tensors, max_shard_bytes)
        files = {}
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            metadata = {"format": "pt", "quantkit_version": __version__, "quantkit_sha256": tensor_digest(shard)}
            save_file(shard, str(tmp / fname), metadata=metadata)
            files[fname] = file_digest(tmp / fname)
            weight_map.update({name: fname for name in shard})
        if len(shards) > 1:
            (tmp / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
        qcfg = {"quant_method": "quantkit", "quantkit_version": __version__, **quantization_config,
                "modules": modules, "files": files}
        config = dict(model_config)
        config["quantization_config"] = qcfg
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / LOG).write_text(json.dumps(quant_log, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if out_dir.exists():
            trash = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(trash)
            tmp.rename(out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise QuantkitError(f"could not write the artifact to {out_dir}: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_config(path) -> dict:
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError as exc:
        raise QuantkitError(f"{path} has no {CONFIG}: not a quantkit artifact") from exc
    except json.JSONDecodeError as exc:
        raise QuantkitError(f"{path / CONFIG} is not valid JSON: {exc}") from exc
    qcfg = config.get("quantization_config") or {}
    if qcfg.get("quant_method") != "quantkit":
        raise QuantkitError(f"{path} is not a quantkit artifact (no quantization_config with quant_method 'quantkit')")
    return config


def read_tensors(path, verify=True) -> dict:
    """All tensors of the artifact by name, on CPU; checks each file's sha256 unless verify=False."""
    path = Path(path)
    qcfg = read_config(path)["quantization_config"]
    tensors = {}
    for fname, expected in sorted(qcfg["files"].items()):
        fpath = path / fname
        if not fpath.is_file():
            raise QuantkitError(f"{fpath}: tensor file missing from the artifact")
        if verify and file_digest(fpath) != expected:
            raise QuantkitError(f"{fpath}: checksum mismatch (file truncated or altered); re-create the artifact")
        try:
            with safe_open(str(fpath), framework="pt") as fh:
                for name in fh.keys():
                    tensors[name] = fh.get_tensor(name)
        except Exception as exc:
            raise QuantkitError(f"{fpath}: unreadable safetensors file ({exc})") from exc
    return tensors


def split_module_tensors(tensors: dict, modules: dict):
    """Split a flat tensor dict into ({module: {short name: tensor}}, {other name: tensor})."""
    per_module = {name: {} for name in modules}
    rest = {}
    for key, value in tensors.items():
        module, _, short = key.rpartition(".")
        if module in per_module and short != "bias":
            per_module[module][short] = value
        else:
            rest[key] = value
    return per_module, rest


def read_log(path) -> dict:
    try:
        return json.loads((Path(path) / LOG).read_text())
    except FileNotFoundError:
        return {}
