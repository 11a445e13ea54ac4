"""Write, read and verify quantkit artifacts.

An artifact is a directory a Hugging Face user recognises:
  config.json          the model config plus `quantization_config` (quant_method "quantkit",
                       method settings, one meta entry per quantized module, sha256 of every
                       tensor file)
  tokenizer files
  model.safetensors    (or model-0000i-of-0000n.safetensors + index) holding, for a quantized
                       linear `m`, the format's tensors as `m.qweight`, `m.scales`, ...; every
                       other tensor in fp16; header metadata: quantkit version, format, sha256
                       of the tensor contents, and the two cross-checks below
  quant_log.json       per-module reconstruction error and time, calibration protocol
It is written into a temporary sibling directory and renamed into place only when complete.
Only safetensors and JSON are used (no pickle).

Integrity, from cheapest to dearest:
  * config ↔ tensor files: every shard header carries `quantkit_config_sha256`, a digest of
    config.json as written (with the `files` checksums reduced to the file names, since those
    are only known after the shards), so an edited or swapped config.json is refused;
  * header ↔ its tensors: `quantkit_layout_sha256` digests the tensors' names, dtypes, shapes and
    data offsets, so an edited header entry is refused. These two read only headers and are always checked.
  * bytes: config.json lists the sha256 of every tensor file; read_tensors checks them unless
    verify=False (`--no-verify`). Without it, changes confined to tensor bytes go unnoticed.
Artifacts written before these checks existed lack the two header digests and skip them.
"""

import hashlib
import json
import logging
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quantkit import __version__
from quantkit.errors import QuantkitError, StorageError
from quantkit.tensorfile import TensorBytes, contents_digest, layout, write_tensor_file

log = logging.getLogger(__name__)
_WARNED_UNSEALED = set()

CONFIG = "config.json"
LOG = "quant_log.json"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
SHARD_WRITERS = 4  # threads writing shards at once (each holds one read buffer)
# a safetensors header is JSON of a few hundred bytes per tensor; anything far larger is damage
MAX_HEADER_BYTES = 100 * 1024**2
CONFIG_KEY = "quantkit_config_sha256"
LAYOUT_KEY = "quantkit_layout_sha256"


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _config_digest(config: dict) -> str:
    """sha256 of the canonical JSON of `config`, with quantization_config.files reduced to its names."""
    canon = json.loads(json.dumps(config))
    qcfg = canon.get("quantization_config")
    if isinstance(qcfg, dict) and isinstance(qcfg.get("files"), dict):
        qcfg["files"] = sorted(qcfg["files"])
    return hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor entries and `__metadata__`), read without the data."""
    try:
        with open(path, "rb") as fh:
            size_bytes = fh.read(8)
            if len(size_bytes) < 8:
                raise ValueError("file shorter than its header length field")
            (size,) = struct.unpack("<Q", size_bytes)
            if size > MAX_HEADER_BYTES or size > path.stat().st_size - 8:
                raise ValueError(f"header length {size} exceeds the file")
            header = json.loads(fh.read(size).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{path}: not a valid safetensors file ({exc}); re-create the artifact") from exc
    except OSError as exc:
        raise QuantkitError(f"{path}: unreadable ({exc.strerror or exc})") from exc
    if not isinstance(header, dict):
        raise QuantkitError(f"{path}: not a valid safetensors file (header is not a JSON object)")
    return header


def _layout_digest(header: dict, where) -> str:
    """sha256 of the header's tensor entries: names, dtypes, shapes and data offsets."""
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or \
                not isinstance(info.get("shape"), list) or not isinstance(info.get("data_offsets"), list):
            raise QuantkitError(f"{where}: malformed header entry for tensor {name!r}")
        entries.append([name, info["dtype"], info["shape"], info["data_offsets"]])
    text = json.dumps(sorted(entries), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


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
    """{name: TensorBytes} split in name order into files of at most `max_bytes` (or one tensor)."""
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    return shards


def _process_umask() -> int:
    """The process umask. Reading it means setting it: call it from one thread only (the writer threads take
    the value read before they start)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _readable_as_umask_allows(path, umask):
    """Tensor files are created 0600, as safetensors creates them; give them the mode of the artifact's other
    files (0666 & ~umask), so an artifact in a shared directory can be read by those who can read its config."""
    os.chmod(path, 0o666 & ~umask)


def declares_quantkit(config) -> bool:
    """Whether a parsed config.json declares a quantkit artifact (content not checked)."""
    qcfg = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(qcfg, dict) and qcfg.get("quant_method") == "quantkit"


def is_quantkit_artifact(path) -> bool:
    """Whether `path` is a directory whose config.json declares a quantkit artifact (content not checked)."""
    try:
        return declares_quantkit(json.loads((Path(path) / CONFIG).read_text()))
    except (OSError, ValueError):
        return False


def check_out_dir(out_dir, overwrite):
    """Refuse an existing `out_dir` unless overwrite is set and it is an empty directory or a quantkit
    artifact: --overwrite replaces an earlier result, never a directory that holds anything else."""
    out_dir = Path(out_dir)
    if not out_dir.exists():
        return
    if not overwrite:
        raise QuantkitError(f"{out_dir} already exists; pass --overwrite to replace it")
    if not out_dir.is_dir():
        raise QuantkitError(f"{out_dir} exists and is not a directory; not replacing it")
    if any(out_dir.iterdir()) and not is_quantkit_artifact(out_dir):
        raise QuantkitError(f"{out_dir} is not a quantkit artifact; --overwrite replaces only an artifact or an "
                            "empty directory")


@contextmanager
def directory_written_whole(out_dir: Path, what: str):
    """Yield an empty temporary sibling of `out_dir` to fill. When the block ends, it takes `out_dir`'s
    place: an existing `out_dir` is moved aside and deleted only once the new one is in place (put back if
    the swap is interrupted). On any failure the temporary directory goes and `out_dir` is untouched; an
    I/O failure becomes one StorageError naming the cause (e.g. no space left on device)."""
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        _swap_into_place(tmp, out_dir)
    except QuantkitError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except (OSError, SafetensorError) as exc:  # safetensors reports I/O failures as its own type
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StorageError(f"could not write {what} to {out_dir}: {reason}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, out_dir: Path):
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    trash = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    out_dir.rename(trash)
    try:
        tmp.rename(out_dir)
    except BaseException:
        if not out_dir.exists():
            trash.rename(out_dir)
        raise
    shutil.rmtree(trash, ignore_errors=True)


def check_output_location(out_dir, source_path=None, estimated_bytes=None):
    """Refuse, before any expensive work, an --out that cannot be written: its nearest existing ancestor
    must accept a new directory (probed, then removed: permission bits alone say nothing about /proc or a
    read-only mount), it must not lie inside the input model's directory, and the disk must have room
    for the estimated artifact."""
    import errno
    import tempfile

    out_dir = Path(out_dir).expanduser().absolute()
    if source_path is not None:
        source = Path(source_path).resolve()
        if out_dir.resolve() == source or source in out_dir.resolve().parents:
            raise QuantkitError(f"--out {out_dir} is inside the input model's directory {source}; write it elsewhere")
    ancestor = out_dir.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QuantkitError(f"cannot create --out {out_dir}: {ancestor} is not a directory")
    try:
        Path(tempfile.mkdtemp(prefix=".quantkit-probe-", dir=ancestor)).rmdir()
    except OSError as exc:
        reason = exc.strerror or errno.errorcode.get(exc.errno, str(exc))
        raise QuantkitError(f"cannot create --out {out_dir}: {ancestor} does not accept new files ({reason})") from None
    if estimated_bytes:
        free = shutil.disk_usage(ancestor).free
        if free < estimated_bytes:
            raise QuantkitError(f"--out {out_dir}: {free / 2**30:.1f} GiB free on its disk, the artifact needs about "
                                f"{estimated_bytes / 2**30:.1f} GiB")


def quantized_entries(qtensors) -> tuple:
    """({module: meta}, {tensor name: TensorBytes}) of the quantized modules. A store that keeps them in
    files (engine.spill.QuantizedStore) hands out file ranges: nothing is read until it is written."""
    if hasattr(qtensors, "stored_tensors"):
        return qtensors.modules(), qtensors.stored_tensors()
    modules, entries = {}, {}
    for name, qt in qtensors.items():
        modules[name] = qt.meta()
        for key, value in qt.state_dict().items():
            entries[f"{name}.{key}"] = TensorBytes.of(value)
    return modules, entries


def write_artifact(out_dir, *, model_config: dict, tokenizer, qtensors, float_tensors: dict,
                   quantization_config: dict, quant_log: dict, overwrite=False, max_shard_bytes=DEFAULT_SHARD_BYTES):
    """Write the artifact atomically. qtensors: {module name: QuantizedTensor}, a dict or an
    engine.spill.QuantizedStore (whose tensors wait in files). Tensors are written one at a time, each
    from where it is, so writing needs no memory beyond a read buffer. A failure leaves neither
    `out_dir` (an existing one is kept) nor a temporary directory; a failed write is a StorageError
    naming the cause (e.g. no space left on device)."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    with directory_written_whole(out_dir, "the artifact") as tmp:
        tensors = {name: TensorBytes.of(t) for name, t in float_tensors.items()}
        modules, quantized = quantized_entries(qtensors)
        tensors.update(quantized)
        shards = _shard(tensors, max_shard_bytes)
        names = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        qcfg = {"quant_method": "quantkit", "quantkit_version": __version__, **quantization_config,
                "modules": modules, "files": {fname: None for fname in names}}
        config = dict(model_config)
        config["quantization_config"] = qcfg
        config_digest = _config_digest(config)  # covers the file names, not their checksums
        umask = _process_umask()

        def write_shard(fname, shard):  # hashing and file I/O leave the interpreter: shards go in parallel
            metadata = {"format": "pt", "quantkit_version": __version__, "quantkit_sha256": contents_digest(shard),
                        CONFIG_KEY: config_digest, LAYOUT_KEY: _layout_digest(layout(shard), fname)}
            checksum = write_tensor_file(tmp / fname, shard, metadata)
            _readable_as_umask_allows(tmp / fname, umask)
            return checksum

        with ThreadPoolExecutor(max_workers=max(1, min(len(shards), SHARD_WRITERS))) as pool:
            checksums = list(pool.map(write_shard, names, shards))
        weight_map = {}
        for fname, shard, checksum in zip(names, shards, checksums):
            qcfg["files"][fname] = checksum
            weight_map.update({name: fname for name in shard})
        if len(shards) > 1:
            (tmp / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / LOG).write_text(json.dumps(quant_log, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out_dir


def _check_schema(path: Path, config) -> dict:
    """The parts of config.json that reading relies on, checked for type; returns quantization_config."""
    where = path / CONFIG
    if not isinstance(config, dict):
        raise QuantkitError(f"{where}: expected a JSON object")
    qcfg = config.get("quantization_config")
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != "quantkit":
        raise QuantkitError(f"{path} is not a quantkit artifact (no quantization_config with quant_method 'quantkit')")
    files, modules = qcfg.get("files"), qcfg.get("modules")
    if files == {}:  # unsealed: re-saved by transformers' save_pretrained, which cannot know the checksums
        files = qcfg["files"] = {p.name: None for p in sorted(path.glob("*.safetensors"))}
        if not files:
            raise QuantkitError(f"{path}: no .safetensors tensor files")
        if str(path) not in _WARNED_UNSEALED:
            _WARNED_UNSEALED.add(str(path))
            log.warning("%s was saved by transformers' save_pretrained and carries no checksums; loading it "
                        "unverified", path)
    elif not isinstance(files, dict) or not files:
        raise QuantkitError(f"{where}: quantization_config.files must map tensor file names to sha256 checksums")
    else:
        for fname, sha in files.items():
            if Path(fname).name != fname or not fname.endswith(".safetensors") or not isinstance(sha, str):
                raise QuantkitError(f"{where}: bad quantization_config.files entry {fname!r}")
    if not isinstance(modules, dict):
        raise QuantkitError(f"{where}: quantization_config.modules must map module names to their format metadata")
    for name, meta in modules.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("format"), str):
            raise QuantkitError(f"{where}: quantization_config.modules[{name!r}] has no format")
    return qcfg


def read_config(path) -> dict:
    """config.json of the artifact at `path`, checked against the headers of its tensor files (cheap:
    headers only; see the module docstring). Raises QuantkitError naming the file at fault."""
    path = Path(path)
    try:
        text = (path / CONFIG).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise QuantkitError(f"{path} has no {CONFIG}: not a quantkit artifact") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{path / CONFIG}: unreadable ({exc})") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuantkitError(f"{path / CONFIG} is not valid JSON: {exc}") from exc
    qcfg = _check_schema(path, config)
    expected = _config_digest(config)
    for fname in sorted(qcfg["files"]):
        fpath = path / fname
        if not fpath.is_file():
            raise QuantkitError(f"{fpath}: tensor file missing from the artifact")
        header = read_header(fpath)
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict):
            raise QuantkitError(f"{fpath}: malformed header metadata")
        if CONFIG_KEY in meta and meta[CONFIG_KEY] != expected:
            raise QuantkitError(f"{path / CONFIG} does not match {fname} (config edited, or files of two artifacts "
                                "mixed); re-create the artifact")
        if LAYOUT_KEY in meta and meta[LAYOUT_KEY] != _layout_digest(header, fpath):
            raise QuantkitError(f"{fpath}: header altered (tensor names, dtypes, shapes or offsets); "
                                "re-create the artifact")
    return config


@contextmanager
def open_tensor_file(fpath):
    """safe_open of one tensor file; a file safetensors cannot read (truncated, not safetensors) is a
    QuantkitError naming it, also when only its header is read (inspect, bitfamily)."""
    try:
        handle = safe_open(str(fpath), framework="pt")
    except Exception as exc:  # safetensors raises its own error types and OSError
        raise QuantkitError(f"{fpath}: unreadable safetensors file ({exc})") from exc
    with handle as fh:
        yield fh


def verify_files(path, qcfg=None):
    """Check every tensor file's sha256 against config.json (an unsealed copy has none to check)."""
    path = Path(path)
    qcfg = qcfg or read_config(path)["quantization_config"]
    for fname, expected in sorted(qcfg["files"].items()):
        if expected is not None and file_digest(path / fname) != expected:
            raise QuantkitError(f"{path / fname}: checksum mismatch (file truncated or altered); re-create the "
                                "artifact")


def read_tensors(path, verify=True) -> dict:
    """All tensors of the artifact by name, on CPU; checks each file's sha256 unless verify=False."""
    path = Path(path)
    qcfg = read_config(path)["quantization_config"]
    if verify:
        verify_files(path, qcfg)
    tensors = {}
    for fname in sorted(qcfg["files"]):
        fpath = path / fname
        with open_tensor_file(fpath) as fh:
            for name in fh.keys():
                if name in tensors:
                    raise QuantkitError(f"{fpath}: tensor {name} also stored in another file")
                try:
                    tensors[name] = fh.get_tensor(name)
                except Exception as exc:
                    raise QuantkitError(f"{fpath}: unreadable tensor {name} ({exc})") from exc
    return tensors


def read_quantized_tensors(path, modules: dict, verify=True):
    """({module: QuantizedTensor}, {name: every other tensor}) of the artifact at `path`, whose
    quantization_config lists `modules`."""
    from quantkit.formats.base import quantized_tensor_from_state_dict

    per_module, rest = split_module_tensors(read_tensors(path, verify=verify), modules)
    return {name: quantized_tensor_from_state_dict(meta, per_module[name]) for name, meta in modules.items()}, rest


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
    """The artifact's quant_log.json ({} when absent: it is informational, not needed to load)."""
    where = Path(path) / LOG
    try:
        log = json.loads(where.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"{where}: unreadable ({exc})") from None
    if not isinstance(log, dict):
        raise QuantkitError(f"{where}: expected a JSON object")
    return log
