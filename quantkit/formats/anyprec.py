"""Any-precision codebook format (Any-Precision LLM §4-5; SqueezeLLM as the one-width special case).

A [k, d] weight (k = out_features rows, d = in_features columns) is stored as the n-bit codes of
an n-bit *parent* model in bitplanes, plus one per-row fp16 lookup table for every supported
bit-width b in [seed, parent]. The b-bit model is read from the same planes: its code is the top
b bits of the parent code, code_b = code_n >> (n − b), so serving b bits reads only planes 0..b−1.

Stored tensors (W = ceil(d/32) words per row):
  planes  int32 [n, k, W]   bitplanes, most significant first: plane p holds bit (n−1−p) of every
                            code. Bit j (LSB = 0) of planes[p, r, w] belongs to column 32w + j of
                            row r, i.e. 32 consecutive input weights per word along the input
                            dimension, as the any-precision kernel reads them (one word per
                            plane and thread; paper fig. 6). Padding bits (d % 32 != 0) are 0.
  lut_<b> fp16  [k, 2^b]    centroid table for bit-width b, for every b in seed..parent.
Dequantization at b bits: w[r, c] = lut_b[r, code_b[r, c]].

Not applied here: the paper's byte permutation of the planes for coalesced activation loads
(fig. 7b) is a kernel-side preprocessing of the same bits; a kernel may add it as a layout
version. With seed == parent the format is a plain per-channel codebook (SqueezeLLM): n planes,
one table. bits_per_weight() counts every stored tensor: (n·32·W + Σ_b 2^b·16)/d per weight;
`bits_read(b)` is what serving b bits reads: (b·32·W + 2^b·16)/d.
"""

from dataclasses import dataclass, field

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.base import QuantizedTensor, register_format


def _word_shifts(device):
    return torch.arange(32, device=device, dtype=torch.int64)


def pack_bitplanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [k, d] in [0, 2^bits) -> int32 [bits, k, ceil(d/32)], most significant plane first."""
    k, d = codes.shape
    words = (d + 31) // 32
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, words * 32 - d)).reshape(k, words, 32)
    shifts = _word_shifts(codes.device)
    planes = torch.empty(bits, k, words, dtype=torch.int32, device=codes.device)
    for p in range(bits):
        bit = (c >> (bits - 1 - p)) & 1
        value = (bit << shifts).sum(-1)
        planes[p] = torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)
    return planes


def unpack_bitplanes(planes: torch.Tensor, d: int, bits: int = None) -> torch.Tensor:
    """The codes formed by the top `bits` planes (default all): int64 [k, d]."""
    n = planes.shape[0]
    bits = n if bits is None else bits
    _, k, words = planes.shape
    shifts = _word_shifts(planes.device)
    codes = torch.zeros(k, words * 32, dtype=torch.int64, device=planes.device)
    for p in range(bits):
        w = planes[p].to(torch.int64) & 0xFFFFFFFF
        bit = ((w.unsqueeze(-1) >> shifts) & 1).reshape(k, words * 32)
        codes = (codes << 1) | bit
    return codes[:, :d]


@register_format
@dataclass
class AnyPrecisionTensor(QuantizedTensor):
    format_name = "anyprec"

    planes: torch.Tensor  # int32 [n, k, W]
    luts: dict = field(default_factory=dict)  # {bits: fp16 [k, 2^bits]} for bits in seed..parent
    seed_bits: int = 3
    parent_bits: int = 3
    in_features: int = 0

    def __post_init__(self):
        if self.planes.shape[0] != self.parent_bits:
            raise QuantkitError(f"anyprec: {self.planes.shape[0]} planes for a {self.parent_bits}-bit parent")
        missing = [b for b in self.supported_bits() if b not in self.luts]
        if missing:
            raise QuantkitError(f"anyprec: missing lookup tables for bits {missing}")

    @classmethod
    def from_codes(cls, codes, luts: dict, seed_bits: int, parent_bits: int):
        """codes int [k, d] of the parent; luts {bits: float [k, 2^bits]} for bits in seed..parent."""
        return cls(planes=pack_bitplanes(codes, parent_bits),
                   luts={int(b): luts[b].to(torch.float16).contiguous() for b in range(seed_bits, parent_bits + 1)},
                   seed_bits=seed_bits, parent_bits=parent_bits, in_features=codes.shape[1])

    @property
    def shape(self):
        return (self.planes.shape[1], self.in_features)

    def supported_bits(self):
        return list(range(self.seed_bits, self.parent_bits + 1))

    def check_bits(self, bits):
        if bits is None:
            return self.parent_bits
        if bits not in self.supported_bits():
            raise QuantkitError(f"--bits {bits} is not stored in this any-precision tensor "
                                f"(supported: {self.seed_bits}..{self.parent_bits})")
        return int(bits)

    def codes(self, bits=None) -> torch.Tensor:
        return unpack_bitplanes(self.planes, self.in_features, self.check_bits(bits))

    def dequantize(self, dtype=torch.float32, bits=None):
        bits = self.check_bits(bits)
        codes = unpack_bitplanes(self.planes, self.in_features, bits)
        return torch.gather(self.luts[bits].to(torch.float32), 1, codes).to(dtype)

    def bits_read(self, bits=None) -> float:
        """Bits per weight read when serving `bits`: the top planes plus that width's table."""
        bits = self.check_bits(bits)
        k, words = self.planes.shape[1:]
        return (bits * k * words * 32 + self.luts[bits].numel() * 16) / (k * self.in_features)

    def state_dict(self):
        return {"planes": self.planes, **{f"lut_{b}": self.luts[b] for b in self.supported_bits()}}

    def meta(self):
        return {"format": self.format_name, "bits": self.parent_bits, "seed_bits": self.seed_bits,
                "parent_bits": self.parent_bits, "in_features": self.in_features, "out_features": self.shape[0]}

    @classmethod
    def from_state_dict(cls, meta, tensors):
        seed, parent = meta["seed_bits"], meta["parent_bits"]
        return cls(planes=tensors["planes"], luts={b: tensors[f"lut_{b}"] for b in range(seed, parent + 1)},
                   seed_bits=seed, parent_bits=parent, in_features=meta["in_features"])
