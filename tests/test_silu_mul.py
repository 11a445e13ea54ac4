"""runtime.silu_mul: SiLU(gate)·up of a stacked gate/up output, or of its matvec's fp32 accumulator (cleared after)."""

import pytest
import torch

from quantkit.runtime import silu_mul

# (rows, width, dtype): a 7B decode row (11008 = 10 whole blocks and a partial one), a prefill of
# SmolLM2's MLP width, bf16
CASES = [(1, 11008, torch.float16), (3, 1536, torch.float16), (2, 96, torch.bfloat16)]


def _accumulator(rows, width, device="cpu"):
    return (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(device)


def _consumed(case, device="cpu"):
    """[] when the kernel's output is the reference's within one rounding and the accumulator is left zero."""
    rows, width, dtype = case
    acc = _accumulator(rows, width, device)
    want = silu_mul.silu_mul_torch(acc.clone(), dtype, consume=True)
    got = silu_mul.silu_mul(acc, dtype, consume=True)
    problems = [] if not acc.any() else ["accumulator not cleared"]
    if got.dtype != dtype or got.shape != want.shape:
        return problems + [f"got {got.dtype} {tuple(got.shape)}"]
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)  # exp and the roundings may differ by one step
    if not torch.allclose(got.float(), want.float(), rtol=2 * ulp, atol=1e-6):
        problems.append(f"off by {(got.float() - want.float()).abs().max().item()}")
    return problems


def _finished(case, device="cpu"):
    """[] when the kernel on a finished gate/up output [rows, 2·width] in `dtype` matches the reference
    within one rounding and leaves its input alone."""
    rows, width, dtype = case
    gate_up = _accumulator(rows, width, device).to(dtype)
    before = gate_up.clone()
    got = silu_mul.silu_mul(gate_up)
    want = silu_mul.silu_mul_torch(gate_up)
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
    problems = [] if torch.equal(gate_up, before) else ["input changed"]
    if got.dtype != dtype or not torch.allclose(got.float(), want.float(), rtol=2 * ulp, atol=1e-6):
        problems.append("output differs")
    return problems


# fp16 only under the interpreter: its fp32 -> bf16 conversion is not round-to-nearest
_INTERPRETED = """
import json, sys
import torch
sys.path[:0] = {paths!r}
from test_silu_mul import CASES, _consumed, _finished
print(json.dumps([f(case) for case in CASES if case[2] == torch.float16 for f in (_consumed, _finished)]))
"""


def test_interpreted_kernel_matches_reference(run_interpreted):
    report = run_interpreted(_INTERPRETED)
    assert report and all(r == [] for r in report), report


def test_reference_is_the_mlp_activation_of_the_rounded_outputs():
    acc = _accumulator(2, 64)
    gate, up = acc.half().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up  # transformers' Llama MLP on the matvec's fp16 outputs
    assert torch.equal(silu_mul.silu_mul_torch(acc, torch.float16, consume=True), want) and not acc.any()
    finished = _accumulator(2, 64).half()
    gate, up = finished.chunk(2, dim=-1)
    assert torch.equal(silu_mul.silu_mul_torch(finished), torch.nn.functional.silu(gate) * up)


def test_unsupported_inputs_are_refused():
    acc = _accumulator(1, 64)
    assert not silu_mul.supported(acc, torch.float16, consume=True)  # CPU
    if torch.cuda.is_available() and silu_mul._kernel() is not None:
        cuda = acc.cuda()
        assert silu_mul.supported(cuda, torch.float16, consume=True)
        assert not silu_mul.supported(cuda.half(), torch.float16, consume=True)  # not an fp32 accumulator
        assert silu_mul.supported(cuda.half(), torch.float16, consume=False)  # a finished output
        assert not silu_mul.supported(cuda[:, :127], torch.float16, consume=True)  # odd width, and strided
        assert not silu_mul.supported(cuda, torch.float32, consume=True)


@pytest.mark.requires("cuda", "triton")
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel_matches_reference(case):
    assert _consumed(case, device="cuda") == []
    assert _finished(case, device="cuda") == []


@pytest.mark.requires("cuda", "triton")
def test_cuda_kernel_reads_before_it_clears():
    """Zeros stored right after the loads overtook some of them on an H100 (one chunk of a row read as
    zero in most calls): every call of a loop on fresh accumulators must match."""
    failures = [i for i in range(50) if _consumed((1, 11008, torch.float16), device="cuda")]
    assert failures == []
