"""Attention for one decode step over a static KV cache, split over the cache (flash-decoding), in Triton.

In a decode step each sequence has one query token. A plain SDPA call reads all max_len positions of a
static cache under an additive mask, and its kernels give each (sequence, head) one thread block: 32
blocks for Llama-2-7B on a 132-SM H100, each streaming its head's whole cache, 8.2 µs a layer at 256
cached positions and 11.5 µs at 1152. Here the cache of each (sequence, head) is cut into chunks of
CHUNK positions, one program per chunk: it computes its chunk's softmax statistics (max, sum) and
weighted value sum in fp32, skipping positions past its row's current one (read nowhere, not masked
after reading), and the last of a head's programs to finish (a counter per head) merges the chunks, so
one launch does it all. Each row's position comes from a device tensor, so one CUDA-graph step serves
every position, and rows of a batch may stand at different positions (prompts of different lengths).
The step's own key and value come with the call: the kernel attends to them and writes them into the
cache. With rope tables, it also rotates the query and the new key (x·cos + rotate_half(x)·sin, fp32,
rounded once) at the row's position; with consume, q/k/v are a stacked matvec's fp32 sums, which it
rounds as the matvec's fp16 output would be and clears.

runtime.model calls it through the custom operator quantkit::decode_attention (runtime/ops.py), which
takes `reference_step` where the kernel does not serve (no Triton, the CPU, caches over 8192 positions).
"""

import torch
import torch.nn.functional as F

from quantkit.kernels import overlap
from quantkit.runtime.triton_kernel import lazy_kernel, runs_on

CHUNK = 64  # cache positions per program: 4 chunks x 32 heads = 128 programs at 256 positions
# warps per program: measured against 4 and 8 (benchmarks/sweep_decode_attention.py), as fast or faster
# from 256 to 4096 cached positions
NUM_WARPS = 2
MAX_HEAD_DIM = 256
# the merging program holds every chunk's partial result in registers: beyond this many chunks (8192
# cached positions) the reference serves the step instead. Each cache length compiles its own kernel
# (SPLITS is a compile-time constant), once per process.
MAX_SPLITS = 128
# with overlap, a call whose cache no running kernel writes (`cache_settled`) loads its chunk of cached keys and
# values, its row's position and rope angles before it waits for the previous kernel, so those reads hide under
# that kernel's tail; False: every read after the wait (for A/B measurements: benchmarks/bench_decode_switch.py)
READ_CACHE_BEFORE_WAIT = True


def row_positions(positions, batch):
    """positions as a [batch] view: one element (every row at that position) or one per row."""
    flat = positions.reshape(-1)
    if flat.numel() not in (1, batch):
        raise ValueError(f"{flat.numel()} positions for {batch} rows (give one, or one per row)")
    return flat.expand(batch)


def reference(query, keys, values, positions, scale):
    """query [B, H, 1, D], keys/values [B, Hkv, L, D] (H a multiple of Hkv), positions: integer tensor of
    one or B elements, each row's last cache position to attend -> [B, 1, H, D] in fp32 (SDPA over the
    attended positions, masked; no value is read back to the host, so a CUDA graph can hold it)."""
    b, length = query.shape[0], keys.shape[2]
    last = row_positions(positions, b).to(keys.device)
    group = query.shape[1] // keys.shape[1]
    # positions past a row's own are masked, and zeroed (a NaN there would survive the mask's zero weight)
    keep = torch.arange(length, device=keys.device)[None, :] <= last[:, None]  # [B, L]
    k = torch.where(keep[:, None, :, None], keys.float(), 0.0).repeat_interleave(group, dim=1)
    v = torch.where(keep[:, None, :, None], values.float(), 0.0).repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(query.float(), k, v, attn_mask=keep[:, None, None, :],
                                          scale=scale).transpose(1, 2)


def write_kv(keys, values, key_states, value_states, positions):
    """Put each row's key and value [B, Hkv, 1, D] into the cache [B, Hkv, L, D] at its position (one
    or B integer elements on the cache's device)."""
    b, kv_heads, _, d = key_states.shape
    index = row_positions(positions, b).view(b, 1, 1, 1).expand(b, kv_heads, 1, d)
    keys.scatter_(2, index, key_states.to(keys.dtype))
    values.scatter_(2, index, value_states.to(values.dtype))


@lazy_kernel
def _kernel(triton, tl):
    """The attention kernel, compiled by Triton on first launch."""

    global _head_vector  # a jit function finds the jit functions it calls among its module's globals

    @triton.jit
    def _head_vector(ptr, d, swap, sign, cos, sin, mask, like_ptr, ROPE: tl.constexpr, CONSUME: tl.constexpr):
        """One head's query, key or value as attention uses it, in like_ptr's dtype: with CONSUME read
        from a matvec's fp32 sums and rounded as its fp16 output would be; with ROPE rotated as
        x * cos + rotate_half(x) * sin in fp32, rounded once."""
        dtype = like_ptr.dtype.element_ty
        x = tl.load(ptr + d, mask=mask, other=0.0)
        if CONSUME:
            x = x.to(tl.float16)
        x = x.to(dtype)
        if ROPE:
            partner = tl.load(ptr + swap, mask=mask, other=0.0)
            if CONSUME:
                partner = partner.to(tl.float16)
            partner = partner.to(dtype).to(tl.float32)
            x = (x.to(tl.float32) * cos + sign * partner * sin).to(dtype)
        return x

    @triton.jit
    def attend_kernel(q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, pos_ptr, part_ptr, count_ptr,
                      kv_count_ptr, out_ptr, q_sb, q_sh, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, kn_sb, kn_sh, vn_sb,
                      vn_sh, cs_sn, pos_sb, qk_scale, length,
                      H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                      SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr, HAS_NEW: tl.constexpr,
                      ROPE: tl.constexpr, CONSUME: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr):
        if GDC:  # overlap (kernels/overlap.py): let the next kernel be scheduled, wait for the previous
            tl.extra.cuda.gdc_launch_dependents()
            if not EARLY:  # EARLY: only after the reads of what no running kernel writes (below)
                tl.extra.cuda.gdc_wait()
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H
        h = bh % H
        kv_head = h // GROUP
        last = tl.load(pos_ptr + b * pos_sb)  # this row's position (pos_sb = 0: one for all rows)
        d = tl.arange(0, D)
        n = split * CHUNK + tl.arange(0, CHUNK)
        # with HAS_NEW the current position's key and value come from kn/vn, not the cache
        live = ((n < last) if HAS_NEW else (n <= last)) & (n < length)
        # keys and values are both loaded before any arithmetic, so their reads overlap
        k = tl.load(k_ptr + b * k_sb + kv_head * k_sh + n[:, None] * k_sn + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + b * v_sb + kv_head * v_sh + n[:, None] * v_sn + d[None, :], mask=live[:, None], other=0.0)
        swap = (d + D // 2) % D  # rotate_half: element d pairs with d ± D/2, negated in the first half
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = sign  # placeholders without ROPE (Triton wants the names bound on every path)
        sin = sign
        if ROPE:
            cos = tl.load(cos_ptr + last * cs_sn + d).to(tl.float32)  # the tables' row of the position
            sin = tl.load(sin_ptr + last * cs_sn + d).to(tl.float32)
        if GDC and EARLY:  # the query and the new key and value come from the kernel before
            tl.extra.cuda.gdc_wait()
        everywhere = d < D
        q = _head_vector(q_ptr + b * q_sb + h * q_sh, d, swap, sign, cos, sin, everywhere, k_ptr, ROPE, CONSUME)
        # qk_scale carries log2(e): the softmax is in base 2
        q = q.to(tl.float32) * qk_scale
        s = tl.where(live, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
        m = tl.max(s, axis=0)
        if HAS_NEW:  # one more score, only in the chunk that holds the position (elsewhere -inf, weight 0)
            holds = (split == last // CHUNK) & (last < length)
            fetch = d < tl.where(holds, D, 0)  # a boolean vector (Triton 3.9's interpreter rejects scalar & vector)
            k_new = _head_vector(kn_ptr + b * kn_sb + kv_head * kn_sh, d, swap, sign, cos, sin, fetch, k_ptr,
                                ROPE, CONSUME)
            v_new = _head_vector(vn_ptr + b * vn_sb + kv_head * vn_sh, d, swap, sign, cos, sin, fetch, k_ptr,
                                False, CONSUME)
            s_new = tl.where(holds, tl.sum(k_new.to(tl.float32) * q, axis=0), float("-inf"))
            m = tl.maximum(m, s_new)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # an empty chunk: weights 0, not NaN
        p = tl.exp2(s - m_safe)
        acc = tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        total = tl.sum(p, axis=0)
        if HAS_NEW:
            p_new = tl.exp2(s_new - m_safe)
            acc += p_new * v_new.to(tl.float32)
            total += p_new
            # written once per KV head, by the chunk that holds the position: no program of this launch
            # reads that cache row, so the write races with nothing
            if holds & (h % GROUP == 0):
                tl.store(k_ptr + b * k_sb + kv_head * k_sh + last * k_sn + d, k_new)
                tl.store(v_ptr + b * v_sb + kv_head * v_sh + last * v_sn + d, v_new)
        # this chunk's partial result: [acc (D), max, sum] at its slot
        row = part_ptr + (bh * SPLITS + split) * (D + 2)
        tl.store(row + d, acc)
        tl.store(row + D, m)
        tl.store(row + D + 1, total)
        # the head's last chunk to finish merges them all: the barrier puts every thread's stores before
        # the counter's release (acq_rel, GPU scope); the merge reads through L2 (.cg), as L1 may hold
        # an earlier call's partials
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            sp = tl.arange(0, SPLITS_POW2)
            used = sp < SPLITS
            rows = part_ptr + (bh * SPLITS + sp) * (D + 2)
            ms = tl.load(rows + D, mask=used, other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(rows + D + 1, mask=used, other=0.0, cache_modifier=".cg")
            accs = tl.load(rows[:, None] + d[None, :], mask=used[:, None], other=0.0, cache_modifier=".cg")
            w = tl.exp2(ms - tl.max(ms, axis=0))  # chunk 0 holds position 0: the max is finite; empty chunks 0
            out = tl.sum(w[:, None] * accs, axis=0) / tl.sum(w * ls, axis=0)
            tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty))
            tl.store(count_ptr + bh, 0)  # zero again for the next call
            if CONSUME:
                # Every program of this head has read its query (before its release above): clear it.
                # The head's key and value were read by one program of each head of its KV group: the
                # group's last merge (a second counter) clears them.
                zero = tl.zeros([D], tl.float32)
                tl.store(q_ptr + b * q_sb + h * q_sh + d, zero)
                group_done = GROUP - 1
                if GROUP > 1:
                    group_done = tl.atomic_add(kv_count_ptr + b * (H // GROUP) + kv_head, 1, sem="acq_rel", scope="gpu")
                if group_done == GROUP - 1:
                    tl.store(kn_ptr + b * kn_sb + kv_head * kn_sh + d, zero)
                    tl.store(vn_ptr + b * vn_sb + kv_head * vn_sh + d, zero)
                    if GROUP > 1:
                        tl.store(kv_count_ptr + b * (H // GROUP) + kv_head, 0)

    return attend_kernel


def available():
    """Whether Triton is importable (the kernels compile on first launch)."""
    return _kernel() is not None


def supported(query, keys, values, consume=False):
    """Whether `decode` can serve this call (else `reference_step`); consume: the query is a matvec's fp32
    sums (see `decode`)."""
    b, h, q_len, d = query.shape
    return (q_len == 1 and runs_on(query) and available()
            and keys.dtype in (torch.float16, torch.bfloat16) and keys.dtype == values.dtype
            and query.dtype == (torch.float32 if consume else keys.dtype)
            and keys.shape[0] == b and h % keys.shape[1] == 0 and keys.shape[-1] == d and values.shape == keys.shape
            and d <= MAX_HEAD_DIM and d & (d - 1) == 0 and keys.shape[2] <= CHUNK * MAX_SPLITS
            and query.stride(-1) == keys.stride(-1) == values.stride(-1) == 1)


def new_kv_fits(new_kv, keys, consume=False):
    """Whether (key, value) can be the `new_kv` of a call on this cache (fp32 sums with consume)."""
    b, kv_heads, _, d = keys.shape
    dtype = torch.float32 if consume else keys.dtype
    return all(t.shape == (b, kv_heads, 1, d) and t.dtype == dtype and t.device == keys.device
               and t.stride(-1) == 1 for t in new_kv)


def rope_fits(rope, keys):
    """Whether (cos, sin) can be the `rope` of a call on this cache: tables [L', D] in the cache's dtype
    with a row for every cache position, one layout, unit stride along D."""
    cos, sin = rope
    return (cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] >= keys.shape[2]
            and cos.shape[1] == keys.shape[-1] and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.dtype == sin.dtype == keys.dtype and cos.device == sin.device == keys.device)


def counters(batch, heads, device):
    """The zeroed counters `decode` needs (it leaves them zero), per head and per KV head: make them once,
    outside any CUDA-graph capture, and use them from one stream at a time."""
    return torch.zeros(2 * batch * heads, dtype=torch.int32, device=device)


def rotate(x, cos, sin):
    """x [B, heads, 1, D] rotated by the rows (cos, sin) [B, D] as the kernel does: fp32, rounded once."""
    half = x.shape[-1] // 2
    xf = x.float()
    cos, sin = (t.float()[:, None, None, :] for t in (cos, sin))
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)


def reference_step(query, keys, values, positions, scale, new_kv, rope=None, consume=False):
    """What `decode` computes and writes, in PyTorch, on any device (the path where the kernel does not
    serve): the query and new key/value finished (consume: the matvec's fp16 rounding, then the cache's
    dtype) and rotated (rope tables at each row's position), the new key and value written into the
    cache, consumed sums cleared -> [B, 1, H, D] in the cache's dtype."""
    dtype = keys.dtype
    b = query.shape[0]
    q, k, v = ((t.to(torch.float16) if consume else t).to(dtype) for t in (query, *new_kv))
    last = row_positions(positions, b).to(keys.device)
    if rope is not None:
        cos, sin = (t.index_select(0, last) for t in rope)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    write_kv(keys, values, k, v, last)
    if consume:
        for sums in (query, *new_kv):
            sums.zero_()
    return reference(q, keys, values, last, scale).to(dtype)


def decode(query, keys, values, positions, scale, head_counters=None, new_kv=None, rope=None, consume=False,
           cache_settled=False, chunk=CHUNK, num_warps=NUM_WARPS):
    """query [B, H, 1, D], keys/values [B, Hkv, L, D] (CUDA, fp16/bf16, unit stride along D), positions: a
    CUDA integer tensor of one element (every row) or B (one per row), each row's last cache position to
    attend (0-based; later positions are not read) -> [B, 1, H, D] in the cache's dtype.
    head_counters: from `counters(B, H)` (None: fresh ones, one memset more). new_kv: (key, value)
    [B, Hkv, 1, D] of each row's position itself, written into the cache by this call (None: already
    there). rope: (cos, sin) tables [L', D] (L' >= L, row p = the angles of position p, the cache's dtype):
    the query and new key are not rotated yet, and the call rotates them (the key before it goes into
    the cache). consume: the query and new key and value are views into a matvec's fp32 sums (the stacked
    q/k/v projection's QuantLinear.accumulate), rounded as its fp16 output would be, and zeroed by this
    call. cache_settled: no kernel that may still be running when this one is launched writes the cache, the
    positions or the rope tables (in a decode step each layer's cache is written only by its own attention,
    and steps are separated by kernels launched without overlap), so with overlap the kernel reads them
    before waiting for the previous kernel (READ_CACHE_BEFORE_WAIT). chunk (a power of 2) and num_warps:
    the work split, for measuring others than the defaults."""
    b, h, _, d = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if head_counters is None:
        head_counters = counters(b, h, query.device)
    if head_counters.numel() < 2 * b * h:
        raise ValueError(f"{head_counters.numel()} attention counters for {b * h} heads (make them with counters())")
    if new_kv is not None and not new_kv_fits(new_kv, keys, consume):
        raise ValueError("new key/value must be [B, Hkv, 1, D], unit stride along D, in the cache's dtype "
                         "(fp32 sums with consume)")
    if consume and new_kv is None:
        raise ValueError("consume needs the new key and value: they are sums to clear too")
    if rope is not None and not rope_fits(rope, keys):
        raise ValueError("rope must be (cos, sin) tables [L', D], L' >= the cache length, in the cache's dtype")
    positions = positions.reshape(-1)
    if positions.numel() not in (1, b):
        raise ValueError(f"{positions.numel()} positions for {b} rows (give one, or one per row)")
    k_new, v_new = new_kv if new_kv is not None else (keys, values)  # unused pointers when None
    cos, sin = rope if rope is not None else (keys, keys)
    splits = -(-length // chunk)
    partials = torch.empty(b * h * splits, d + 2, dtype=torch.float32, device=query.device)
    out = torch.empty(b, 1, h, d, dtype=keys.dtype, device=query.device)
    log2e = 1.4426950408889634
    _kernel()[(b * h, splits)](
        query, keys, values, k_new, v_new, cos, sin, positions, partials, head_counters, head_counters[b * h :], out,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), cos.stride(0) if rope is not None else 0,
        0 if positions.numel() == 1 else positions.stride(0), scale * log2e, length,
        H=h, GROUP=h // kv_heads, D=d, CHUNK=chunk, SPLITS=splits,
        SPLITS_POW2=max(2, 1 << (splits - 1).bit_length()), HAS_NEW=new_kv is not None,
        ROPE=rope is not None, CONSUME=consume, EARLY=cache_settled and READ_CACHE_BEFORE_WAIT, num_warps=num_warps,
        **overlap.triton_launch(query.device))
    return out
