"""The QuantizedTensor contract shared by every format.

A QuantizedTensor is what a method returns and what the artifact stores: its tensors (in the
layout the kernels read, so loading never repacks), a small JSON-able `meta` dict, an exact
`dequantize()` and an exact `bits_per_weight()` counted from the stored bytes.
"""

from abc import ABC, abstractmethod

import torch

FORMATS = {}


def register_format(cls):
    FORMATS[cls.format_name] = cls
    return cls


class QuantizedTensor(ABC):
    format_name = None

    @property
    @abstractmethod
    def shape(self) -> tuple:
        """(out_features, in_features) of the original weight."""

    @abstractmethod
    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        ...

    @abstractmethod
    def state_dict(self) -> dict:
        """Stored tensors by short name (qweight, scales, ...); None entries are not stored."""

    @abstractmethod
    def meta(self) -> dict:
        """JSON-able description needed, with state_dict(), to rebuild the tensor."""

    @classmethod
    @abstractmethod
    def from_state_dict(cls, meta: dict, tensors: dict) -> "QuantizedTensor":
        ...

    def stored_bits(self) -> int:
        return sum(t.numel() * t.element_size() * 8 for t in self.state_dict().values())

    def bits_per_weight(self) -> float:
        rows, cols = self.shape
        return self.stored_bits() / (rows * cols)

    def to(self, device):
        return type(self).from_state_dict(self.meta(), {k: v.to(device) for k, v in self.state_dict().items()})


def quantized_tensor_from_state_dict(meta: dict, tensors: dict) -> QuantizedTensor:
    fmt = meta.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r} (known: {', '.join(sorted(FORMATS))})")
    return FORMATS[fmt].from_state_dict(meta, tensors)
