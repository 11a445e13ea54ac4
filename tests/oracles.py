"""Plain PyTorch forms of what quantkit's kernels compute, which only the tests compare the kernels with.

decode_attention (runtime/decode_attention.py):
    attended_inputs(query, new_kv, dtype, rope, consume) -> the query and new key/value `decode` attends with
    decode_torch(query, keys, values, position, scale, new_kv, rope, consume) -> what `decode` returns and writes
"""

import torch

from quantkit.runtime.decode_attention import reference, write_kv


def attended_inputs(query, new_kv, dtype, rope=None, consume=False):
    """(query, (key, value) or None) as `decode` attends with them, in `dtype`: with consume, fp32 sums
    rounded as the matvec's fp16 output would be; with rope = (cos, sin), the query and key rotated as
    apply_rotary_pos_emb does, x * cos + rotate_half(x) * sin, in fp32 and rounded once."""

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


def decode_torch(query, keys, values, position, scale, new_kv=None, rope=None, consume=False):
    """What `decode` computes and writes (the new key and value into the cache, zeros into consumed sums),
    in PyTorch, on any device: the kernel's reference, and its stand-in on the CPU."""
    q, kv = attended_inputs(query, new_kv, keys.dtype, rope, consume)
    if kv is not None:
        write_kv(keys, values, kv[0], kv[1], position.reshape(-1)[:1].to(keys.device))
    if consume:
        for sums in (query, *new_kv):
            sums.zero_()
    return reference(q, keys, values, position, scale).to(keys.dtype)
