"""Binary-coding quantization (BCQ, nuQmm / LUT-GEMM eq. 3): per group of g consecutive input
weights of an output row, w ≈ Σ_{i<q} α_i·b_i (+ z), b_i ∈ {−1, +1}.

Stored tensors for a [k, d] weight (k = out_features rows, d = in_features columns), q planes,
G = ceil(d/g) groups per row (group = column // g; the last group may be partial) and
W = ceil(d/32) words per row:
  qweight  int32 [q, W, k]  binary planes. Bit j (LSB = 0) of qweight[i, w, r] is plane i of row r
                            at column 32w + j: 1 means b = +1, 0 means b = −1.
  alpha    fp16  [G, q, k]  α of (group, plane, row)
  offset   fp16  [G, k]     z of (group, row); only when the tensor has an offset
Dequantization: w[r, c] = Σ_i alpha[c//g, i, r]·(2·bit_i[r, c] − 1) + offset[c//g, r],
summed in fp32 in plane order i = 0..q−1, offset last.

Why this order (LUT-GEMM §3.1-3.2, appendix B, μ = 8): byte m of a word (bits 8m..8m+7) holds the
8-column sub-vector 32w+8m .. 32w+8m+7, so `(word >> 8m) & 0xFF` is directly the key into that
sub-vector's 256-entry LUT T[key] = Σ_t (2·bit_t(key) − 1)·x[32w+8m+t]; one word feeds 4 LUTs.
Rows are the fastest-varying index of all three tensors because a LUT-GEMM thread block shares
its LUTs across rows with one thread per row: a warp reading word w (or α/z of a group) of 32
consecutive rows then makes one coalesced 128-byte load. Planes are outermost so the kernel
iterates q times over the same LUTs (LUT-GEMM §3.2), and a q-plane matrix is q contiguous
[W, k] bit matrices. With g a multiple of 32 every word lies inside one group.

Padding: when d is not a multiple of 32, the last word of each row has 32W − d padding bits,
stored as 0 (b = −1). Kernels must zero-pad x to 32W columns (or mask), so padding contributes
nothing, and sum the offset only over the group's real columns. Stored bits are counted as
stored (q·32·W per row), so bits_per_weight equals bitfamily.bcq_bits(q, g, offset, d) exactly
when d % 32 == 0 and exceeds it by the padding otherwise. A partial last group needs no padding
of its own: it is just a group with fewer columns.

`bcq_from_uniform` converts a uniform tensor into this form (LUT-GEMM appendix C).
"""

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.base import QuantizedTensor, register_format
from quantkit.formats.packing import pack_rows, unpack_rows
from quantkit.formats.uniform import UniformQuantizedTensor, num_groups


def pack_planes(signs: torch.Tensor) -> torch.Tensor:
    """signs: bool [q, k, d] (True = +1) -> int32 [q, W, k] (layout in the module docstring)."""
    q, k, d = signs.shape
    # packing.pack_rows with 1-bit codes puts column 32w+j at bit j of word w, as we want
    words = pack_rows(signs.reshape(q * k, d).to(torch.int64), 1)
    return words.reshape(q, k, -1).transpose(1, 2).contiguous()


def unpack_planes(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of pack_planes: int32 [q, W, k] -> bool [q, k, d]."""
    q, nwords, k = qweight.shape
    rows = qweight.transpose(1, 2).reshape(q * k, nwords)
    return unpack_rows(rows, 1, in_features).reshape(q, k, in_features).bool()


@register_format
@dataclass
class BCQQuantizedTensor(QuantizedTensor):
    format_name = "bcq"

    qweight: torch.Tensor  # int32 [q, W, k]
    alpha: torch.Tensor  # fp16 [G, q, k]
    offset: torch.Tensor  # fp16 [G, k] or None
    bits: int
    group_size: int
    in_features: int

    @property
    def shape(self):
        return (self.qweight.shape[2], self.in_features)

    @classmethod
    def from_signs(cls, signs, alpha, offset, group_size):
        """signs bool [q, k, d] (True = +1); alpha [k, G, q]; offset [k, G] or None (any float dtype)."""
        q, k, d = signs.shape
        if alpha.shape != (k, num_groups(d, group_size), q):
            raise ValueError(f"alpha shape {tuple(alpha.shape)} does not match {q} planes of [{k}, {d}], "
                             f"g={group_size}")
        return cls(
            qweight=pack_planes(signs),
            alpha=alpha.permute(1, 2, 0).to(torch.float16).contiguous(),
            offset=None if offset is None else offset.t().to(torch.float16).contiguous(),
            bits=q,
            group_size=group_size,
            in_features=d,
        )

    def signs(self) -> torch.Tensor:
        """bool [q, k, d], True = +1."""
        return unpack_planes(self.qweight, self.in_features)

    def dequantize(self, dtype=torch.float32):
        groups = torch.arange(self.in_features, device=self.qweight.device) // self.group_size
        signs = self.signs()
        alpha = self.alpha.to(torch.float32)
        w = torch.zeros(self.shape, dtype=torch.float32, device=self.qweight.device)
        for i in range(self.bits):  # fixed summation order: dequantize is a pure function of the stored bits
            a = alpha[:, i, :].t()[:, groups]
            w += torch.where(signs[i], a, -a)
        if self.offset is not None:
            w += self.offset.to(torch.float32).t()[:, groups]
        return w.to(dtype)

    def state_dict(self):
        tensors = {"qweight": self.qweight, "alpha": self.alpha}
        if self.offset is not None:
            tensors["offset"] = self.offset
        return tensors

    def meta(self):
        return {"format": self.format_name, "bits": self.bits, "group_size": self.group_size,
                "in_features": self.in_features, "out_features": self.shape[0], "offset": self.offset is not None}

    @classmethod
    def from_state_dict(cls, meta, tensors):
        if meta["offset"] != ("offset" in tensors):
            raise ValueError("BCQ meta and tensors disagree about the offset")
        return cls(qweight=tensors["qweight"], alpha=tensors["alpha"], offset=tensors.get("offset"),
                   bits=meta["bits"], group_size=meta["group_size"], in_features=meta["in_features"])


def bcq_from_uniform(ut: UniformQuantizedTensor) -> BCQQuantizedTensor:
    """Uniform -> BCQ conversion (LUT-GEMM appendix C, eq. 5-7), exact but for one fp16 rounding.

    Uniform: w = (c − z_u)·s with c = Σ_i 2^i·ĉ_i, ĉ_i ∈ {0, 1}. With b_i = 2ĉ_i − 1:
    w = Σ_i 2^(i−1)·s·b_i + s·((2^q − 1)/2 − z_u), so α_i = 2^(i−1)·s (exact in fp16: s is fp16
    and 2^(i−1) a power of two, unless the product is subnormal) and z = s·((2^q − 1)/2 − z_u), which
    needs up to 11 + q significant bits and is stored rounded to fp16: each dequantized weight moves
    by at most ½ ulp of z, ≤ 2^(q−12)·s (measured on RTN: up to ~0.02 of a step at 8 bits, ~0.002 at
    3). Symmetric tensors (z_u = 2^(q−1)) get z = −s/2, exact for normal s. Always stores an offset.
    """
    if ut.g_idx is not None:
        raise QuantkitError("cannot convert a uniform tensor with g_idx (act-order without static groups) "
                            "to BCQ: BCQ groups are runs of consecutive columns")
    q = ut.bits
    planes = torch.arange(q, device=ut.qweight.device)
    signs = ((ut.codes().to(torch.int64).unsqueeze(0) >> planes[:, None, None]) & 1).bool()  # [q, k, d]
    scale = ut.scales.to(torch.float32)  # [k, G]
    alpha = scale.unsqueeze(-1) * torch.exp2(planes.to(torch.float32) - 1)  # [k, G, q]
    offset = scale * ((2**q - 1) / 2 - ut.zeros())
    return BCQQuantizedTensor.from_signs(signs, alpha, offset, ut.group_size)
