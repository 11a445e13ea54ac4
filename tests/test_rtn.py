"""Round-to-nearest quantization: codes, scales and zeros against a direct computation."""

import pytest
import torch

from quantkit.formats.uniform import UniformQuantizedTensor, quantize_codes
from quantkit.methods import make_method
from quantkit.methods.rtn import rtn_quantize


def _weights(k=48, d=200, seed=0):
    return torch.randn(k, d, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("sym", [False, True])
def test_requantizing_the_dequantized_weight_gives_the_stored_codes(bits, group_size, sym):
    w = _weights()
    qt, _ = make_method("rtn", bits=bits, group_size=group_size, sym=sym).quantize(w, None)
    codes = qt.codes().long()
    groups = qt.column_groups()
    scales = qt.scales.float()[:, groups]
    zeros = qt.zeros()[:, groups]
    again = quantize_codes(qt.dequantize(), scales, zeros, bits).long()
    assert torch.equal(again, codes)
    assert codes.max() < 2**bits


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_error_within_half_a_step(bits):
    w = _weights(seed=bits)
    qt, _ = make_method("rtn", bits=bits, group_size=64).quantize(w, None)
    step = qt.scales.float()[:, qt.column_groups()]
    assert ((w - qt.dequantize()).abs() <= step / 2 + 1e-6).all()


def test_more_bits_less_error():
    w = _weights(seed=3)
    errors = [(w - make_method("rtn", bits=b, group_size=64).quantize(w, None)[0].dequantize()).pow(2).mean()
              for b in range(2, 9)]
    assert all(a > b for a, b in zip(errors, errors[1:]))


def test_representable_weights_are_reproduced_exactly():
    # weights on an asymmetric 4-bit grid whose range includes 0 come back bit-exact
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    codes[:, 0], codes[:, 1] = 0, 15
    zero, scale = 6.0, 0.0078125  # fp16-exact scale
    w = (codes - zero) * scale
    qt, _ = make_method("rtn", bits=4, group_size=64).quantize(w, None)
    assert torch.equal(qt.dequantize(), w)


def test_partial_last_group_and_state_dict_roundtrip():
    w = _weights(k=16, d=576)
    codes, scales, zeros, g = rtn_quantize(w, 3, 128, False)
    assert scales.shape == (16, 5)
    qt = UniformQuantizedTensor.from_codes(codes, scales, zeros, 3, g, False)
    rebuilt = UniformQuantizedTensor.from_state_dict(qt.meta(), qt.state_dict())
    assert torch.equal(rebuilt.dequantize(), qt.dequantize())
    assert torch.equal(rebuilt.codes().long(), codes)


def test_all_zero_group_is_handled():
    w = _weights(k=4, d=64)
    w[:, :32] = 0
    qt, _ = make_method("rtn", bits=4, group_size=32).quantize(w, None)
    assert torch.equal(qt.dequantize()[:, :32], torch.zeros(4, 32))


@pytest.mark.parametrize("sym", [False, True])
def test_clip_search_never_increases_the_rounding_error(sym):
    from quantkit.formats.uniform import CLIP_NORM, fake_quantize, uniform_params

    w = torch.distributions.StudentT(3.0).sample((64, 128)) * 0.02  # heavy tails: clipping pays
    plain = uniform_params(w, 3, sym)
    searched = uniform_params(w, 3, sym, clip_search=True)

    def err(params):
        return (fake_quantize(w, params[0][:, None], params[1][:, None], 3) - w).abs().pow(CLIP_NORM).sum(1)

    assert (err(searched) <= err(plain)).all()
    assert err(searched).sum() < 0.95 * err(plain).sum()


def _grouped_cases():
    """(device, k, d, g, batched): `batched` when the shape takes the batched path. On the CPU a group of
    k·g elements not a multiple of 32 leaves pow a scalar tail, so such shapes run group by group."""
    cases = [("cpu", 48, 200, 32, True), ("cpu", 64, 256, 32, True), ("cpu", 96, 1024, 128, True),
             ("cpu", 300, 1000, 100, False), ("cpu", 320, 1000, 100, True), ("cpu", 17, 96, 16, False),
             ("cpu", 37, 333, 24, False)]
    if torch.cuda.is_available():  # the batched path needs GROUPED_MIN_ROWS rows on CUDA
        cases += [("cuda", 576, 576, 128, True), ("cuda", 1024, 1536, 128, True), ("cuda", 4096, 11008, 128, True),
                  ("cuda", 600, 1000, 100, True), ("cuda", 48, 200, 32, False)]
    return cases


@pytest.mark.parametrize("device,k,d,g,batched", _grouped_cases())
@pytest.mark.parametrize("bits,sym", [(2, False), (3, False), (4, False), (4, True)])
def test_grouped_params_equal_one_call_per_group(device, k, d, g, batched, bits, sym, monkeypatch):
    from quantkit.formats import uniform

    gen = torch.Generator().manual_seed(k * d + bits)
    w = (torch.distributions.StudentT(3.0).sample((k, d)) * 0.02).to(device)  # heavy tails: clipping pays
    w[:3, :g] = 0  # all-zero groups take the [-1, 1] range
    w[5, :] = w[5, torch.randperm(d, generator=gen)[0]]  # constant rows
    expected = [uniform.uniform_params(w[:, j : j + g], bits, sym, clip_search=True) for j in range(0, d, g)]
    calls = []
    single = uniform.uniform_params
    monkeypatch.setattr(uniform, "uniform_params", lambda *a, **kw: calls.append(1) or single(*a, **kw))
    scales, zeros = uniform.grouped_uniform_params(w, g, bits, sym, clip_search=True)
    assert torch.equal(scales, torch.stack([s for s, _ in expected], 1))
    assert torch.equal(zeros, torch.stack([z for _, z in expected], 1))
    assert (len(calls) < uniform.num_groups(d, g)) == batched
