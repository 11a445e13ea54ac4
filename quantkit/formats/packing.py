"""Pack small unsigned integer codes into int32 words, one bitstream per row.

Layout: code j of a row occupies bits [j*b, (j+1)*b) of that row's bitstream, least
significant bit first; word w of the row holds bitstream bits [32w, 32w+32). A row of C codes
takes ceil(C*b/32) words, so rows whose C*b is a multiple of 32 carry no padding. Works for any
b in 1..8 (3, 5, 6, 7 included: codes may straddle words). Rows are processed in chunks so
packing a large matrix never materialises more than a few MB of bit tensors.
"""

import torch

_CHUNK_ELEMENTS = 1 << 22


def words_per_row(num_codes: int, bits: int) -> int:
    return (num_codes * bits + 31) // 32


def _chunks(rows: int, row_elems: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, row_elems))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [R, C] integers in [0, 2**bits) -> int32 [R, ceil(C*bits/32)]."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    rows, cols = codes.shape
    nwords = words_per_row(cols, bits)
    out = torch.empty(rows, nwords, dtype=torch.int32, device=codes.device)
    bit_shift = torch.arange(bits, device=codes.device, dtype=torch.int64)
    word_shift = torch.arange(32, device=codes.device, dtype=torch.int64)
    for lo, hi in _chunks(rows, cols * bits):
        c = codes[lo:hi].to(torch.int64)
        stream = ((c.unsqueeze(-1) >> bit_shift) & 1).reshape(hi - lo, cols * bits)
        stream = torch.nn.functional.pad(stream, (0, nwords * 32 - cols * bits))
        words = (stream.reshape(hi - lo, nwords, 32) << word_shift).sum(-1)
        # reinterpret the unsigned 32-bit value as int32 (two's complement)
        out[lo:hi] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return out


def unpack_rows(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Inverse of pack_rows: int32 [R, W] -> uint8 [R, num_codes]."""
    rows, nwords = packed.shape
    if nwords != words_per_row(num_codes, bits):
        raise ValueError(f"{nwords} words cannot hold {num_codes} codes of {bits} bits")
    out = torch.empty(rows, num_codes, dtype=torch.uint8, device=packed.device)
    word_shift = torch.arange(32, device=packed.device, dtype=torch.int64)
    bit_weight = (1 << torch.arange(bits, device=packed.device, dtype=torch.int64))
    for lo, hi in _chunks(rows, nwords * 32):
        w = packed[lo:hi].to(torch.int64) & 0xFFFFFFFF
        stream = ((w.unsqueeze(-1) >> word_shift) & 1).reshape(hi - lo, nwords * 32)[:, : num_codes * bits]
        out[lo:hi] = (stream.reshape(hi - lo, num_codes, bits) * bit_weight).sum(-1).to(torch.uint8)
    return out
