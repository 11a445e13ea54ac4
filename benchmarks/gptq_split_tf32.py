"""3xTF32 lazy updates for the fused GPTQ driver (kernels/gptq_cuda.py), as bench_gptq_kernel.py compares them.

The driver applies each tile's errors to the columns after it with one fp32 GEMM, W[:, i2:] -= E @ U[i1:i2, i2:]
(gptq_cuda.lazy_update). Inside `split_updates()` that GEMM runs on the TF32 tensor cores instead, on split
operands: t = hi + lo with hi exactly representable in TF32, and

    E @ U ≈ [E_hi, E_hi, E_lo] @ [U_hi; U_lo; U_hi]      (one GEMM of K = 3·(i2 − i1); E_lo·U_lo left out)

which rounds ~2⁻²¹ relative against fp32's 2⁻²⁴. The update streams all of W once per tile either way; the
split makes its arithmetic cheaper than that traffic on wide layers, and its rounding flips ties that GPTQ's
error feedback carries on, so the product keeps the fp32 GEMM (RESULTS.md, GPTQ kernel).
"""

import contextlib

import torch

from quantkit.kernels import gptq_cuda

SPLIT_TILES = 5  # per unit: the [rows, 3·TILE] operand and the split halves of E, in tiles of TILE columns


def tf32_split(t):
    """t = hi + lo with hi exactly representable in TF32 (10 explicit mantissa bits, rounded to nearest)."""
    hi = (t.view(torch.int32) + 0x1000).bitwise_and_(-0x2000).view(torch.float32)
    return hi, t - hi


class _SplitU:
    """U's TF32 halves, made once per U (the driver passes the same U to every tile of a walk), and the
    [rows, 3·TILE] operand buffer the tiles reuse."""

    def __init__(self):
        self.key, self.hi, self.lo, self.a = None, None, None, None

    def operands(self, u, rows):
        key = (u.data_ptr(), tuple(u.shape), u._version)
        if key != self.key:
            self.key = key
            self.hi, self.lo = tf32_split(u)
        if self.a is None or self.a.shape[0] < rows or self.a.device != u.device:
            self.a = torch.empty(rows, 3 * gptq_cuda.TILE, dtype=u.dtype, device=u.device)
        return self.hi, self.lo, self.a


def _split_lazy_update(plain, split_u, dst, err, u, i1, i2):
    if not (u.is_cuda and u.dtype == torch.float32):
        return plain(dst, err, u, i1, i2)  # fp64 (and the CPU emulator): the reference GEMM
    rows, w = err.shape
    hi, lo, buffer = split_u.operands(u, rows)
    a = buffer[:rows, : 3 * w].view(rows, 3, w)
    e_hi, e_lo = tf32_split(err)
    a[:, 0] = e_hi
    a[:, 1] = e_hi
    a[:, 2] = e_lo
    a = a.view(rows, 3 * w)
    b = torch.cat([hi[i1:i2, i2:], lo[i1:i2, i2:], hi[i1:i2, i2:]], dim=0)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        dst.addmm_(a, b, alpha=-1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@contextlib.contextmanager
def split_updates():
    """Inside: the fp32 lazy updates of gptq_columns / ooc_stream run as 3xTF32, and the memory plan counts
    the split operands (SPLIT_TILES per unit, U's two halves once)."""
    saved = gptq_cuda.lazy_update, gptq_cuda.unit_bytes, gptq_cuda.transient_bytes
    plain, unit_bytes, transient_bytes = saved
    split_u = _SplitU()

    def split_unit_bytes(k, d, groups, itemsize):
        return unit_bytes(k, d, groups, itemsize) + (
            k * itemsize * SPLIT_TILES * gptq_cuda.TILE if itemsize == 4 else 0)

    def split_transient_bytes(k, d, itemsize):
        return transient_bytes(k, d, itemsize) + (2 * d * d * itemsize if itemsize == 4 else 0)

    gptq_cuda.lazy_update = lambda *args: _split_lazy_update(plain, split_u, *args)
    gptq_cuda.unit_bytes, gptq_cuda.transient_bytes = split_unit_bytes, split_transient_bytes
    try:
        yield
    finally:
        gptq_cuda.lazy_update, gptq_cuda.unit_bytes, gptq_cuda.transient_bytes = saved
