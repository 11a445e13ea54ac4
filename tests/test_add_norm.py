"""runtime.add_norm: the Triton residual-add + RMSNorm kernel computes what transformers' Llama does."""

import pytest
import torch

from quantkit.runtime import add_norm

# (rows, width, dtype, strided rows): a decode row of a 7B model, a prefill of a width that is not a
# power of two (SmolLM2's 576), bf16, and rows that are views of a wider (stacked) tensor
CASES = [(1, 4096, torch.float16, False), (5, 576, torch.float16, False), (3, 64, torch.bfloat16, False),
         (4, 256, torch.float16, True)]


def _case(rows, width, dtype, strided, device="cpu", consume=False):
    """residual, delta, weight; consume: delta is an fp32 accumulator (QuantLinear.accumulate's)."""
    g = torch.Generator().manual_seed(rows * width)
    if strided:
        wide = torch.randn(rows, 3 * width, generator=g).to(dtype)
        residual, delta = wide[:, :width], wide[:, 2 * width:]
    else:
        residual, delta = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(2))
    if consume:  # values between fp16's: rounding them first or adding them in fp32 gives different sums
        delta = torch.randn(rows, width, generator=g) * 3
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    return residual.to(device), delta.to(device), weight.to(device)


def _consumed(case, device="cpu"):
    """[] when add_rms_norm(consume=True) adds the accumulator as the matvec's fp16 output (then in the
    model's dtype) and leaves it zero."""
    residual, acc, weight = _case(*case, device=device, consume=True)
    want = add_norm.add_rms_norm_torch(residual, acc.half().to(residual.dtype), weight, 1e-5)
    got = add_norm.add_rms_norm(residual, acc, weight, 1e-5, consume=True)
    return _check(got, want) + ([] if not acc.any() else ["accumulator not cleared"])


def _check(got, want):
    """[] when the kernel's (hidden, normed) match the reference: the sum bit-equal (bf16: within one
    rounding, as Triton's interpreter rounds fp32 -> bf16 its own way), the norm within an ulp."""
    problems = []
    exact = got[0].dtype != torch.bfloat16
    if not (torch.equal(got[0], want[0]) if exact else
            torch.allclose(got[0].float(), want[0].float(), rtol=2**-7, atol=0)):
        problems.append("hidden differs")
    if got[1].dtype != want[1].dtype or got[1].shape != want[1].shape:
        problems.append(f"normed {got[1].dtype} {tuple(got[1].shape)}")
    elif not torch.allclose(got[1].float(), want[1].float(), rtol=1e-2, atol=1e-2):
        problems.append(f"normed off by {(got[1].float() - want[1].float()).abs().max().item()}")
    return problems


def _norm_only(case, device="cpu"):
    """[] when rms_norm (the kernel without a delta) matches the reference norm of its input."""
    residual, _, weight = _case(*case, device=device)
    got = add_norm.rms_norm(residual, weight, 1e-5)
    return _check((residual, got), (residual, add_norm.rms_norm_torch(residual, weight, 1e-5)))


# run in a fresh process under Triton's interpreter (the run_interpreted fixture, conftest.py)
_INTERPRETED = """
import json, sys
import torch
sys.path[:0] = {paths!r}
from test_add_norm import CASES, _case, _check, _consumed, _norm_only
from quantkit.runtime import add_norm
report = []
for case in CASES:
    residual, delta, weight = _case(*case)
    got = add_norm.add_rms_norm(residual, delta, weight, 1e-5)
    report.append(_check(got, add_norm.add_rms_norm_torch(residual, delta, weight, 1e-5)))
report += [_consumed(case) for case in CASES if case[2] == torch.float16]  # bf16: see CONSUMED_INTERPRETED
report += [_norm_only(case) for case in CASES]
print(json.dumps(report))
"""
# The interpreter's fp32 -> bf16 conversion is not round-to-nearest, and the accumulator goes through two
# roundings (fp16, then bf16): bf16 accumulators are checked on CUDA only.
CONSUMED_INTERPRETED = [case for case in CASES if case[2] == torch.float16]


def test_interpreted_kernel_matches_reference(run_interpreted):
    report = run_interpreted(_INTERPRETED)
    cases = CASES + CONSUMED_INTERPRETED + CASES
    assert report == [[]] * len(cases), list(zip(cases, report))


def test_torch_expression_is_transformers_llama_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    residual, delta, weight = _case(2, 64, torch.float16, False)
    norm = LlamaRMSNorm(64, eps=1e-5).to(torch.float16)
    norm.weight.data.copy_(weight)
    hidden, normed = add_norm.add_rms_norm_torch(residual, delta, weight, 1e-5)
    assert torch.equal(hidden, residual + delta) and torch.equal(normed, norm(residual + delta))


def test_unsupported_inputs_are_refused():
    residual, delta, weight = _case(1, 64, torch.float16, False)
    assert not add_norm.supported(residual, delta, weight)  # CPU
    if torch.cuda.is_available() and add_norm.available():
        r, d, w = (t.cuda() for t in (residual, delta, weight))
        assert add_norm.supported(r, d, w)
        assert not add_norm.supported(r.float(), d.float(), w)  # fp32
        assert not add_norm.supported(r, d, w.float())  # the weight in another dtype
        assert not add_norm.supported(r.t(), d.t(), w)  # last dimension strided
        assert not add_norm.supported(r, d, w, consume=True) and add_norm.supported(r, d.float(), w, consume=True)


@pytest.mark.requires("cuda", "triton")
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel_matches_reference(case):
    residual, delta, weight = _case(*case, device="cuda")
    assert add_norm.supported(residual, delta, weight)
    got = add_norm.add_rms_norm(residual, delta, weight, 1e-5)
    assert _check(got, add_norm.add_rms_norm_torch(residual, delta, weight, 1e-5)) == []


@pytest.mark.requires("cuda", "triton")
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel_consumes_an_accumulator(case):
    assert _consumed(case, device="cuda") == []
    assert _norm_only(case, device="cuda") == []


@pytest.mark.requires("cuda", "triton")
def test_cuda_kernel_reads_the_accumulator_before_it_clears():
    """As silu_mul's: a loop of calls on fresh accumulators, each must match (a race shows in a few)."""
    failures = [i for i in range(50) if _consumed((1, 4096, torch.float16, False), device="cuda")]
    assert failures == []
