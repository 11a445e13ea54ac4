"""Plain PyTorch forms of what quantkit's kernels compute, which only the tests compare the kernels with.

decode_attention (runtime/decode_attention.py):
    attended_inputs(query, new_kv, dtype, rope, consume) -> the query and new key/value `decode` attends with
    decode_torch(query, keys, values, positions, scale, new_kv, rope, consume) -> what `decode` returns and writes
"""

import torch
import torch.nn.functional as F


def attended_inputs(query, new_kv, dtype, rope=None, consume=False):
    """(query, (key, value) or None) as `decode` attends with them, in `dtype`: with consume, fp32 sums
    rounded as the matvec's fp16 output would be; with rope = (cos, sin) rows [B, D] of each row's position,
    the query and key rotated, x * cos + rotate_half(x) * sin, in fp32 and rounded once."""

    def finish(t):
        return (t.to(torch.float16) if consume else t).to(dtype)

    def rotate(t):
        cos, sin = (r.float().reshape(r.shape[0], 1, 1, r.shape[-1]) for r in rope)
        half = t.shape[-1] // 2
        t = t.float()
        return (t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin).to(dtype)

    query = finish(query)
    new_kv = None if new_kv is None else tuple(finish(t) for t in new_kv)
    if rope is not None:
        query = rotate(query)
        new_kv = None if new_kv is None else (rotate(new_kv[0]), new_kv[1])
    return query, new_kv


def attend_rows(query, keys, values, positions, scale):
    """Each row's attention over its cache positions 0..positions[b], one row at a time with SDPA on the
    slice (no mask): [B, 1, H, D] in fp32."""
    group = query.shape[1] // keys.shape[1]
    out = []
    for b, last in enumerate(positions.reshape(-1).expand(query.shape[0]).tolist()):
        k = keys[b : b + 1, :, : last + 1].float().repeat_interleave(group, dim=1)
        v = values[b : b + 1, :, : last + 1].float().repeat_interleave(group, dim=1)
        out.append(F.scaled_dot_product_attention(query[b : b + 1].float(), k, v, scale=scale))
    return torch.cat(out).transpose(1, 2)


def decode_torch(query, keys, values, positions, scale, new_kv=None, rope=None, consume=False):
    """What `decode` computes and writes (the new key and value into the cache at each row's position, zeros
    into consumed sums), row by row in PyTorch; rope = (cos, sin) tables [L, D]."""
    last = positions.reshape(-1).expand(query.shape[0])
    rows = None if rope is None else tuple(t[last] for t in rope)
    q, kv = attended_inputs(query, new_kv, keys.dtype, rows, consume)
    if kv is not None:
        for b, p in enumerate(last.tolist()):
            keys[b, :, p] = kv[0][b, :, 0]
            values[b, :, p] = kv[1][b, :, 0]
    if consume:
        for sums in (query, *new_kv):
            sums.zero_()
    return attend_rows(q, keys, values, last, scale).to(keys.dtype)
