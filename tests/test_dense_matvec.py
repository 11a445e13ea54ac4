"""runtime.dense_matvec: the split-K fp16 matvec whose fp32 sums the decoder's next operator finishes."""

import pytest
import torch

from quantkit.runtime import dense_matvec

# (rows of the weight, columns, batch, SMs the plan is made for): whole tiles and chunks; rows and columns
# that end mid-tile and mid-chunk; every batch path (1 on the CUDA cores, 2..8 padded to one dot); programs of
# one chunk and of several (few SMs), the last one ending past the row
# (and one whose columns are whole chunks the split does not divide: its last program runs past the row)
CASES = [(128, 512, 1, 4), (100, 520, 1, 16), (96, 1000, 3, 8), (64, 256, 8, 2), (130, 768, 2, 64), (33, 300, 5, 1),
         (256, 2048, 1, 1), (70, 1500, 1, 1), (128, 3000, 4, 1), (64, 1024, 8, 1), (96, 1280, 1, 1)]


def _problems(case):
    """[] when acc (holding earlier sums) gains x @ w.T within fp32 rounding of fp16 products, and nothing
    past its B·N sums is touched: the tail, as long as a padded batch of 16 rows could reach, holds -0.0,
    which even an added zero (a masked-out lane's) turns into +0.0."""
    n, k, b, sms = case
    g = torch.Generator().manual_seed(n * k + b)
    w = torch.randn(n, k, generator=g).half()
    x = torch.randn(b, k, generator=g).half()
    earlier = torch.randn(b * n, generator=g)
    tail = 16 * n + 64
    acc = torch.cat([earlier, torch.full((tail,), -0.0)])
    plan = dense_matvec.plan(n, k, b, sms)
    dense_matvec.accumulate(x, w, acc, plan)
    want = earlier.double() + (x.double() @ w.double().t()).reshape(-1)
    err = ((acc[: b * n].double() - want).norm() / want.norm()).item()
    problems = [] if err < 1e-6 else [f"{case}: relative error {err:.2e} ({plan})"]
    if not (acc[b * n:] == 0).all() or not torch.signbit(acc[b * n:]).all():
        problems.append(f"{case}: touched the buffer past the sums")
    return problems


_INTERPRETED = """
import json, sys
sys.path[:0] = {paths!r}
from test_dense_matvec import CASES, _problems
print(json.dumps([p for case in CASES for p in _problems(case)]))
"""


def test_interpreted_kernel_adds_the_product_to_the_sums(run_interpreted):
    assert run_interpreted(_INTERPRETED) == []


@pytest.mark.parametrize("n,k,rows,sms", [(4096, 4096, 1, 132), (4096, 11008, 8, 132), (22016, 4096, 1, 132),
                                          (32000, 4096, 4, 78), (100, 37, 1, 132)])
def test_plans_cover_every_column_once_with_no_empty_program(n, k, rows, sms):
    p = dense_matvec.plan(n, k, rows, sms)
    span = p.chunks * p.block_k
    assert p.split * span >= k > (p.split - 1) * span  # the last program starts inside the row
    programs = -(-n // p.block_n) * p.split
    assert programs <= max(8 * sms, -(-n // p.block_n)) * 1.5


def test_bad_inputs_are_refused_before_a_launch(requires):
    requires("triton")
    w = torch.zeros(16, 32, dtype=torch.float16)
    with pytest.raises(ValueError):
        dense_matvec.accumulate(torch.zeros(9, 32, dtype=torch.float16), w, torch.zeros(9 * 16))
    with pytest.raises(ValueError):
        dense_matvec.accumulate(torch.zeros(1, 32, dtype=torch.float32), w, torch.zeros(16))
    with pytest.raises(ValueError):
        dense_matvec.accumulate(torch.zeros(2, 32, dtype=torch.float16), w, torch.zeros(16))
    with pytest.raises(ValueError):  # bf16 is not served
        dense_matvec.accumulate(torch.zeros(1, 32, dtype=torch.bfloat16), w.bfloat16(), torch.zeros(16))


def test_serves_only_fp16_rows_on_cuda_when_enabled(monkeypatch):
    monkeypatch.setattr(dense_matvec.SWITCH, "on", True)  # whatever QUANTKIT_DENSE_MATVEC says
    w = torch.zeros(16, 32, dtype=torch.float16)
    assert not dense_matvec.serves(w, torch.zeros(1, 32, dtype=torch.float16))  # the CPU: cuBLAS's place
    if torch.cuda.is_available() and dense_matvec.available() and torch.cuda.get_device_capability()[0] >= 9:
        wc, xc = w.cuda(), torch.zeros(1, 32, dtype=torch.float16, device="cuda")
        assert dense_matvec.serves(wc, xc)
        assert not dense_matvec.serves(wc.bfloat16(), xc.bfloat16())
        assert not dense_matvec.serves(wc, torch.zeros(9, 32, dtype=torch.float16, device="cuda"))
        with dense_matvec.disabled():
            assert not dense_matvec.serves(wc, xc)
        assert dense_matvec.serves(wc, xc)
        before = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            assert not dense_matvec.serves(wc, xc)
        finally:
            torch.use_deterministic_algorithms(before, warn_only=warn_only)


@pytest.mark.requires("cuda", "triton")
@pytest.mark.parametrize("n,k,b", [(4096, 4096, 1), (12288, 4096, 8), (4096, 11008, 3), (1000, 777, 2)])
def test_cuda_kernel_matches_the_fp64_product(n, k, b):
    g = torch.Generator(device="cuda").manual_seed(n + k + b)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g)
    x = torch.randn(b, k, device="cuda", dtype=torch.float16, generator=g)
    acc = torch.full((b * n + 5,), float("nan"), device="cuda")
    acc[: b * n] = 0
    dense_matvec.accumulate(x, w, acc)
    want = (x.double() @ w.double().t()).reshape(-1)
    assert ((acc[: b * n].double() - want).norm() / want.norm()).item() < 1e-5
    assert acc[b * n:].isnan().all()
