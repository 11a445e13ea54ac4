"""The fused GPTQ / k-OOC column loop on CUDA (kernels/gptq.cu) and the driver around it.

methods/gptq.py (gptq_quantize) and methods/ooc.py (ooc_gptq) call `gptq_columns` / `ooc_columns` when
their tensors are on CUDA; None back (kernel not built, disabled, unsupported dtype or setting) means they
run their PyTorch loop, which stays the reference and the fallback.

Units and tiles. A unit is one copy of W [k, d] being quantized: the GPTQ run, or one OOC candidate (k-OOC
sec. 3.3: "row parallel" over rows, "selection parallel" over candidates). All units share U, the upper
Cholesky factor of H⁻¹, so their rows are stacked into one work matrix [n·k, d] served by the same launches.
The columns are walked in tiles (tile_plan); per tile one kernel launch runs the column loop for every
active row and leaves the tile's errors E in a buffer, then one GEMM applies them to the columns after it,
    W[:, i2:] -= E @ U[i1:i2, i2:]        (addmm_, in place)
which is gptq_quantize's blocked loop with the same blocks (when g divides the block size or the block size
divides g) and the same arithmetic per op, so codes match the PyTorch loop up to floating-point ties.

Forking (OOC). A candidate is plain GPTQ(l) until its odd group starts: same weights, same updates. So the
candidates of a chunk fork from one shared GPTQ(l) unit, the base: a candidate becomes active at the start
of its odd group with the base's state copied in (weights from there on; codes, params and loss before),
and the base stops at the last fork. The lazy update costs ∝ (columns left)², so a chunk costs
1 − (1 − f_max)² + Σ_m (1 − f_m)² GPTQ runs instead of c (f_m = fraction of the columns before candidate
m's odd group): about c/3 + 1 for odd groups spread evenly. Used when the candidates share one W (ooc's
batch scan expands it) and the sum is smaller (fork_pays).

Memory plan (k-OOC sec. 3.4). Only the current layer is on the GPU (the engine moves one decoder layer at a
time). Candidates run in chunks of c units sized from the memory free right now (candidate_chunk):
    c = ⌊(F − t) / b⌋,   b = k·d·(e + 1) + k·e·(TILE + 2G + 3),   t = 4·k·d·e,
F = free device memory + memory cached by torch's allocator − a margin (max(512 MiB, 5 % of the card)),
e = bytes per element (4 for fp32), b = one unit: working weights (e per weight) and codes (1 byte), one
tile of errors (TILE·e per row), scales/zeros (2G·e) and the high-tier params and loss (3e); t = the
temporaries of turning one unit into the caller's outputs. ooc_columns returns what ooc_gptq returns
([c, k, d] codes and dequantized weights, allocated before F is read); ooc_stream hands the candidates over
one at a time instead, so a caller keeping only the probe losses and the winner (the paper's "selection
results are discarded") needs one chunk's memory, not c candidates' outputs. The paper's
c = (T/f − [kd + n(md + mk + kd + d + d²)]) / (n(1 + kd + 2mk + 2kd)) budgets the same W, H⁻¹ and per-
selection Wq, plus full k×d error matrices and probe inputs/outputs; here errors are one tile wide, the
probe loss is the caller's, and the budget is what is free, not the card's total.
"""

import contextlib

import torch

from quantkit.formats import uniform
from quantkit.kernels import build

TILE = 128  # widest tile the kernel holds in registers (kernels/gptq.cu TILE)
SAFETY_BYTES = 512 << 20
SAFETY_FRACTION = 0.05
THREADS_PER_ROW = (4, 8, 16, 32)
TARGET_THREADS = 64 * 1024  # enough resident warps per SM (8+ on a 132-SM H100) to hide the per-column latency

_enabled = True
launches = {"calls": 0, "tiles": 0}  # what ran through the kernel (tests and benchmarks read it)


@contextlib.contextmanager
def disabled():
    """Inside this block gptq_quantize and ooc_gptq run their PyTorch loops (the reference)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _module(t):
    """The compiled module for work on tensor t, or None (then the caller uses its PyTorch loop)."""
    return _compiled(t) if _enabled else None


def _compiled(t):
    """The built extension, for CUDA tensors of a dtype it serves."""
    if not t.is_cuda or t.dtype not in (torch.float32, torch.float64):
        return None
    return build.load("gptq")


def _empty(*size, dtype, device):
    """Every buffer the kernel writes is allocated here (uninitialised, as torch.empty)."""
    return torch.empty(*size, dtype=dtype, device=device)


def threads_per_row(rows):
    """Fewest threads per row that still give the chip ~TARGET_THREADS threads: fewer threads per row means
    less redundant per-column quantization work; more means more rows' worth of latency hidden. 4 is never
    chosen: its 32 register slots cost it half the resident blocks (kernels/gptq.cu min_blocks)."""
    for tpr in THREADS_PER_ROW[1:-1]:
        if rows * tpr >= TARGET_THREADS:
            return tpr
    return THREADS_PER_ROW[-1]


def tile_plan(d, g, block_size, cuts=()):
    """Tiles [(i1, i2)] covering columns [0, d): one at every multiple of min(block_size, TILE) and at every
    column in `cuts`; a group (dynamic groups: g given; None for static groups) that would start inside a tile
    and run past its end starts a tile instead, because the kernel reads columns past a tile only for a group
    that starts it (they carry every earlier update only then)."""
    step = max(1, min(block_size, TILE))
    starts = set(range(0, d, step)) | {c for c in cuts if 0 < c < d}
    if g is not None:
        bounds = sorted(starts) + [d]
        for a, b in zip(bounds, bounds[1:]):
            last = (b - 1) // g * g  # only the last group start inside a tile can cross its end
            if last > a and min(last + g, d) > b:
                starts.add(last)
    bounds = sorted(starts) + [d]
    return list(zip(bounds, bounds[1:]))


def fork_pays(fractions):
    """Whether forking c candidates from a base beats running each from column 0 (see the module notes);
    fractions: columns before each candidate's odd group / d."""
    if not fractions:
        return False
    base = 1 - (1 - max(fractions)) ** 2
    return base + sum((1 - f) ** 2 for f in fractions) < len(fractions) - 1e-9


def unit_bytes(k, d, groups, itemsize):
    """Device bytes one unit holds during a run (b in the module notes)."""
    return k * d * (itemsize + 1) + k * itemsize * (TILE + 2 * groups + 3)


def transient_bytes(k, d, itemsize):
    """t in the module notes."""
    return 4 * k * d * itemsize


def candidate_chunk(k, d, groups, itemsize, budget):
    """Units that fit in `budget` bytes at once (at least 1: a run never refuses to start)."""
    return max(1, int((budget - transient_bytes(k, d, itemsize)) // unit_bytes(k, d, groups, itemsize)))


def free_budget(device):
    """Bytes a run may take now: free device memory plus torch's cached blocks, less the safety margin."""
    if torch.device(device).type != "cuda":
        return 1 << 62  # the CPU emulator (tests): no device to fill
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached - max(SAFETY_BYTES, int(SAFETY_FRACTION * total))


class _Buffers:
    """The kernel's per-row outputs for n·k rows (see TileArgs in kernels/gptq.cu)."""

    def __init__(self, rows, d, groups, dtype, device, scales=None, zeros=None):
        f = dict(dtype=dtype, device=device)
        self.codes = _empty(rows, d, dtype=torch.uint8, device=device)
        self.err = _empty(rows, TILE, **f)
        self.scales = _empty(rows, groups, **f) if scales is None else scales
        self.zeros = _empty(rows, groups, **f) if zeros is None else zeros
        self.hscales = _empty(rows, **f)
        self.hzeros = _empty(rows, **f)
        self.loss = _empty(rows, **f)


def _fork(buf, work, k, src, dst, i1, g):
    """Unit dst takes unit src's state at column i1 (a group start, or d): the weights of the columns from
    i1 on, and the codes, group params and loss of the columns before."""
    a, b = slice(src * k, (src + 1) * k), slice(dst * k, (dst + 1) * k)
    work[b, i1:] = work[a, i1:]
    buf.codes[b, :i1] = buf.codes[a, :i1]
    j = -(-i1 // g)
    buf.scales[b, :j] = buf.scales[a, :j]
    buf.zeros[b, :j] = buf.zeros[a, :j]
    for t in (buf.hscales, buf.hzeros, buf.loss):
        t[b] = t[a]


def _walk(mod, work, u, buf, k, starts, stops, bits, g, sym, block_size, clear=None, high_bits=None,
          col_group=None, clip=False):
    """Run the tiles over the units of `work` [n·k, d] (unit m = rows m·k .. (m+1)·k − 1). Unit m is active
    on the tiles in [starts[m], stops[m]); a unit starting after column 0 forks from unit 0 there. The
    active units of every tile must be consecutive (callers order them by start)."""
    n, d = len(starts), work.shape[1]
    tiles = tile_plan(d, g if col_group is None else None, block_size, set(starts) | set(stops))
    for i1, i2 in tiles:
        for m in range(1, n):
            if starts[m] == i1 and i1 > 0:
                _fork(buf, work, k, 0, m, i1, g)
        active = [m for m in range(n) if starts[m] <= i1 < stops[m]]
        if not active:
            continue
        lo, hi = active[0], active[-1] + 1
        assert active == list(range(lo, hi)), f"active units {active} are not consecutive"
        r0, r1 = lo * k, hi * k
        mod.tile(work, u, buf.codes, buf.err, buf.scales, buf.zeros, buf.hscales, buf.hzeros, buf.loss, clear,
                 high_bits, col_group, r0, r1, k, i1, i2, g, bits, sym, clip, uniform.MIN_SCALE,
                 int(uniform.CLIP_MAX_SHRINK * uniform.CLIP_GRID), uniform.CLIP_GRID, uniform.CLIP_NORM,
                 threads_per_row(r1 - r0))
        launches["tiles"] += 1
        if i2 < d:  # the lazy update of everything after the tile: one GEMM (cuBLAS)
            lazy_update(work[r0:r1, i2:], buf.err[r0:r1, : i2 - i1], u, i1, i2)
    for m in range(1, n):  # a unit that never became active (starts at d) is unit 0's result
        if starts[m] >= d:
            _fork(buf, work, k, 0, m, d, g)


def lazy_update(dst, err, u, i1, i2):
    """dst -= err @ U[i1:i2, i2:] (dst = the columns after the tile): the addmm_ of the reference loop."""
    dst.addmm_(err, u[i1:i2, i2:], alpha=-1)


def _supported(bits, *more_bits):
    return all(isinstance(b, int) and 2 <= b <= 8 for b in (bits, *more_bits))


def gptq_columns(w, u, bits, g, sym, scales, zeros, codes, block_size=128, col_group=None, clip_search=False):
    """gptq_quantize's column loop on the GPU.

    w [k, d]: weights in processing order (act-order already applied); overwritten (scratch). u [d, d]: U.
    g: effective group size. Fills codes [k, d] (int64, processing order) and, with dynamic groups,
    scales/zeros [k, G]; with static groups col_group (list or tensor [d]: group of each processed column)
    picks from the given scales/zeros. clip_search applies to dynamic groups (static ones come clip-searched).
    Returns the loss Σ (w − q)²/U_cc²/2 as a 0-dim tensor, or None when the kernel cannot run (nothing written).
    """
    mod = _module(w)
    if mod is None or not _supported(bits) or not (scales.is_contiguous() and zeros.is_contiguous()):
        return None
    launches["calls"] += 1
    k, d = w.shape
    work = w if w.is_contiguous() else w.contiguous()
    u = u.contiguous()
    static = col_group is not None
    buf = _Buffers(k, d, scales.shape[1], w.dtype, w.device, scales, zeros)
    groups_t = torch.as_tensor(col_group, dtype=torch.int32).to(w.device) if static else None
    _walk(mod, work, u, buf, k, [0], [d], bits, g, sym, block_size, col_group=groups_t,
          clip=bool(clip_search) and not static)
    codes.copy_(buf.codes)
    return buf.loss.sum() / 2


def group_params(w, g, bits, sym, clip_search=False):
    """formats.uniform.grouped_uniform_params on the GPU, one kernel launch (kernels/gptq.cu): scales and zeros
    [k, G] of every column group of g of w [k, d] (the last may be shorter), clip-searched if asked. The same
    arithmetic op by op; only the clip search's sums run in another order, so a group whose best shrink is a
    near-tie may take the neighbouring one. None when the kernel cannot run (nothing computed)."""
    mod = _module(w)
    if mod is None or not _supported(bits):
        return None
    k, d = w.shape
    groups = uniform.num_groups(d, g)
    scales = _empty(k, groups, dtype=w.dtype, device=w.device)
    zeros = _empty(k, groups, dtype=w.dtype, device=w.device)
    mod.group_params(w.contiguous(), scales, zeros, min(g, d), bits, sym, bool(clip_search), uniform.MIN_SCALE,
                     int(uniform.CLIP_MAX_SHRINK * uniform.CLIP_GRID), uniform.CLIP_GRID, uniform.CLIP_NORM,
                     threads_per_row(k * groups))
    return scales, zeros


def ooc_columns(w, u, low_bits, high_bits, g, sym, clear_mask, block_size=128, budget=None, fork=None):
    """ooc_gptq on the GPU: the same arguments and results (codes [c, k, d] int64, scales and zeros
    [c, k, G], hscales and hzeros [c, k], dequantized weights [c, k, d]), or None when the kernel cannot run.
    budget and fork as in ooc_stream."""
    stream = ooc_stream(w, u, low_bits, high_bits, g, sym, clear_mask, block_size, budget, fork)
    if stream is None:
        return None
    c, k, d = w.shape
    groups = uniform.num_groups(d, g)
    f = dict(dtype=w.dtype, device=w.device)
    out = (_empty(c, k, d, dtype=torch.int64, device=w.device), _empty(c, k, groups, **f),
           _empty(c, k, groups, **f), _empty(c, k, **f), _empty(c, k, **f), _empty(c, k, d, **f))
    for m, *results in stream:  # the outputs exist before the stream sizes its chunks from free memory
        for dst, src in zip(out, results):
            dst[m] = src
    return out


def ooc_stream(w, u, low_bits, high_bits, g, sym, clear_mask, block_size=128, budget=None, fork=None):
    """The OOC candidates on the GPU, one at a time: an iterator of (m, codes [k, d] uint8, scales and zeros
    [k, G], hscales and hzeros [k], dequantized weights [k, d]) for every candidate m of ooc_gptq's arguments,
    chunk by chunk (in order of their odd groups), each chunk's buffers freed before the next is built; or
    None when the kernel cannot run. A caller that keeps only what it needs (k-OOC: per-row probe losses and
    the best candidate, sec. 3.3) never holds all candidates' results at once.

    budget: device bytes the working set may take (default: free_budget when iteration starts). fork: force
    forking on (True) or off (False); by default it is used when the candidates share W and fork_pays.
    """
    mod = _module(w)
    if mod is None or not _supported(low_bits, high_bits):
        return None
    launches["calls"] += 1
    return _stream_chunks(mod, w, u.contiguous(), low_bits, high_bits, g, sym, clear_mask, block_size, budget, fork)


def _stream_chunks(mod, w, u, low_bits, high_bits, g, sym, clear_mask, block_size, budget, fork):
    c, k, d = w.shape
    groups = uniform.num_groups(d, g)
    shared = c == 1 or w.stride(0) == 0  # every candidate starts from the same W
    has_clear = clear_mask.any(dim=1)
    first = clear_mask.to(torch.uint8).argmax(dim=1)
    starts = torch.where(has_clear, first // g * g, torch.full_like(first, d)).tolist()  # odd group's start
    order = sorted(range(c), key=lambda m: starts[m])
    cap = candidate_chunk(k, d, groups, w.element_size(), free_budget(w.device) if budget is None else budget)
    pos = 0
    while pos < c:
        take = order[pos : pos + cap]
        use_fork = shared and cap >= 2 and (fork if fork is not None else fork_pays([starts[m] / d for m in take]))
        if use_fork and len(take) == cap:
            take = take[:-1]  # the base takes one unit of the chunk
        yield from _run_chunk(mod, w, u, take, starts, use_fork, low_bits, high_bits, g, sym, clear_mask,
                              block_size)
        pos += len(take)


def _run_chunk(mod, w, u, take, starts, use_fork, low_bits, high_bits, g, sym, clear_mask, block_size):
    c, k, d = w.shape
    dtype, device = w.dtype, w.device
    groups = uniform.num_groups(d, g)
    first_cand = 1 if use_fork else 0
    n = len(take) + first_cand
    work = _empty(n * k, d, dtype=dtype, device=device)
    clear = torch.zeros(n, d, dtype=torch.uint8, device=device)
    clear[first_cand:] = clear_mask[take].to(torch.uint8)
    if use_fork:  # unit 0 = the GPTQ(l) base, up to the last fork; candidates in order of their odd group
        unit_starts = [0] + [starts[m] for m in take]
        unit_stops = [max(unit_starts[1:])] + [d] * len(take)
        for m, start in enumerate(unit_starts):
            if start == 0:
                work[m * k : (m + 1) * k] = w[0]
    else:
        unit_starts, unit_stops = [0] * n, [d] * n
        for m, cand in enumerate(take):
            work[m * k : (m + 1) * k] = w[cand]
    buf = _Buffers(n * k, d, groups, dtype, device)
    high = torch.full((n,), high_bits, dtype=torch.int32, device=device)
    _walk(mod, work, u, buf, k, unit_starts, unit_stops, low_bits, g, sym, block_size, clear, high)
    del work
    group_of = torch.arange(d, device=device) // g
    for m, cand in enumerate(take):
        rows = slice((m + first_cand) * k, (m + first_cand + 1) * k)
        # ooc_gptq's dq: (q - z) * s with each column's tier params, in the working dtype
        is_clear = clear_mask[cand][None, :]
        s = torch.where(is_clear, buf.hscales[rows, None], buf.scales[rows][:, group_of])
        z = torch.where(is_clear, buf.hzeros[rows, None], buf.zeros[rows][:, group_of])
        dq = (buf.codes[rows].to(dtype) - z) * s
        yield cand, buf.codes[rows], buf.scales[rows], buf.zeros[rows], buf.hscales[rows], buf.hzeros[rows], dq


def gptq_flops(k, d, units=1):
    """Multiply-adds × 2 of the error updates of one GPTQ run: column i updates the d − i − 1 columns after
    it in every row, Σ = d(d − 1)/2 per row: the arithmetic floor the benchmark compares against."""
    return 2 * units * k * (d * (d - 1) // 2)


def ooc_work_units(fractions, fork=True):
    """GPTQ-run equivalents of the lazy-update work of a candidate scan (module notes, forking)."""
    if not fork or not fork_pays(fractions):
        return float(len(fractions))
    return 1 - (1 - max(fractions)) ** 2 + sum((1 - f) ** 2 for f in fractions)

