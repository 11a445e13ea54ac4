"""GPTQ(h, l, p) "odd-one-clear" storage (k-OOC paper, section 3.2, eq. 4).

A [k, d] weight is stored like the uniform format at l bits with groups of g (G = ceil(d/g),
the last group may be partial), except that in each row one group, the *odd* group, has n = p·g
"clear" columns whose codes are h bits under their own fp16 scale and h-bit zero point: the odd
group carries two flag sets, its usual (l-bit zero, fp16 scale) for its other columns and the
(h-bit zero, fp16 scale) of its clear columns. The clear columns of a candidate odd group are a
fixed set of n columns of that group (chosen by the method, the same for every row), so the set
of clear-column lists is a small per-matrix table.

Stored tensors (n = n_clear, C = number of clear-column lists in the table):
  qweight     int32 [k, ceil(((d-n)·l + n·h)/32)]  one bitstream per row, least significant bit
                                           first (the formats.packing layout): the l-bit codes of the
                                           row's d-n non-clear columns in column order, then the h-bit
                                           codes of its n clear columns in the order of its list
  scales      fp16  [k, G]                 low flag sets: scale of every group (odd group included)
  qzeros      int32 [G, ceil(k·l/32)]      asymmetric only: l-bit zero points, one bitstream per group
  hscales     fp16  [k]                    high flag set: scale of the row's clear columns
  hzeros      int32 [1, ceil(k·h/32)]      asymmetric only: h-bit zero point of the clear columns
  clear_cols  int16 [C, n]                 clear-column lists (absolute column indices, ascending, all
                                           in one group); int32 when d > 32767
  row_choice  uint8 [k]                    per-row choice only: index into clear_cols of each row
                                           (int16 when C > 256); absent per matrix (C = 1, row -> list 0)
Dequantization: w[r, c] = (q - z_l[r, c // g])·s_l[r, c // g] for non-clear c, and
(qh - z_h[r])·s_h[r] for the row's clear columns. Symmetric: no zeros stored, z = 2**(b-1).

Exact stored bits (asymmetric; symmetric drops the two zero terms):
  k·32·ceil(((d-n)l + nh)/32) + 16kG + G·32·ceil(kl/32) + 16k + 32·ceil(kh/32)
  + 16·C·n (+ 8k per row)
With g | d, no packing padding ((d-n)l + nh, kl, kh multiples of 32) and p·g = n this is
  k·d·A_eq4 - (h - l)·k + 16·C·n (+ 8k),
i.e. eq. (4) except that (a) eq. (4) counts the odd group's low zero point at h bits (F_odd =
2(h+f)) where we store it at l bits, and (b) eq. (4) has no term for the clear-column table
(16n bits per matrix per-matrix; 16Cn + 8k per row). `ooc_stored_bits` computes the exact value.
"""

from dataclasses import dataclass

import torch

from quantkit.formats.base import QuantizedTensor, register_format
from quantkit.formats.packing import pack_rows, unpack_rows, words_per_row
from quantkit.formats.uniform import num_groups

FLAG_BITS = 16


def index_dtype(limit: int):
    return torch.int16 if limit <= 32767 else torch.int32


def ooc_stored_bits(k, d, low_bits, high_bits, group_size, n_clear, n_lists, per_row, sym):
    """Exact stored bits of an OOCQuantizedTensor of these shapes (see the module docstring)."""
    groups = num_groups(d, group_size)
    bits = k * 32 * words_per_row((d - n_clear) * low_bits + n_clear * high_bits, 1)
    bits += FLAG_BITS * k * groups + FLAG_BITS * k
    if not sym:
        bits += groups * 32 * words_per_row(k, low_bits) + 32 * words_per_row(k, high_bits)
    bits += (16 if d <= 32767 else 32) * n_lists * n_clear
    if per_row:
        bits += (8 if n_lists <= 256 else 16) * k
    return bits


def _bits(codes, bits):
    """[R, C] codes -> [R, C·bits] their bits, least significant first."""
    shift = torch.arange(bits, device=codes.device, dtype=torch.int64)
    return ((codes.to(torch.int64).unsqueeze(-1) >> shift) & 1).reshape(codes.shape[0], -1)


def _codes(stream, bits):
    """Inverse of _bits."""
    weight = 1 << torch.arange(bits, device=stream.device, dtype=torch.int64)
    return (stream.reshape(stream.shape[0], -1, bits) * weight).sum(-1)


@register_format
@dataclass
class OOCQuantizedTensor(QuantizedTensor):
    format_name = "ooc"

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor  # None when sym
    hscales: torch.Tensor
    hzeros: torch.Tensor  # None when sym
    clear_cols: torch.Tensor
    row_choice: torch.Tensor  # None per matrix
    low_bits: int
    high_bits: int
    group_size: int
    in_features: int
    sym: bool

    @property
    def shape(self):
        return (self.qweight.shape[0], self.in_features)

    @property
    def n_clear(self):
        return self.clear_cols.shape[1]

    @classmethod
    def from_codes(cls, low_codes, scales, zeros, high_codes, hscales, hzeros, clear_cols, row_choice,
                   low_bits, high_bits, group_size, sym):
        """low_codes [k, d] (values at a row's clear columns are ignored), scales/zeros [k, G];
        high_codes [k, n] in clear-list order, hscales/hzeros [k]; clear_cols [C, n] absolute columns;
        row_choice [k] indices into clear_cols, or None (one list, C = 1, for every row)."""
        k, d = low_codes.shape
        clear_cols = clear_cols.to(torch.int64)
        if row_choice is None and clear_cols.shape[0] != 1:
            raise ValueError("per-matrix OOC stores exactly one clear-column list")
        mask = cls._clear_mask(clear_cols, row_choice, k, d)
        low = low_codes.to(torch.int64)[~mask].reshape(k, d - clear_cols.shape[1])
        choice = None
        if row_choice is not None:
            choice = row_choice.to(torch.uint8 if clear_cols.shape[0] <= 256 else torch.int16).contiguous()
        return cls(
            qweight=pack_rows(torch.cat([_bits(low, low_bits), _bits(high_codes, high_bits)], dim=1), 1),
            scales=scales.to(torch.float16).contiguous(),
            qzeros=None if sym else pack_rows(zeros.t().contiguous().to(torch.int64), low_bits),
            hscales=hscales.to(torch.float16).contiguous(),
            hzeros=None if sym else pack_rows(hzeros.to(torch.int64).reshape(1, k), high_bits),
            clear_cols=clear_cols.to(index_dtype(d)).contiguous(),
            row_choice=choice,
            low_bits=low_bits, high_bits=high_bits, group_size=group_size, in_features=d, sym=sym,
        )

    @staticmethod
    def _row_lists(clear_cols, row_choice, k):
        """[k, n] int64: each row's clear columns."""
        cols = clear_cols.to(torch.int64)
        if row_choice is None:
            return cols[0].expand(k, -1)
        return cols[row_choice.to(torch.int64)]

    @classmethod
    def _clear_mask(cls, clear_cols, row_choice, k, d):
        rows = cls._row_lists(clear_cols, row_choice, k)
        mask = torch.zeros(k, d, dtype=torch.bool, device=clear_cols.device)
        mask.scatter_(1, rows, True)
        return mask

    def row_clear_cols(self) -> torch.Tensor:
        return self._row_lists(self.clear_cols, self.row_choice, self.shape[0])

    def low_zeros(self) -> torch.Tensor:
        k, groups = self.scales.shape
        if self.sym:
            return torch.full((k, groups), 2 ** (self.low_bits - 1), dtype=torch.float32, device=self.scales.device)
        return unpack_rows(self.qzeros, self.low_bits, k).t().to(torch.float32)

    def high_zeros(self) -> torch.Tensor:
        k = self.shape[0]
        if self.sym:
            return torch.full((k,), 2 ** (self.high_bits - 1), dtype=torch.float32, device=self.scales.device)
        return unpack_rows(self.hzeros, self.high_bits, k)[0].to(torch.float32)

    def _streams(self):
        """(low codes [k, d-n], high codes [k, n]) unpacked from qweight."""
        k, d = self.shape
        n, lo, hi = self.n_clear, self.low_bits, self.high_bits
        stream = unpack_rows(self.qweight, 1, (d - n) * lo + n * hi).to(torch.int64)
        return _codes(stream[:, : (d - n) * lo], lo), _codes(stream[:, (d - n) * lo :], hi)

    def dequantize(self, dtype=torch.float32):
        k, d = self.shape
        mask = self._clear_mask(self.clear_cols, self.row_choice, k, d)
        codes = torch.zeros(k, d, dtype=torch.float32, device=self.qweight.device)
        low, high_codes = self._streams()
        codes[~mask] = low.to(torch.float32).reshape(-1)
        groups = torch.arange(d, device=codes.device) // self.group_size
        out = (codes - self.low_zeros()[:, groups]) * self.scales.to(torch.float32)[:, groups]
        high = (high_codes.to(torch.float32) - self.high_zeros()[:, None]) * self.hscales.to(torch.float32)[:, None]
        out.scatter_(1, self.row_clear_cols(), high)
        return out.to(dtype)

    def state_dict(self):
        tensors = {"qweight": self.qweight, "scales": self.scales, "hscales": self.hscales,
                   "clear_cols": self.clear_cols}
        if self.qzeros is not None:
            tensors["qzeros"] = self.qzeros
            tensors["hzeros"] = self.hzeros
        if self.row_choice is not None:
            tensors["row_choice"] = self.row_choice
        return tensors

    def meta(self):
        return {"format": self.format_name, "bits": self.low_bits, "low_bits": self.low_bits,
                "high_bits": self.high_bits, "group_size": self.group_size, "in_features": self.in_features,
                "out_features": self.shape[0], "sym": self.sym, "n_clear": self.n_clear,
                "n_lists": self.clear_cols.shape[0], "per_row": self.row_choice is not None}

    @classmethod
    def from_state_dict(cls, meta, tensors):
        return cls(qweight=tensors["qweight"], scales=tensors["scales"],
                   qzeros=tensors.get("qzeros"), hscales=tensors["hscales"], hzeros=tensors.get("hzeros"),
                   clear_cols=tensors["clear_cols"], row_choice=tensors.get("row_choice"),
                   low_bits=meta["low_bits"], high_bits=meta["high_bits"], group_size=meta["group_size"],
                   in_features=meta["in_features"], sym=meta["sym"])
