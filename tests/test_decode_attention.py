"""The split-cache decode attention (runtime.decode_attention): the Triton kernels against row-by-row
SDPA (tests/oracles.py), on CUDA and, without a GPU, through Triton's interpreter (the same kernel code on
the CPU); the product's PyTorch path (`reference`, `reference_step`, taken where the kernel does not
serve) against the same oracle.

Rows of a batch stand at different positions (row r at `last - 5r`), as prompts of different lengths do.
Cache positions past a row's own hold NaN: the kernels must not read them (a read NaN would survive any
mask), so each case also checks that nothing past the position leaks in. One set of head counters serves
all the cases in turn, as one serves every layer of a decode step: a call that did not leave them zero
would make the next merge early or never.
"""

import pytest
import torch

from oracles import attend_rows, attended_inputs, decode_torch
from quantkit.runtime import decode_attention as da

# (batch, heads, kv heads, cache length, head dim, last attended position of row 0; row r: last - 5r)
CASES = [
    (1, 4, 4, 256, 128, 100),  # Llama-2-7B head size, one chunk partly used
    (2, 6, 2, 200, 64, 199),  # GQA, the cache's last position, a length not a multiple of the chunk
    (1, 2, 1, 64, 64, 0),  # only position 0
    (1, 3, 3, 130, 32, 63),  # the last position of a chunk
    (3, 3, 3, 130, 32, 66),  # rows at the first position of the next chunk, and in the chunk before
]


def _positions(batch, last, device="cpu"):
    return torch.tensor([max(last - 5 * r, 0) for r in range(batch)], device=device)


def _case(batch, heads, kv_heads, length, dim, last, dtype=torch.float16, device="cpu"):
    g = torch.Generator().manual_seed(length * 31 + last)
    query = torch.randn(batch, 1, heads, dim, generator=g).to(device, dtype).transpose(1, 2)  # as the model's view
    keys = torch.randn(batch, kv_heads, length, dim, generator=g).to(device, dtype)
    values = torch.randn(batch, kv_heads, length, dim, generator=g).to(device, dtype)
    positions = _positions(batch, last, device)
    for b, p in enumerate(positions.tolist()):
        keys[b, :, p + 1 :] = float("nan")
        values[b, :, p + 1 :] = float("nan")
    return query, keys, values, positions


def _rel_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def _check_with_new_kv(case, device="cpu", dtype=torch.float16, counters=None, cache_settled=False):
    """The call that also takes the position's own key and value: the cache holds NaN there (and past
    it) before the call; after it, the new key and value and nothing else has changed. Returns
    (relative error, problems found)."""
    query, keys, values, positions = _case(*case, dtype=dtype, device=device)
    batch, _, kv_heads, _, dim, last = case
    for b, p in enumerate(positions.tolist()):
        keys[b, :, p], values[b, :, p] = float("nan"), float("nan")
    g = torch.Generator().manual_seed(last + 7)
    new_k, new_v = (torch.randn(batch, kv_heads, 1, dim, generator=g).to(device, dtype) for _ in range(2))
    before_k, before_v = keys.clone(), values.clone()
    got = da.decode(query, keys, values, positions, dim**-0.5, counters, new_kv=(new_k, new_v),
                    cache_settled=cache_settled)
    want_k, want_v = before_k.clone(), before_v.clone()
    for b, p in enumerate(positions.tolist()):
        want_k[b, :, p], want_v[b, :, p] = new_k[b, :, 0], new_v[b, :, 0]
    problems = []
    if not torch.isfinite(got).all():
        problems.append("non-finite output")
    if not (torch.equal(keys.nan_to_num(7.0), want_k.nan_to_num(7.0))
            and torch.equal(values.nan_to_num(7.0), want_v.nan_to_num(7.0))):
        problems.append("cache not exactly the old one plus each row's new position")
    return _rel_error(got, attend_rows(query, want_k, want_v, positions, dim**-0.5)), problems


def _sums_case(batch, heads, kv_heads, length, dim, last, dtype=torch.float16, device="cpu"):
    """A step whose query and new key/value are still a stacked q/k/v matvec's fp32 sums, not rotated:
    (sums [B, 1, (H + 2 Hkv) D], query, key, value views of them as the model shapes its projections,
    keys, values, positions, (cos, sin) tables [L, D] in dtype)."""
    _, keys, values, positions = _case(batch, heads, kv_heads, length, dim, last, dtype, device)
    for b, p in enumerate(positions.tolist()):
        keys[b, :, p], values[b, :, p] = float("nan"), float("nan")
    g = torch.Generator().manual_seed(last + 11)
    sums = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim, generator=g).to(device)
    q, k, v = sums.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.view(batch, 1, -1, dim).transpose(1, 2) for t in (q, k, v))
    angles = torch.arange(length).float()[:, None] * 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.cat([angles, angles], dim=-1)
    return sums, q, k, v, keys, values, positions, (angles.cos().to(device, dtype), angles.sin().to(device, dtype))


def _check_rope_and_sums(case, device="cpu", dtype=torch.float16, counters=None, cache_settled=False):
    """decode with rope and consume against decode_torch: (relative error, problems found)."""
    sums, q, k, v, keys, values, positions, rope = _sums_case(*case, dtype=dtype, device=device)
    want_sums, want_keys, want_values = sums.clone(), keys.clone(), values.clone()
    wq, wk, wv = (t.view(case[0], 1, -1, case[4]).transpose(1, 2)
                  for t in want_sums.split([case[1] * case[4], case[2] * case[4], case[2] * case[4]], dim=-1))
    want = decode_torch(wq, want_keys, want_values, positions, case[4] ** -0.5, (wk, wv), rope, consume=True)
    got = da.decode(q, keys, values, positions, case[4] ** -0.5, counters, new_kv=(k, v), rope=rope, consume=True,
                    cache_settled=cache_settled)
    problems = []
    if sums.any():
        problems.append("sums not cleared")
    if got.dtype != dtype or not torch.isfinite(got).all():
        problems.append("output not finite in the cache's dtype")
    # the rotated key may differ from the reference's in its last bit (fp32 contraction before rounding)
    if not (torch.allclose(keys.nan_to_num(7.0).float(), want_keys.nan_to_num(7.0).float(), rtol=1e-2, atol=1e-3)
            and torch.equal(values.nan_to_num(7.0), want_values.nan_to_num(7.0))):
        problems.append("cache not the old one plus the rotated key and the finished value")
    return _rel_error(got, want.float()), problems


def test_attended_inputs_rotate_as_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    sums, q, k, v, _, _, positions, rope = _sums_case(2, 6, 2, 200, 64, 150, dtype=torch.float32)
    rows = tuple(t[positions] for t in rope)  # [B, D]
    got_q, (got_k, got_v) = attended_inputs(q, (k, v), torch.float32, rows)
    want_q, want_k = apply_rotary_pos_emb(q, k, *(t[:, None] for t in rows))
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_v, v)
    # consume: the matvec's fp16 rounding, then the dtype
    got_q, _ = attended_inputs(q, None, torch.bfloat16, consume=True)
    assert torch.equal(got_q, q.half().bfloat16())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}h{}kv{}L{}d{}p{}".format(*c))
def test_reference_attends_each_row_up_to_its_position(case):
    # the masked SDPA over the whole cache (what a captured step can run) against row-by-row slices;
    # the NaN past each row's position must not leak in
    query, keys, values, positions = _case(*case)
    got = da.reference(query, keys, values, positions, case[4] ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, attend_rows(query, keys, values, positions, case[4] ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}h{}kv{}L{}d{}p{}".format(*c))
def test_reference_step_rotates_writes_and_attends(case, consume):
    sums, q, k, v, keys, values, positions, rope = _sums_case(*case, dtype=torch.float32)
    if not consume:
        q, k, v = (t.half().float() for t in (q, k, v))  # finished values, any dtype but the sums'
    want_keys, want_values, inputs = keys.clone(), values.clone(), [t.clone() for t in (q, k, v)]
    want = decode_torch(inputs[0], want_keys, want_values, positions, case[4] ** -0.5, tuple(inputs[1:]), rope,
                        consume=consume)
    got = da.reference_step(q, keys, values, positions, case[4] ** -0.5, (k, v), rope, consume=consume)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys.nan_to_num(7.0), want_keys.nan_to_num(7.0))
    assert torch.equal(values.nan_to_num(7.0), want_values.nan_to_num(7.0))
    assert (not sums.any()) == consume


# run in a fresh process under Triton's interpreter (the run_interpreted fixture, conftest.py)
_INTERPRETED = """
import json, sys, torch
sys.path[:0] = {paths!r}
from oracles import attend_rows
from test_decode_attention import CASES, _case, _check_rope_and_sums, _check_with_new_kv, _rel_error
from quantkit.runtime import decode_attention as da
report = []
shared = da.counters(8, 8, "cpu")
for case in CASES:
    query, keys, values, positions = _case(*case)
    got = da.decode(query, keys, values, positions, case[4] ** -0.5, shared)
    new_kv_error, new_kv_problems = _check_with_new_kv(case, counters=shared)
    rope_error, rope_problems = _check_rope_and_sums(case, counters=shared)
    report.append({{"shape": list(got.shape), "dtype": str(got.dtype), "finite": bool(torch.isfinite(got).all()),
                   "error": _rel_error(got, attend_rows(query, keys, values, positions, case[4] ** -0.5)),
                   "new_kv_error": new_kv_error, "new_kv_problems": new_kv_problems,
                   "rope_error": rope_error, "rope_problems": rope_problems}})
print(json.dumps({{"cases": report, "counters_left": int(shared.abs().sum())}}))
"""


def test_interpreted_kernel_matches_reference(run_interpreted):
    report = run_interpreted(_INTERPRETED)
    assert report["counters_left"] == 0
    for case, r in zip(CASES, report["cases"], strict=True):
        assert r["shape"] == [case[0], 1, case[1], case[4]] and r["dtype"] == "torch.float16", (case, r)
        assert r["finite"] and r["error"] < 2e-3, (case, r)
        assert not r["new_kv_problems"] and r["new_kv_error"] < 2e-3, (case, r)
        assert not r["rope_problems"] and r["rope_error"] < 2e-3, (case, r)


@pytest.mark.requires("cuda", "triton")
@pytest.mark.parametrize("settled", [False, True], ids=["wait-first", "cache-before-wait"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + [(1, 32, 32, 1152, 128, 700), (4, 8, 8, 96, 256, 95)],
                         ids=lambda c: "b{}h{}kv{}L{}d{}p{}".format(*c) if isinstance(c, tuple) else str(c))
def test_cuda_kernel_matches_reference(case, dtype, settled):
    """settled: the kernel variant that reads the cache, positions and rope tables before its wait for the
    previous kernel (with overlap), as in the decoder's step. Here the kernels before each call launch without
    overlap; the decoder's CUDA tests (test_fast_model.py) run it right behind an overlapped q/k/v matvec."""
    query, keys, values, positions = _case(*case, dtype=dtype, device="cuda")
    counters = da.counters(case[0], case[1], "cuda")
    for _ in range(3):  # the same counters again: each call leaves them zero
        got = da.decode(query, keys, values, positions, case[4] ** -0.5, counters, cache_settled=settled)
        assert torch.isfinite(got).all()
        assert _rel_error(got, attend_rows(query, keys, values, positions, case[4] ** -0.5)) < 2e-3
    error, problems = _check_with_new_kv(case, "cuda", dtype, counters, settled)
    assert not problems and error < 2e-3
    for _ in range(50):  # the sums are cleared after every program read them: a race shows in a loop
        error, problems = _check_rope_and_sums(case, "cuda", dtype, counters, settled)
        assert not problems and error < 2e-3
    assert not counters.any()


@pytest.mark.requires("cuda", "triton")
def test_cuda_kernel_reads_its_position_in_a_graph():
    # one captured launch serves every position: each row's position is read on the device at each replay
    query, keys, values, positions = _case(2, 8, 8, 320, 128, 319, device="cuda")
    keys, values = keys.nan_to_num(0.0), values.nan_to_num(0.0)
    counters = da.counters(2, 8, "cuda")
    da.decode(query, keys, values, positions, 0.1, counters)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode(query, keys, values, positions, 0.1, counters)
    for rows in ((0, 5), (63, 64), (64, 0), (200, 319), (319, 100)):
        positions.copy_(torch.tensor(rows))
        graph.replay()
        assert _rel_error(out, attend_rows(query, keys, values, positions, 0.1)) < 2e-3
