"""Uniform (integer) quantization with group-wise fp16 scales and packed integer zero points.

Stored tensors for a [k, d] weight with b-bit codes and G = ceil(d/g) groups per row
(the last group may be partial, as in the GPTQ reference: group = column // g):
  qweight  int32 [k, ceil(d*b/32)]  codes, one packed bitstream per output row (formats.packing)
  scales   fp16  [k, G]
  qzeros   int32 [G, ceil(k*b/32)]  asymmetric only: b-bit zero points, one bitstream per group
  g_idx    int32 [d]                only with act-order without static groups: column -> group
Dequantization: w[r, c] = (q[r, c] - z[r, grp(c)]) * s[r, grp(c)]. Symmetric quantization
stores no zeros: z = 2**(b-1), as in the GPTQ reference quantizer.
"""

from dataclasses import dataclass

import torch

from quantkit.formats.base import QuantizedTensor, register_format
from quantkit.formats.packing import pack_rows, unpack_rows

# Smallest scale we store: exactly representable in fp16 (a subnormal), far below any useful step.
MIN_SCALE = 2.0**-20


def num_groups(in_features: int, group_size: int) -> int:
    return (in_features + group_size - 1) // group_size


# Clipping search (the GPTQ reference quantizer's `mse` option): shrink the range by factors
# 1, 0.99, ..., 0.21 and keep, per row, the one minimising Σ|w - q(w)|^2.4.
CLIP_GRID = 100
CLIP_MAX_SHRINK = 0.8
CLIP_NORM = 2.4


def _params_for_range(xmin, xmax, bits, sym):
    maxq = 2**bits - 1
    scale = ((xmax - xmin) / maxq).clamp_min(MIN_SCALE).to(torch.float16).to(xmax.dtype)
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def uniform_params(w: torch.Tensor, bits: int, sym: bool, clip_search: bool = False):
    """Scale and integer zero per row of `w` [rows, n], following the GPTQ reference quantizer.

    The range always contains 0 (xmin <= 0 <= xmax); an all-zero row gets range [-1, 1]. The scale
    is rounded to fp16 *before* codes are computed, so stored scale and codes agree exactly. With
    clip_search the range is shrunk where that lowers the row's rounding error (see CLIP_*).
    """
    xmin = torch.clamp(w.min(dim=1).values, max=0)
    xmax = torch.clamp(w.max(dim=1).values, min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -torch.ones_like(xmin), xmin)
    xmax = torch.where(empty, torch.ones_like(xmax), xmax)
    scale, zero = _params_for_range(xmin, xmax, bits, sym)
    if not clip_search:
        return scale, zero
    best = torch.full_like(scale, float("inf"))
    for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
        shrink = 1 - i / CLIP_GRID
        s1, z1 = _params_for_range(shrink * xmin, shrink * xmax, bits, sym)
        err = (fake_quantize(w, s1[:, None], z1[:, None], bits) - w).abs().pow(CLIP_NORM).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s1, scale)
        zero = torch.where(better, z1, zero)
    return scale, zero


# grouped_uniform_params works on row blocks of about this many elements (bounds its temporaries) and never
# on fewer than GROUPED_MIN_ROWS rows: CUDA picks a reduction's thread layout, and with it the order in which
# a row's error is summed, from the row length and, for fewer rows than this, the row count too.
GROUPED_BLOCK_ELEMENTS = 1 << 23
GROUPED_MIN_ROWS = 512
GROUPED_MAX_WIDTH = 4096  # wider rows: CUDA may split one row's sum over blocks, by a rule that counts rows
# On the CPU, torch's pow runs vectorized except on the tail of each thread's share of a contiguous
# tensor, and the two paths round differently; a share whose length is a multiple of this (two vectors of
# the widest ISA torch uses) has no tail.
_CPU_VECTOR_SPAN = 32
_CPU_GRAIN = 32768  # at::internal::GRAIN_SIZE: below it an elementwise op runs on one thread


def _cpu_pow_has_no_tail(n: int) -> bool:
    """Whether every element of a contiguous n-element CPU op takes the vectorized path."""
    threads = torch.get_num_threads()
    if n < _CPU_GRAIN or threads == 1:
        return n % _CPU_VECTOR_SPAN == 0
    tasks = min(threads, -(-n // _CPU_GRAIN))
    chunk = -(-n // tasks)
    last = n - (-(-n // chunk) - 1) * chunk
    return chunk % _CPU_VECTOR_SPAN == 0 and last % _CPU_VECTOR_SPAN == 0


def _row_blocks(rows: int, most: int):
    """[(start, stop)] splitting `rows` into the fewest near-equal blocks of at most `most` rows."""
    count = -(-rows // most) if rows else 1
    bounds = [rows * i // count for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def grouped_uniform_params(w: torch.Tensor, group_size: int, bits: int, sym: bool, clip_search: bool = False):
    """uniform_params of every column group [j·g, (j+1)·g) of `w` [k, d] (the last may be partial):
    scales and zeros [k, G], the same values as one call per group, from a few calls over all groups'
    rows at once. Every op is elementwise or a per-row reduction, so batching rows changes no value
    where the per-row arithmetic is the same: on CUDA with at least GROUPED_MIN_ROWS rows per call; on
    the CPU where no group's pow meets a tail (_cpu_pow_has_no_tail), else it runs group by group."""
    k, d = w.shape
    g = group_size
    full = d // g
    groups = num_groups(d, g)
    scales = torch.empty(k, groups, dtype=w.dtype, device=w.device)
    zeros = torch.empty_like(scales)
    rows = k * full  # row r·full + j of the flattened groups = group j of row r
    blocks = _row_blocks(rows, max(1, GROUPED_BLOCK_ELEMENTS // g) if clip_search else rows)
    if full < 2:
        batched = False
    elif not clip_search:  # min, max and exact elementwise ops only
        batched = True
    elif w.is_cuda:
        batched = k >= GROUPED_MIN_ROWS and g <= GROUPED_MAX_WIDTH and min(b - a for a, b in blocks) >= GROUPED_MIN_ROWS
    else:
        batched = all(_cpu_pow_has_no_tail(n * g) for n in {k} | {b - a for a, b in blocks})
    if not batched:
        for j in range(groups):
            scales[:, j], zeros[:, j] = uniform_params(w[:, j * g : (j + 1) * g], bits, sym, clip_search)
        return scales, zeros
    flat = w[:, : full * g].reshape(rows, g)
    s_flat = scales.new_empty(rows)
    z_flat = zeros.new_empty(rows)
    for a, b in blocks:
        s_flat[a:b], z_flat[a:b] = uniform_params(flat[a:b], bits, sym, clip_search)
    scales[:, :full] = s_flat.view(k, full)
    zeros[:, :full] = z_flat.view(k, full)
    if full < groups:
        scales[:, full], zeros[:, full] = uniform_params(w[:, full * g :], bits, sym, clip_search)
    return scales, zeros


def quantize_codes(w, scale, zero, bits):
    """Integer codes of `w` for per-row (broadcast) scale/zero."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def fake_quantize(w, scale, zero, bits):
    return (quantize_codes(w, scale, zero, bits) - zero) * scale


@register_format
@dataclass
class UniformQuantizedTensor(QuantizedTensor):
    format_name = "uniform"

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor  # None when sym
    bits: int
    group_size: int
    in_features: int
    sym: bool
    g_idx: torch.Tensor = None

    @property
    def shape(self):
        return (self.qweight.shape[0], self.in_features)

    @classmethod
    def from_codes(cls, codes, scales, zeros, bits, group_size, sym, g_idx=None):
        """codes [k, d] ints; scales/zeros [k, G] floats (zeros integral, ignored when sym)."""
        k, d = codes.shape
        qzeros = None if sym else pack_rows(zeros.t().contiguous().to(torch.int64), bits)
        return cls(
            qweight=pack_rows(codes.to(torch.int64), bits),
            scales=scales.to(torch.float16).contiguous(),
            qzeros=qzeros,
            bits=bits,
            group_size=group_size,
            in_features=d,
            sym=sym,
            g_idx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
        )

    def codes(self) -> torch.Tensor:
        return unpack_rows(self.qweight, self.bits, self.in_features)

    def zeros(self) -> torch.Tensor:
        """Integer zero points as float [k, G]."""
        k, groups = self.scales.shape
        if self.sym:
            return torch.full((k, groups), 2 ** (self.bits - 1), dtype=torch.float32, device=self.scales.device)
        return unpack_rows(self.qzeros, self.bits, k).t().to(torch.float32)

    def column_groups(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype=torch.float32):
        groups = self.column_groups()
        scales = self.scales.to(torch.float32)[:, groups]
        zeros = self.zeros()[:, groups]
        return ((self.codes().to(torch.float32) - zeros) * scales).to(dtype)

    def state_dict(self):
        tensors = {"qweight": self.qweight, "scales": self.scales}
        if self.qzeros is not None:
            tensors["qzeros"] = self.qzeros
        if self.g_idx is not None:
            tensors["g_idx"] = self.g_idx
        return tensors

    def meta(self):
        return {"format": self.format_name, "bits": self.bits, "group_size": self.group_size,
                "in_features": self.in_features, "out_features": self.shape[0], "sym": self.sym,
                "has_g_idx": self.g_idx is not None}

    @classmethod
    def from_state_dict(cls, meta, tensors):
        return cls(qweight=tensors["qweight"], scales=tensors["scales"], qzeros=tensors.get("qzeros"),
                   bits=meta["bits"], group_size=meta["group_size"], in_features=meta["in_features"],
                   sym=meta["sym"], g_idx=tensors.get("g_idx"))
