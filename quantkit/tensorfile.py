"""safetensors files written, hashed and read one tensor at a time.

`safetensors.torch.save_file` takes every tensor of a file at once, and some releases copy each of them
into a bytes object first: a 2 GiB artifact shard then costs 2 GiB more host memory while it is written.
Here a file is described by `TensorBytes` entries (an in-memory tensor, or a byte range of a file already
on disk) and written entry by entry, so memory holds one read buffer, never a shard.

The bytes are those save_file writes (a test holds the two to each other): an 8-byte little-endian header
length, the JSON header padded with spaces to a multiple of 8 bytes (`__metadata__` first, then the
tensors in data order), then the tensors' bytes back to back in data order: descending by dtype in the
library's dtype order, then by name. The library emits `__metadata__` keys in hash-map order, which
changes from process to process; they are written sorted here, so two runs that store the same tensors
write the same bytes (what --resume and multi-GPU runs promise).
"""

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# the format's dtype names, in the order of the library's dtype enumeration (data is laid out from the last)
_DTYPES = [("BOOL", torch.bool), ("U8", torch.uint8), ("I8", torch.int8), ("F8_E5M2", torch.float8_e5m2),
           ("F8_E4M3", torch.float8_e4m3fn), ("I16", torch.int16), ("U16", torch.uint16), ("F16", torch.float16),
           ("BF16", torch.bfloat16), ("I32", torch.int32), ("U32", torch.uint32), ("F32", torch.float32),
           ("F64", torch.float64), ("I64", torch.int64), ("U64", torch.uint64)]
NAME_OF = {dtype: name for name, dtype in _DTYPES}
DTYPE_OF = {name: dtype for name, dtype in _DTYPES}
_RANK = {dtype: rank for rank, (_, dtype) in enumerate(_DTYPES)}
CHUNK_BYTES = 16 * 1024**2  # read buffer for tensors that wait in files


@dataclass(frozen=True, eq=False)
class TensorBytes:
    """One tensor to write: its dtype and shape, and where its bytes are: `tensor` (CPU, contiguous);
    `rows`, a tensor on any device copied to the host one index of its first dimension at a time; or
    `nbytes` bytes at `offset` of the file `path`."""

    dtype: torch.dtype
    shape: tuple
    tensor: torch.Tensor = None
    rows: torch.Tensor = None
    path: Path = None
    offset: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorBytes":
        tensor = tensor.detach().to("cpu").contiguous()
        return cls(tensor.dtype, tuple(tensor.shape), tensor=tensor)

    @classmethod
    def by_rows(cls, tensor: torch.Tensor) -> "TensorBytes":
        """A tensor (e.g. activations on the GPU) that reaches the host one row at a time, never whole."""
        return cls(tensor.dtype, tuple(tensor.shape), rows=tensor.detach())

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def chunks(self):
        """The tensor's bytes as memoryviews, in order (one view of an in-memory tensor; buffers of at most
        CHUNK_BYTES read from a file, each valid until the next is asked for)."""
        if self.tensor is not None or self.rows is not None:
            pieces = [self.tensor] if self.tensor is not None else self.rows
            for piece in pieces:
                piece = piece.to("cpu").contiguous()
                if piece.numel():
                    yield memoryview(piece.reshape(-1).view(torch.uint8).numpy())
            return
        left = self.nbytes
        buffer = memoryview(bytearray(min(left, CHUNK_BYTES)))
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            while left:
                got = fh.readinto(buffer[: min(left, len(buffer))])
                if not got:
                    raise OSError(f"{self.path}: file ended {left} bytes before a tensor's end")
                left -= got
                yield buffer[:got]

    def load(self) -> torch.Tensor:
        """The tensor in memory (a file range is read into a new tensor)."""
        if self.tensor is not None:
            return self.tensor
        if self.rows is not None:
            return self.rows.to("cpu").contiguous()
        out = torch.empty(self.shape, dtype=self.dtype)
        if self.nbytes:
            flat = out.reshape(-1).view(torch.uint8).numpy()
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                if fh.readinto(memoryview(flat)) != self.nbytes:
                    raise OSError(f"{self.path}: file ended before a tensor's end")
        return out


def data_order(entries: dict) -> list:
    """The tensor names in the order save_file lays out their bytes."""
    unknown = sorted({str(e.dtype) for e in entries.values() if e.dtype not in _RANK})
    if unknown:
        raise ValueError(f"dtypes safetensors cannot store: {', '.join(unknown)}")
    return sorted(entries, key=lambda name: (-_RANK[entries[name].dtype], name))


def layout(entries: dict) -> dict:
    """The header's tensor entries {name: {"dtype", "shape", "data_offsets"}}, in data order."""
    out, offset = {}, 0
    for name in data_order(entries):
        entry = entries[name]
        out[name] = {"dtype": NAME_OF[entry.dtype], "shape": list(entry.shape),
                     "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    return out


def contents_digest(entries: dict) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order (an artifact shard's
    `quantkit_sha256`)."""
    digest = hashlib.sha256()
    for name in sorted(entries):
        entry = entries[name]
        digest.update(f"{name}|{entry.dtype}|{tuple(entry.shape)}|".encode())
        for chunk in entry.chunks():
            digest.update(chunk)
    return digest.hexdigest()


def write_tensor_file(path, entries: dict, metadata: dict = None) -> str:
    """Write the safetensors file `path` from `entries` ({name: TensorBytes}) one tensor at a time, with
    the string `metadata` (keys sorted); returns the sha256 of the file's bytes. Created 0600, as the
    library creates its files."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    header.update(layout(entries))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        for piece in (struct.pack("<Q", len(text)), text):
            fh.write(piece)
            digest.update(piece)
        for name in data_order(entries):
            for chunk in entries[name].chunks():
                fh.write(chunk)
                digest.update(chunk)
    return digest.hexdigest()


def file_entries(path, header: dict) -> dict:
    """{name: TensorBytes} of the tensors of the safetensors file `path`, whose parsed header is `header`
    (artifact.read_header); the bytes stay in the file."""
    path = Path(path)
    with open(path, "rb") as fh:
        data_start = 8 + struct.unpack("<Q", fh.read(8))[0]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPE_OF:
            raise ValueError(f"{path.name}: tensor {name} has dtype {info['dtype']}, which quantkit does not read")
        begin, _ = info["data_offsets"]
        out[name] = TensorBytes(DTYPE_OF[info["dtype"]], tuple(info["shape"]), path=path, offset=data_start + begin)
    return out
