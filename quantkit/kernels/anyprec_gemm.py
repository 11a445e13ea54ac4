"""Any-precision QuantLinear on CUDA: the bitplane matvec kernel for small batches, dequantize + cuBLAS
for large ones, any stored bit-width from the same buffers (kernels/anyprec*.cu / .cuh).

`forward(module, x)` is registered for format "anyprec" (quantkit.kernels.dispatch). It serves
`module.bits` (None = the parent width) as read at each call, so `QuantLinear.set_bits(k)`
switches the width at run time without a reload; the kernel reads the top k planes of the parent.

Two paths, chosen by the number of rows of x (all leading dims flattened):
  rows <= MATVEC_MAX_ROWS[...]: the matvec kernel, 8 rows per launch (the mma's N). It reads the
      planes in the kernel layout (`kernel_layout`, made once per device and cached on the module:
      one extra copy of the planes, n bits per weight);
  more rows, or fp32 input: the dequantize kernel writes the k-bit weight in x.dtype, then F.linear
      (cuBLAS). With module.cache_weight the weight is kept under QuantLinear's cache key
      (device, dtype, bits), as the reference path does.
The thresholds were measured with benchmarks/bench_anyprec_kernel.py on an H100 (see MATVEC_MAX_ROWS).
Which compiled instance serves a (shape, width, batch) on a GPU is `choose_variant`'s pick from the measured
table in quantkit/kernels/anyprec_variants.py (by the nearest measured shape; today's kernel wherever the
table says nothing).
On sm_90+ the matvec launches overlap the kernel before them (kernels/overlap.py): planes and tables
first, x after that kernel has ended; a module's first call with new planes or tables launches without
it (overlap.settled).

Functions here take plain tensors so tests and benchmarks can call each variant directly.
"""

import torch
import torch.nn.functional as F

from quantkit.kernels import anyprec_variants, build, overlap
from quantkit.kernels.dispatch import register

FLAG_LAYOUT, FLAG_IBT, FLAG_TLM = 1, 2, 4  # the paper's three optimisations, as in kernels/anyprec_bits.cuh
ALL_FLAGS = FLAG_LAYOUT | FLAG_IBT | FLAG_TLM
# variants of the shared-memory-table widths k >= 4 (kernels/anyprec_bits.cuh): tables of two rows per word,
# one more resident block per SM
FLAG_PAIR, FLAG_OCC = 8, 16
# the row-per-lane kernel of widths 4..8 (kernels/anyprec_rows.cuh): planes in the rows layout (rows_layout), its
# `tiles` = the blocks of a cluster that split a 64-row block's words (rows_split)
FLAG_ROWS = 32
# with FLAG_ROWS at 4 bits: tables of code pairs, one lookup per two weights (kernels/anyprec_rows.cuh)
FLAG_CODE_PAIRS = 64
ROWS_MAX_SPLIT = 8
MAX_BATCH = 8  # rows of x per matvec launch

# The instances a (width, batch) may be served by, by name: (flags, tiles), tiles None = choose_tiles.
# "today" is the kernel every width used before the variants; anyprec_variants.CHOICES names the others
# per shape class where a benchmark showed them faster (benchmarks/bench_anyprec_variants.py).
CANDIDATES = {
    "today": (ALL_FLAGS, None),
    "pair": (ALL_FLAGS | FLAG_PAIR, None),
    "pair_occ": (ALL_FLAGS | FLAG_PAIR | FLAG_OCC, None),
    "pair_t1": (ALL_FLAGS | FLAG_PAIR, 1),
    "pair_occ_t1": (ALL_FLAGS | FLAG_PAIR | FLAG_OCC, 1),
    "rows": (ALL_FLAGS | FLAG_ROWS, None),
    "rows_occ": (ALL_FLAGS | FLAG_ROWS | FLAG_OCC, None),
    "rows_s1": (ALL_FLAGS | FLAG_ROWS, 1),
    "rows_pairs": (ALL_FLAGS | FLAG_ROWS | FLAG_CODE_PAIRS, None),
    "rows_pairs_s1": (ALL_FLAGS | FLAG_ROWS | FLAG_CODE_PAIRS, 1),
    "rows_pairs_s2": (ALL_FLAGS | FLAG_ROWS | FLAG_CODE_PAIRS, 2),  # 2 resident blocks: a split shortens the last wave
}

# Largest number of rows of x served by the matvec kernel (ceil(rows / 8) launches) before
# dequantize + cuBLAS takes over: "cached" when QuantLinear already holds the dequantized weight
# for this (device, dtype, bits) (then only cuBLAS runs), "uncached" when it would have to be made.
# Chosen by bench_anyprec_kernel.py's switch-point table (4-bit, H100): the kernel wins up to 8 rows
# against a cached fp16 weight and up to 24 rows (11008x4096 and 28672x8192) against dequantize +
# cuBLAS; the smaller of each shape pair is kept.
MATVEC_MAX_ROWS = {"cached": 8, "uncached": 24}

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pi(q):
    """Natural column (within a 32-column word) of slot position q in the kernel layout."""
    return ((q >> 3) & 1) + 2 * ((q >> 2) & 1) + 4 * (q & 1) + 8 * ((q >> 1) & 1) + 16 * ((q >> 4) & 1)


def kernel_layout(planes: torch.Tensor) -> torch.Tensor:
    """The planes as the kernel's LAYOUT flag reads them: int32 [n, M, ceil(W/4)*4].

    Bit s of plane p's word w holds natural bit pi((s - p) mod 32) of the same word (pi as in
    kernels/anyprec_bits.cuh: pairs of adjacent columns share an fp16x2 register, a k-tile's 4 columns are
    contiguous in x; the rotation by p lets the kernel merge planes without shifts). Words are
    padded with zeros to a multiple of 4 for 16-byte loads. The same copy serves every width.
    """
    n, rows, words = planes.shape
    padded = -(-words // 4) * 4
    out = torch.zeros(n, rows, padded, dtype=torch.int32, device=planes.device)
    for p in range(n):
        # group the 32 bit moves of this plane by shift distance: one masked shift per distance
        moves = {}
        for s in range(32):
            t = _pi((s - p) % 32)
            moves[s - t] = moves.get(s - t, 0) | (1 << t)
        src = planes[p].to(torch.int64) & 0xFFFFFFFF
        dst = torch.zeros_like(src)
        for shift, mask in moves.items():
            part = src & mask
            dst |= (part << shift) if shift >= 0 else (part >> -shift)
        out[p, :, :words] = torch.where(dst >= 2**31, dst - 2**32, dst).to(torch.int32)
    return out


_PREMERGE_MASKS = [[((0x11111111 << ((p + q) % 32)) | (0x11111111 >> (32 - (p + q) % 32))) & 0xFFFFFFFF
                    for q in range(4)] for p in range(4)]


def _rows_sigma(q):
    """Natural column (within a 32-column word) of slot position q in the rows layout (kernels/anyprec_rows.cuh
    rows_sigma): merged word j = q % 8 takes columns c, c + 1, c + 4, c + 5 with c = 8 (j // 2) + 2 (j % 2)."""
    return ((q >> 3) & 1) + 2 * (q & 1) + 4 * ((q >> 4) & 1) + 8 * ((q >> 1) & 1) + 16 * ((q >> 2) & 1)


_PI_POSITION = {_pi(q): q for q in range(32)}


def _rows_relayout(words: torch.Tensor, p: int) -> torch.Tensor:
    """Kernel-layout words of plane p (bit s = column pi((s - p) mod 32)), int64 in [0, 2^32), with bit s holding
    column rows_sigma((s - p) mod 32) instead: one masked shift per shift distance."""
    moves = {}
    for s in range(32):
        t = (_PI_POSITION[_rows_sigma((s - p) % 32)] + p) % 32
        moves[s - t] = moves.get(s - t, 0) | (1 << t)
    out = torch.zeros_like(words)
    for shift, mask in moves.items():
        part = words & mask
        out |= (part << shift) if shift >= 0 else (part >> -shift)
    return out & 0xFFFFFFFF


def rows_layout(kplanes: torch.Tensor) -> torch.Tensor:
    """The planes as the row-per-lane kernel (FLAG_ROWS) reads them, from kernel_layout's:
    int32 [n, G, W', 32], G = 2 * ceil(M / 64), word w of row 32 * grp + l at [p, grp, w, l] (rows past M zero).

    Each word is kernel_layout's with its columns in the rows kernel's order: bit s of plane p holds column
    _rows_sigma((s - p) mod 32) (so the kernel's 16-byte x loads are its A fragments at batch 1-2). Planes 4..
    are stored as such; the top four (n >= 4 needed) are stored merged, slot p < 4 holding
    U_p = OR_q (plane q & rotl(0x11111111, p + q)), the bits of planes 0..3 that the kernel's merged words p and
    p + 4 take (kernels/anyprec_rows.cuh rows_premerged): every width 4..8 reads all four, so the kernel skips
    three selects per merged word. The same copy serves widths 4..n.
    """
    n, rows, words = kplanes.shape
    if n < 4:
        raise ValueError(f"rows_layout needs at least 4 planes, got {n}")
    groups = 2 * -(-rows // 64)
    src = torch.stack([_rows_relayout(kplanes[p].to(torch.int64) & 0xFFFFFFFF, p) for p in range(n)])
    merged = []
    for p in range(4):
        u = torch.zeros_like(src[0])
        for q in range(4):
            u |= src[q] & _PREMERGE_MASKS[p][q]
        merged.append(u)
    full = torch.cat([torch.stack(merged), src[4:]])
    full = torch.where(full >= 2**31, full - 2**32, full).to(torch.int32)
    out = torch.zeros(n, groups * 32, words, dtype=torch.int32, device=kplanes.device)
    out[:, :rows] = full
    return out.view(n, groups, 32, words).transpose(2, 3).contiguous()


def _rows_planes_of(kplanes: torch.Tensor, bits: int | None = None) -> tuple[torch.Tensor, bool]:
    """(rows_layout of kplanes' top planes, whether it was made by this call). Made once per buffer version and
    kept on the tensor itself (freed with it), with as many planes as the widest width served so far (at least 4;
    all of them when bits is None), so a module decoded at 4 bits keeps 4 bits per weight of it rather than the
    parent's n; a wider width later remakes it. Tensors made under torch.inference_mode track no version: theirs
    counts as 0."""
    version = 0 if kplanes.is_inference() else kplanes._version
    key = (kplanes.data_ptr(), version, tuple(kplanes.shape))
    needed = kplanes.shape[0] if bits is None else min(kplanes.shape[0], max(bits, 4))
    cached = getattr(kplanes, "_anyprec_rows_planes", None)
    if cached is not None and cached[0] == key and cached[1].shape[0] >= needed:
        return cached[1], False
    kplanes._anyprec_rows_planes = (key, rows_layout(kplanes[:needed]))
    return kplanes._anyprec_rows_planes[1], True


def prepared_planes(module) -> torch.Tensor:
    """module.planes in the kernel layout, made once per device and buffer version."""
    planes = module.planes
    key = (planes.device, planes.data_ptr(), planes._version, tuple(planes.shape))
    cached = getattr(module, "_anyprec_kernel_planes", None)
    if cached is None or cached[0] != key:
        cached = (key, kernel_layout(planes))
        module._anyprec_kernel_planes = cached
    return cached[1]


_sm_counts = {}


def _device_index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


def choose_tiles(bits, rows_out, batch, device, ext, flags=ALL_FLAGS):
    """16-row tiles per block. Every block reads all of x from L2: batch * in_features * 2 bytes
    against 16 * tiles * in_features * bits / 8 bytes of weights, so from batch 4 on x would
    outweigh the weights unless a block covers 2 tiles. At batch 1-2, 1 tile (twice the blocks)
    balances better. Two tiles only where an instance is built (today's kernel: k <= 6, its tables
    fit once from k = 7; FLAG_PAIR: k <= 7) and enough blocks fill the GPU twice.
    The benchmark's tiles table confirms it on the H100 (11008x4096, 4 bits: batch 1 21.1 vs 23.1 us,
    batch 8 42.1 vs 31.2 us for 1 vs 2 tiles)."""
    if batch < 4:
        return 1
    index = _device_index(device)
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    if -(-rows_out // 32) >= 2 * _sm_counts[index] and ext.has_matvec(torch.float16, bits, 2, flags):
        return 2
    return 1


def rows_split(rows_out, words, device):
    """Blocks (one thread-block cluster) that split each 64-row block's words in the row-per-lane kernel: 1 where
    the 64-row blocks alone fill every SM twice, else enough for that (at most ROWS_MAX_SPLIT), and never
    fewer than 16 words per block. Clusters need sm_90: 1 elsewhere."""
    index = _device_index(device)
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    if torch.cuda.get_device_capability(index)[0] < 9:
        return 1
    blocks = -(-rows_out // 64)
    split = -(-2 * _sm_counts[index] // blocks)
    return max(1, min(ROWS_MAX_SPLIT, split, words // 16))


_gpu_names = {}
_variant_cache = {}


def choose_variant(bits, rows_out, batch, device, dtype, ext, words=None):
    """(flags, tiles) of the instance serving `batch` rows of x at `bits` on `device`: the candidate
    anyprec_variants.CHOICES names for this GPU, the shape class of (rows_out, 32 * words), width and batch
    when it is built, else today's kernel (also when words, ceil(in_features / 32), is not given).
    words also bounds the row-per-lane kernel's split (rows_split)."""
    index = _device_index(device)
    key = (index, bits, rows_out, batch, dtype, words)
    chosen = _variant_cache.get(key)
    if chosen is None:
        if index not in _gpu_names:
            _gpu_names[index] = torch.cuda.get_device_name(index)
        name = "today" if words is None else anyprec_variants.choice(_gpu_names[index], bits, batch,
                                                                    rows_out, 32 * words)
        flags, tiles = CANDIDATES[name]
        if not ext.has_matvec(dtype, bits, 1, flags):
            flags, tiles = CANDIDATES["today"]
        if tiles is None:
            tiles = default_tiles(flags, bits, rows_out, words, batch, device, ext)
        chosen = _variant_cache[key] = (flags, tiles)
    return chosen


def default_tiles(flags, bits, rows_out, words, batch, device, ext):
    """`tiles` of an instance when the caller names none: the rows split for FLAG_ROWS, choose_tiles for the
    other kernels with all three optimisations, else 1."""
    if flags & FLAG_ROWS:
        return rows_split(rows_out, words if words is not None else 2**30, device)
    if (flags & ALL_FLAGS) == ALL_FLAGS:
        return choose_tiles(bits, rows_out, batch, device, ext, flags)
    return 1


def matvec(x2, planes, lut, bits, words, bias=None, *, flags=None, tiles=None, out=None, ext=None,
           overlapped=False):
    """y [rows, M] = x2 [rows, in_features] @ W_bits^T (+ bias), in x2.dtype (fp16 / bf16).

    planes: kernel_layout(...) when flags is None or has FLAG_LAYOUT, else the stored planes (their word count
    must then be a multiple of 4); for FLAG_ROWS rows_layout(...), or kernel_layout(...), whose rows layout is
    then made once and kept with it. lut: fp16 [M, 2^bits]. words = ceil(in_features / 32).
    flags None: the instance choose_variant picks for each launch's rows; tiles None: default_tiles.
    overlapped: launch with overlap (kernels/overlap.py; planes and lut must not be written by the
    kernels just before).
    """
    ext = ext or build.load("anyprec")
    rows, cols = x2.shape
    width = 32 * words
    if cols != width or not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = F.pad(x2, (0, width - cols)).contiguous()  # zero columns: padding codes meet zeros
    if out is None:
        out = torch.empty(rows, lut.shape[0], dtype=x2.dtype, device=x2.device)
    for start in range(0, rows, MAX_BATCH):
        batch = min(MAX_BATCH, rows - start)
        f, t = flags, tiles
        if f is None:
            f, auto_tiles = choose_variant(bits, lut.shape[0], batch, x2.device, x2.dtype, ext, words)
            t = auto_tiles if t is None else t
        elif t is None:
            t = default_tiles(f, bits, lut.shape[0], words, batch, x2.device, ext)
        p, fresh = planes, False
        if f & FLAG_ROWS and planes.dim() == 3:
            # a rows copy made (or remade wider) just now was written by the kernels right before: no overlap
            p, fresh = _rows_planes_of(planes, bits)
        ext.matvec(x2[start:start + MAX_BATCH], p, lut, bits, words, bias,
                   out[start:start + MAX_BATCH], f, t, overlapped and not fresh)
    return out


def dequantize(planes, lut, bits, in_features, dtype, *, out=None, ext=None):
    """The bits-wide weight [M, in_features] in dtype (fp16 / bf16 / fp32) from the stored planes."""
    ext = ext or build.load("anyprec")
    if out is None:
        out = torch.empty(planes.shape[1], in_features, dtype=dtype, device=planes.device)
    return ext.dequantize(planes, lut, bits, in_features, out)


def forward(module, x):
    """QuantLinear.forward on CUDA for any-precision tensors; None = use the reference path."""
    if x.dtype not in _DTYPES or x.shape[-1] != module.in_features:
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return None  # the kernels have no backward
    planes = module.planes
    if planes.device != x.device:
        return None
    bits = module.bits if module.bits is not None else module.meta["parent_bits"]
    lut = getattr(module, f"lut_{bits}", None)
    if lut is None or lut.dtype != torch.float16:
        return None
    ext = build.load("anyprec")
    if ext is None:
        return None
    rows_out, cols = module.out_features, module.in_features
    x2 = x.reshape(-1, cols)
    rows = x2.shape[0]
    if rows == 0:
        return x.new_empty(*x.shape[:-1], rows_out)
    bias = None if module.bias is None else module.bias.to(x.dtype)
    key = (x.device, x.dtype, module.bits)  # QuantLinear's cache key
    cached = module._cached[1] if module._cached is not None and module._cached[0] == key else None
    limit = MATVEC_MAX_ROWS["cached" if cached is not None else "uncached"]
    if x.dtype == torch.float32 or rows > limit:
        weight = cached
        if weight is None:
            weight = dequantize(planes, lut, bits, cols, x.dtype, ext=ext)
            if module.cache_weight:
                module._cached = (key, weight)
        return F.linear(x, weight, bias)
    words = -(-cols // 32)
    planes = prepared_planes(module)
    overlapped = overlap.enabled() and overlap.settled(module, planes, lut)
    y = matvec(x2, planes, lut, bits, words, bias, ext=ext, overlapped=overlapped)
    return y.reshape(*x.shape[:-1], rows_out)


register("anyprec", forward)
