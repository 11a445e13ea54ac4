"""Tests of LUT-GEMM (kernels/lutgemm*.cu / .cuh / .cpp, quantkit/kernels/lutgemm.py).

Three layers, so that CPU-only CI still checks most of what can go wrong:
  * CPU: the Python plumbing (switch rule, lazy uniform -> BCQ conversion, weight cache, shapes,
    dtypes, bias) with a PyTorch stand-in for the compiled ops;
  * CPU, when g++ and the CUDA headers are found: the kernel source itself, built as plain C++ with
    its host emulation (one std::thread per CUDA thread, lutgemm_emu.cpp -DLUTGEMM_HOST_EMU), against an
    fp64 reference; its output buffers start as NaN;
  * GPU (each test marked `gpu`; skipped without CUDA or when the extension does not build): the
    compiled kernels, output buffers poisoned with NaN before every run.
Both matvec kernels are covered: the LUT kernel and the tensor-core one (mma_min_batch selects).
The file mixes CPU and GPU tests, so the `gpu` mark is per test rather than a module pytestmark.
"""

import os
import random
import re
import shlex
import subprocess

import numpy as np
import pytest
import torch

from overlap_helpers import replay_chains
from quantkit.formats.bcq import BCQQuantizedTensor, bcq_from_uniform
from quantkit.formats.uniform import UniformQuantizedTensor, num_groups
from quantkit.kernels import build, dispatch, lutgemm, overlap
from quantkit.methods.rtn import rtn_quantize
from quantkit.runtime import QuantLinear

EMULATOR = build.SOURCE_DIR / "lutgemm_emu.cpp"  # the kernel headers under their CPU emulation
TOL = 2e-3  # ‖y − y_ref‖ / ‖y_ref‖ against the fp64 reference (the accuracy target)
COMPACT_TOL = 1e-5  # compact α's fp32 sums against the full α's (the same terms, summed in another order)


def make_bcq(k, d, q, g, offset, seed=0, device="cpu"):
    """Random BCQ tensor: random signs, positive α shrinking with the plane (as the greedy fit gives)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = num_groups(d, g)
    signs = torch.rand(q, k, d, generator=gen, device=device) < 0.5
    alpha = ((torch.rand(k, groups, q, generator=gen, device=device) + 0.5) * 0.02
             * 0.5 ** torch.arange(q, device=device))
    z = torch.randn(k, groups, generator=gen, device=device) * 0.01 if offset else None
    return BCQQuantizedTensor.from_signs(signs, alpha, z, g)


def reference(x, qt, bias=None):
    """fp64 x @ wᵀ (+ bias) from the exact dequantized weight."""
    y = x.double() @ qt.dequantize(torch.float32).double().t()
    return y if bias is None else y + bias.double()


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


# ---- CPU: the Python plumbing with a PyTorch stand-in for the compiled ops ---------------------

class FakeOps:
    """The extension's contract (lut_gemm / dequantize into `out`) computed with PyTorch."""

    def __init__(self):
        self.calls = []
        self.overlaps = []  # the overlap flag of each lut_gemm / lut_accumulate call
        self.alpha_planes = []  # alpha.shape[1] of each lut_gemm / lut_accumulate call

    @staticmethod
    def _tensor(qweight, alpha, offset, group_size, in_features, rows=None):
        q = qweight.shape[0]
        if alpha.shape[1] != q:  # compact α: plane i is plane 0 times 2^i, for a few rows of x only
            assert alpha.shape[1] == 1 and rows is not None and rows <= lutgemm.COMPACT_ALPHA_MAX_TOKENS
            alpha = alpha * torch.exp2(torch.arange(q, dtype=torch.float32)).view(1, q, 1).to(alpha)
        return BCQQuantizedTensor(qweight=qweight, alpha=alpha, offset=offset, bits=q,
                                  group_size=group_size, in_features=in_features)

    @staticmethod
    def workspace_floats(n, k):
        return n * k + 16

    def lut_gemm(self, x, qweight, alpha, offset, bias, group_size, out, mma_min_batch=9, workspace=None, blocks=0,
                 overlap=False):
        assert x.dtype == torch.float16 and x.is_contiguous() and out.dtype == torch.float16
        assert mma_min_batch == lutgemm.MMA_MIN_BATCH
        self.overlaps.append(overlap)
        self.alpha_planes.append(alpha.shape[1])
        if workspace is not None:
            assert workspace.dtype == torch.float32
            assert workspace.numel() >= self.workspace_floats(x.shape[0], out.shape[1])
            assert not workspace.any(), "the workspace must be zero on entry"
        self.calls.append(("lut_gemm", x.shape[0]))
        y = reference(x, self._tensor(qweight, alpha, offset, group_size, x.shape[1], x.shape[0]), bias)
        out.copy_(y.to(torch.float16))

    def lut_accumulate(self, x, qweight, alpha, offset, group_size, acc, mma_min_batch=9, blocks=0, overlap=False):
        assert x.dtype == torch.float16 and x.is_contiguous() and acc.dtype == torch.float32
        assert mma_min_batch == lutgemm.MMA_MIN_BATCH
        self.overlaps.append(overlap)
        self.alpha_planes.append(alpha.shape[1])
        k = qweight.shape[2]
        self.calls.append(("lut_accumulate", x.shape[0]))
        sums = acc[: x.shape[0] * k].view(x.shape[0], k)
        sums += reference(x, self._tensor(qweight, alpha, offset, group_size, x.shape[1], x.shape[0])).float()

    def dequantize(self, qweight, alpha, offset, group_size, out):
        self.calls.append(("dequantize", out.dtype))
        out.copy_(self._tensor(qweight, alpha, offset, group_size, out.shape[1]).dequantize(out.dtype))


@pytest.fixture
def fake_ops(monkeypatch):
    ops = FakeOps()
    monkeypatch.setattr(lutgemm, "kernels", lambda: ops)
    return ops


def _uniform_module(k=64, d=160, bits=4, g=32, sym=False, bias=True, seed=0, g_idx=False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(k, d, generator=gen) * 0.02
    codes, scales, zeros, g = rtn_quantize(w, bits, g, sym)
    ut = UniformQuantizedTensor.from_codes(codes, scales, zeros, bits, g, sym,
                                           g_idx=torch.arange(d) // g if g_idx else None)
    return QuantLinear(ut, bias=torch.randn(k, generator=gen) * 0.1 if bias else None)


def test_registered_with_dispatch():
    assert dispatch._FORWARDS["bcq"] is lutgemm.forward
    assert dispatch._FORWARDS["uniform"] is lutgemm.forward
    assert dispatch._ACCUMULATES["bcq"] is dispatch._ACCUMULATES["uniform"] is lutgemm.accumulate


def test_switch_rule_32bit_offset_bound():
    # 8 planes x 8192 words x k rows must stay below 2^31 for the kernel's 32-bit offsets
    d = 32 * 8192
    assert lutgemm.use_matvec(1, 2**15 - 4, d, 128)
    assert not lutgemm.use_matvec(1, 2**15, d, 128)


@pytest.mark.parametrize("tokens,k,d,g,path", [
    (1, 64, 160, 32, "lut_gemm"),
    (lutgemm.MATVEC_MAX_TOKENS, 64, 160, 160, "lut_gemm"),
    (lutgemm.MATVEC_MAX_TOKENS + 1, 64, 160, 32, "dequantize"),
    (1, 62, 160, 32, "dequantize"),   # out_features % 4 != 0
    (1, 64, 160, 48, "dequantize"),   # groups split 32-column words
    (1, 64, 100, 100, "lut_gemm"),    # row-wise groups of a width that is not a multiple of 32
])
def test_switch_rule(fake_ops, tokens, k, d, g, path):
    assert lutgemm.use_matvec(tokens, k, d, g) == (path == "lut_gemm")
    module = QuantLinear(make_bcq(k, d, 3, g, offset=True), bias=torch.randn(k) * 0.1)
    x = torch.randn(tokens, d)
    y = lutgemm.forward(module, x)
    assert [c[0] for c in fake_ops.calls] == [path]
    assert y.dtype == x.dtype and y.shape == (tokens, k)
    ref = module(x)  # CPU input: QuantLinear's reference path
    tol = 1e-3 if path == "lut_gemm" else 1e-6  # the LUT path returns fp16
    assert rel_err(y, ref.double()) < tol


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def test_deterministic_mode_takes_the_dequantize_path(fake_ops, deterministic):
    """The matvec kernels' split-K atomics add in no fixed order: under torch's deterministic mode the
    decode-sized calls go through dequantize + GEMM, and accumulate declines without running."""
    assert not lutgemm.use_matvec(1, 64, 160, 32)
    module = QuantLinear(make_bcq(64, 160, 3, 32, offset=True))
    x = torch.randn(1, 160)
    y = lutgemm.forward(module, x)
    assert lutgemm.accumulate(module, x) is None
    assert [c[0] for c in fake_ops.calls] == ["dequantize"]
    assert rel_err(y, module(x).double()) < 1e-6


def test_leading_dims_dtype_and_bias(fake_ops):
    module = QuantLinear(make_bcq(32, 96, 2, 32, offset=False), bias=torch.randn(32) * 0.1)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    y = lutgemm.forward(module, x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    xw = x.double().reshape(6, 96) @ module.dequantized_weight().double().t()
    assert rel_err(y.reshape(6, 32), xw + module.bias.double()) < 1e-2  # bf16 output
    module.bias = None  # the bias is added exactly once
    assert rel_err(lutgemm.forward(module, x).reshape(6, 32), xw) < 1e-2


def test_overlap_only_once_the_weights_are_settled(fake_ops, monkeypatch):
    """A matvec copies its weights before waiting for the kernel before it (kernels/overlap.py), so a
    module's first call with new or rewritten weight tensors launches without overlap, later ones with it."""
    monkeypatch.setattr(overlap.SWITCH, "on", True)  # whatever QUANTKIT_OVERLAP says
    module = QuantLinear(make_bcq(32, 64, 2, 32, offset=True))
    x = torch.randn(1, 64)
    for _ in range(3):
        lutgemm.forward(module, x)
    assert fake_ops.overlaps == [False, True, True]
    module.alpha.mul_(1.0)  # written in place (on a GPU: by a kernel that may still be running)
    lutgemm.forward(module, x)
    lutgemm.accumulate(module, x).zero_()  # the sums are the caller's to clear
    module.offset = module.offset.clone()  # new storage
    lutgemm.forward(module, x)
    assert fake_ops.overlaps[3:] == [False, True, False]
    with overlap.disabled():
        lutgemm.forward(module, x)
    assert fake_ops.overlaps[-1] is False


def test_empty_input_and_unserved_dtype(fake_ops):
    module = QuantLinear(make_bcq(32, 64, 2, 32, offset=False))
    y = lutgemm.forward(module, torch.randn(0, 64))
    assert y.shape == (0, 32)
    assert lutgemm.forward(module, torch.randn(2, 64, dtype=torch.float64)) is None
    assert fake_ops.calls == []


@pytest.mark.parametrize("cache", [True, False])
def test_dequantize_path_uses_the_module_cache(fake_ops, cache):
    module = QuantLinear(make_bcq(64, 128, 3, 64, offset=True), cache_weight=cache)
    x = torch.randn(40, 128, dtype=torch.float16)
    y1 = lutgemm.forward(module, x)
    y2 = lutgemm.forward(module, x)
    assert torch.equal(y1, y2)
    assert [c[0] for c in fake_ops.calls].count("dequantize") == (1 if cache else 2)
    if cache:
        key, weight = module._cached
        assert key == (x.device, torch.float16, None) and weight.dtype == torch.float16
        assert torch.equal(weight, module.dequantized_weight(torch.float16))  # what the reference path would cache
    else:
        assert module._cached is None


def test_dequantize_path_reuses_a_weight_cached_by_the_reference(fake_ops):
    module = QuantLinear(make_bcq(64, 128, 3, 64, offset=False))
    x = torch.randn(40, 128, dtype=torch.float16)
    module(x)  # CPU input: the reference path fills the cache for (cpu, fp16)
    assert module._cached is not None
    lutgemm.forward(module, x)
    assert fake_ops.calls == []


def test_uniform_converts_once_and_keeps_it_off_the_state_dict(fake_ops, monkeypatch):
    module = _uniform_module()
    conversions = []

    def counting(ut):
        conversions.append(1)
        return bcq_from_uniform(ut)

    monkeypatch.setattr(lutgemm, "bcq_from_uniform", counting)
    x = torch.randn(3, 160)
    y1 = lutgemm.forward(module, x)
    y2 = lutgemm.forward(module, x)
    assert len(conversions) == 1 and torch.equal(y1, y2)
    assert isinstance(module._lutgemm_bcq[1], lutgemm.BCQTensors)
    assert set(module.state_dict()) == {"qweight", "scales", "qzeros", "bias"}
    # same answer as the uniform reference, up to fp16 output and the fp16 rounding of z in the conversion
    assert rel_err(y1, module(x).double()) < 2e-3


@pytest.mark.parametrize("bits,g,sym", [(4, 32, False), (3, 64, True), (2, 160, False)])
def test_uniform_through_bcq_matches_uniform_reference(fake_ops, bits, g, sym):
    module = _uniform_module(bits=bits, g=g, sym=sym, seed=bits)
    for tokens in (1, 40):
        x = torch.randn(tokens, 160)
        y = lutgemm.forward(module, x)
        assert rel_err(y, module(x).double()) < 2e-3


def test_uniform_matvecs_read_plane_0_alpha_up_to_two_tokens(fake_ops):
    module = _uniform_module(bits=4, bias=False, seed=3)
    for tokens in (1, 2, 3, 8):
        x = torch.randn(tokens, 160)
        assert rel_err(lutgemm.forward(module, x), module(x).double()) < 2e-3
        assert rel_err(lutgemm.accumulate(module, x), module(x).double()) < 2e-3
        module._lutgemm_workspace.zero_()  # as the consumer of the sums would
    assert fake_ops.alpha_planes == [1, 1, 1, 1, 4, 4, 4, 4]


def test_uniform_with_g_idx_falls_back(fake_ops):
    module = _uniform_module(g_idx=True)
    assert lutgemm.forward(module, torch.randn(2, 160)) is None
    assert fake_ops.calls == []


def test_accumulate_leaves_the_sums_that_round_to_the_output(fake_ops):
    module = QuantLinear(make_bcq(64, 160, 3, 32, offset=True))
    x = torch.randn(2, 3, 160, dtype=torch.float16)
    y = lutgemm.forward(module, x)
    acc = lutgemm.accumulate(module, x)
    assert acc.dtype == torch.float32 and acc.shape == (2, 3, 64)
    assert acc.data_ptr() == module._lutgemm_workspace.data_ptr()  # the kept workspace, in place
    assert torch.equal(acc.half(), y)
    acc.zero_()  # the consumer's part of the contract; the next call adds to zeros again
    assert torch.equal(lutgemm.accumulate(module, x).half(), y)
    assert [c[0] for c in fake_ops.calls] == ["lut_gemm", "lut_accumulate", "lut_accumulate"]


@pytest.mark.parametrize("case", ["bias", "tokens", "dtype", "groups", "g_idx"])
def test_accumulate_declines_without_running(fake_ops, case):
    k, d, g, tokens, dtype, bias = 64, 160, 32, 1, torch.float16, None
    if case == "bias":
        bias = torch.randn(k)  # the sums would lack it
    elif case == "tokens":
        tokens = lutgemm.MATVEC_MAX_TOKENS + 1
    elif case == "dtype":
        dtype = torch.float64
    elif case == "groups":
        g = 48
    if case == "g_idx":
        module = _uniform_module(g_idx=True, bias=False)
    else:
        module = QuantLinear(make_bcq(k, d, 3, g, offset=True), bias=bias)
    assert lutgemm.accumulate(module, torch.randn(tokens, d).to(dtype)) is None
    assert fake_ops.calls == [] and getattr(module, "_lutgemm_workspace", None) is None


def test_no_extension_means_reference(monkeypatch):
    monkeypatch.setattr(lutgemm, "kernels", lambda: None)
    module = QuantLinear(make_bcq(32, 64, 2, 32, offset=False))
    assert lutgemm.forward(module, torch.randn(1, 64)) is None
    assert lutgemm.accumulate(module, torch.randn(1, 64)) is None
    assert lutgemm.forward(_uniform_module(), torch.randn(1, 160)) is None


# ---- CPU: the kernel source under its host emulation ---------------------------------------------

@pytest.fixture(scope="session")
def emulator(tmp_path_factory, requires):
    cxx, include = requires("g++"), requires("cuda_headers")
    exe = tmp_path_factory.mktemp("lutgemm-emu") / "lutgemm_emu"
    # the tuning overrides a GPU build would take (QUANTKIT_KERNEL_DEFINES), so an A/B variant is checked here too
    defines = shlex.split(os.environ.get("QUANTKIT_KERNEL_DEFINES", ""))
    cmd = [cxx, "-std=c++20", "-O2", "-fno-strict-aliasing", "-pthread", "-DLUTGEMM_HOST_EMU", *defines,
           f"-I{include}", "-x", "c++", str(EMULATOR), "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return exe


def _emulate(exe, workdir, args):
    res = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr


def _save(workdir, name, t):
    t.contiguous().cpu().numpy().tofile(workdir / f"{name}.bin")


# (n, k, d, q, g, offset, bias, max_blocks, mma_min_batch): LUT kernel (mma_min_batch 9) at every
# padded batch 1/2/4/8 and a 2-launch batch; the tensor-core kernel (mma_min_batch <= n) alone or
# mixed with LUT launches; blocks that start and stop mid-unit (max_blocks not dividing the steps)
# or run a single step; d with padding bits and partial chunks; row-wise groups of any width. Cases
# with whole 512-row tiles and 128-column chunks of an 8-aligned d also take the tensor-core kernel's
# unchecked copy path for interior units (with and without the offset plane, q odd and even)
EMU_CASES = [
    (1, 1024, 256, 1, 256, False, False, 1, 9),
    (1, 2048, 600, 3, 128, True, True, 3, 9),
    (2, 1028, 1000, 2, 64, True, False, 5, 9),
    (3, 512, 512, 4, 32, False, True, 64, 9),
    (4, 1100, 200, 8, 200, True, True, 2, 9),
    (8, 2048, 700, 3, 700, True, True, 4, 9),
    (5, 96, 2000, 5, 128, True, False, 7, 9),
    (4, 1024, 640, 1, 128, False, False, 3, 9),   # one step per unit: x for the next unit loads every step
    (11, 1024, 300, 2, 96, True, True, 3, 9),
    (8, 1024, 1024, 3, 128, True, True, 5, 1),    # tensor cores
    (5, 260, 700, 2, 700, True, True, 3, 1),      # row-wise group, d not a multiple of 32, rows past a tile
    (6, 512, 1536, 4, 256, False, False, 7, 1),
    (1, 256, 384, 1, 128, True, False, 2, 1),     # one step per unit
    (7, 1024, 512, 6, 128, True, False, 3, 1),    # q past the per-q instances: the one that reads q at run time
    (12, 1100, 520, 2, 520, True, False, 4, 5),   # launches of 8 (tensor cores) and 4 (LUT)
]


@pytest.mark.parametrize("n,k,d,q,g,offset,bias,max_blocks,mma_min_batch", EMU_CASES)
def test_emulated_lut_gemm(emulator, tmp_path, n, k, d, q, g, offset, bias, max_blocks, mma_min_batch):
    qt = make_bcq(k, d, q, g, offset, seed=n * 131 + q)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, d, generator=gen).half()
    b = (torch.randn(k, generator=gen) * 0.1).half() if bias else None
    _save(tmp_path, "qweight", qt.qweight)
    _save(tmp_path, "alpha", qt.alpha)
    if offset:
        _save(tmp_path, "offset", qt.offset)
    if bias:
        _save(tmp_path, "bias", b)
    _save(tmp_path, "x", x)
    _emulate(emulator, tmp_path, ["gemm", tmp_path, n, d, k, q, g, int(offset), int(bias), max_blocks, mma_min_batch])
    y = torch.from_numpy(np.fromfile(tmp_path / "y.bin", dtype=np.float16).reshape(n, k))
    assert not torch.isnan(y).any(), "output elements left unwritten"
    assert rel_err(y, reference(x, qt, b)) < TOL


def _lut_switch(name):
    """A LUT-GEMM tuning switch as the emulator is built: QUANTKIT_KERNEL_DEFINES's -DNAME=V, else the header's."""
    for define in shlex.split(os.environ.get("QUANTKIT_KERNEL_DEFINES", "")):
        if define.startswith(f"-D{name}="):
            return int(define.split("=", 1)[1])
    header = (build.SOURCE_DIR / "lutgemm_tuning.h").read_text()
    return int(re.search(rf"#define {name} (\d+)", header).group(1))


def _unit_steps(n, q, offset):
    """Pipeline steps of one (row tile, chunk) unit of the LUT kernel at n columns (Cfg in lutgemm_lut_kernel.cuh)."""
    words = 8 if n <= 2 else 4 if n <= 4 else 2
    step_words = min(words, _lut_switch("LUT_STEP_WORDS"))
    steps = words // step_words
    offset_steps = 1 if _lut_switch("LUT_OFFSET_ONE_STEP") and words == 2 * step_words else steps
    return q * steps + (offset_steps if offset else 0)


# stream-K cuts the steps of a matrix anywhere: with an offset, a unit is q planes of NH steps and then the offset
# plane (one step where a plane is two). Every grid from 1 block to one block per step, so that a block starts and
# stops at every position of a unit, the offset step included; compact α (uniform weights, 1-2 columns) too.
@pytest.mark.parametrize("n,compact", [(1, False), (2, False), (4, False), (1, True), (2, True)])
def test_emulated_every_stream_k_split_with_an_offset(emulator, tmp_path, n, compact):
    k, d, q, g = 1100, 512, 3, 128  # two row tiles
    if compact:
        qt = bcq_from_uniform(_uniform_module(k, d, q, g, seed=n).qtensor())
        alpha, planes = lutgemm.power_of_two_planes(qt.alpha), [1]
    else:
        qt = make_bcq(k, d, q, g, True, seed=n)
        alpha, planes = qt.alpha, []
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n)).half()
    for name, t in (("qweight", qt.qweight), ("alpha", alpha), ("offset", qt.offset), ("x", x)):
        _save(tmp_path, name, t)
    ref = reference(x, qt)
    chunks = d // (256 if n <= 2 else 128)
    steps = 2 * chunks * _unit_steps(n, q, offset=True)
    for blocks in range(1, steps + 2):  # one past: the grid is capped at one block per step
        _emulate(emulator, tmp_path, ["gemm", tmp_path, n, d, k, q, g, 1, 0, blocks, 9, *planes])
        y = torch.from_numpy(np.fromfile(tmp_path / "y.bin", dtype=np.float16).reshape(n, k))
        assert not torch.isnan(y).any(), f"{blocks} blocks: output elements left unwritten"
        assert rel_err(y, ref) < TOL, blocks


# accumulate: the same launches stopping at their fp32 sums (LUT kernel, tensor cores, both in one call)
@pytest.mark.parametrize("n,k,d,q,g,offset,max_blocks,mma_min_batch", [
    (1, 2048, 600, 3, 128, True, 3, 9),
    (3, 1028, 1000, 2, 64, False, 5, 9),
    (8, 1024, 1024, 3, 128, True, 5, 1),
    (12, 1100, 520, 2, 520, True, 4, 5),
])
def test_emulated_accumulate_is_the_output_before_rounding(emulator, tmp_path, n, k, d, q, g, offset, max_blocks,
                                                           mma_min_batch):
    qt = make_bcq(k, d, q, g, offset, seed=n * 7 + q)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n)).half()
    inputs = (("qweight", qt.qweight), ("alpha", qt.alpha), ("x", x)) + ((("offset", qt.offset),) if offset else ())
    for name, t in inputs:
        _save(tmp_path, name, t)
    common = [tmp_path, n, d, k, q, g, int(offset), 0, max_blocks, mma_min_batch]
    _emulate(emulator, tmp_path, ["accumulate", *common])
    acc = torch.from_numpy(np.fromfile(tmp_path / "acc.bin", dtype=np.float32).reshape(n, k))
    _emulate(emulator, tmp_path, ["gemm", *common])
    y = torch.from_numpy(np.fromfile(tmp_path / "y.bin", dtype=np.float16).reshape(n, k))
    assert rel_err(acc, reference(x, qt, None)) < TOL
    assert torch.equal(acc.half(), y)  # blocks run in order here, so the same sums: rounding them is the output


# compact α: a uniform weight's BCQ form, plane 0's α only. The kernel scales a step's sum by 2^i instead of each
# word's α, so the fp32 sums round differently: they agree with the full α's to fp32 rounding (COMPACT_TOL; a wrong
# plane scale is off by a whole plane's share)
@pytest.mark.parametrize("mode,n,k,d,bits,g,max_blocks,mma_min_batch", [
    ("gemm", 1, 1024, 512, 4, 128, 3, 9),
    ("gemm", 2, 1028, 600, 3, 64, 5, 9),      # rows past a tile, a partial last group
    ("gemm", 1, 2048, 300, 8, 300, 2, 9),     # one group per row, q past 4
    ("accumulate", 2, 1024, 512, 4, 32, 4, 9),
    ("gemm", 2, 1024, 512, 4, 128, 3, 1),     # asked for tensor cores: compact α stays on the LUT kernel
])
def test_emulated_compact_alpha_matches_full_alpha(emulator, tmp_path, mode, n, k, d, bits, g, max_blocks,
                                                   mma_min_batch):
    bt = bcq_from_uniform(_uniform_module(k, d, bits, g, seed=n + bits).qtensor())
    compact = lutgemm.power_of_two_planes(bt.alpha)
    assert compact is not None and compact.shape == (bt.alpha.shape[0], 1, k)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(k)).half()
    out_name, dtype = ("y.bin", np.float16) if mode == "gemm" else ("acc.bin", np.float32)
    outputs = []
    for alpha, planes, mma in ((bt.alpha, [], 9), (compact, [1], mma_min_batch)):
        for name, t in (("qweight", bt.qweight), ("alpha", alpha), ("offset", bt.offset), ("x", x)):
            _save(tmp_path, name, t)
        _emulate(emulator, tmp_path, [mode, tmp_path, n, d, k, bits, g, 1, 0, max_blocks, mma, *planes])
        outputs.append(torch.from_numpy(np.fromfile(tmp_path / out_name, dtype=dtype).reshape(n, k)))
    assert not torch.isnan(outputs[0]).any()
    # fp16 outputs: rounding the two fp32 sums may land one ulp apart
    assert rel_err(outputs[1], outputs[0].double()) < (COMPACT_TOL if mode == "accumulate" else 1e-3)
    assert rel_err(outputs[1], reference(x, bt)) < TOL


def test_emulated_compact_alpha_refused_past_two_rows(emulator, tmp_path):
    bt = bcq_from_uniform(_uniform_module(64, 128, 4, 64).qtensor())
    for name, t in (("qweight", bt.qweight), ("alpha", bt.alpha[:, :1].contiguous()), ("offset", bt.offset),
                    ("x", torch.randn(3, 128).half())):
        _save(tmp_path, name, t)
    args = ["gemm", tmp_path, 3, 128, 64, 4, 64, 1, 0, 1, 9, 1]
    res = subprocess.run([str(emulator), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "compact alpha" in res.stderr


def test_compact_alpha_rows_agree_with_the_kernel_header():
    header = (build.SOURCE_DIR / "lutgemm_common.cuh").read_text()
    assert f"constexpr int kCompactAlphaMaxBatch = {lutgemm.COMPACT_ALPHA_MAX_TOKENS};" in header


def test_power_of_two_planes_only_where_exact():
    bt = bcq_from_uniform(_uniform_module(64, 256, 4, 64).qtensor())
    compact = lutgemm.power_of_two_planes(bt.alpha)
    assert compact.is_contiguous() and torch.equal(compact, bt.alpha[:, :1])
    assert lutgemm.power_of_two_planes(make_bcq(64, 256, 4, 64, True).alpha) is None  # fitted planes
    assert lutgemm.power_of_two_planes(bt.alpha[:, :1].contiguous()) is None  # one plane: nothing to save
    off = bt.alpha.clone()
    off[1, 2, 3] = off[1, 2, 3] * 1.001
    assert lutgemm.power_of_two_planes(off) is None


def test_matvec_alpha_is_decided_once_per_tensor_and_version():
    bt = bcq_from_uniform(_uniform_module(64, 256, 4, 64).qtensor())
    module, alpha = QuantLinear(bt), bt.alpha.clone()
    first = lutgemm.matvec_alpha(module, alpha, 1)
    assert first.shape[1] == 1 and lutgemm.matvec_alpha(module, alpha, 2) is first
    assert lutgemm.matvec_alpha(module, alpha, lutgemm.COMPACT_ALPHA_MAX_TOKENS + 1) is alpha
    alpha[0, 1, 0] += 1.0  # written in place: no longer power-of-two planes
    assert lutgemm.matvec_alpha(module, alpha, 1) is alpha


@pytest.mark.parametrize("k,d,q,g,offset,dtype", [
    (40, 100, 3, 48, True, torch.float16),    # group boundaries inside words, partial last group
    (64, 256, 2, 128, False, torch.bfloat16),
    (33, 577, 4, 128, True, torch.float32),   # rows not a multiple of the 32-row tile, odd width
    (100, 300, 1, 7, True, torch.float16),
    (64, 512, 8, 512, True, torch.bfloat16),
])
def test_emulated_dequantize_is_exact(emulator, tmp_path, k, d, q, g, offset, dtype):
    qt = make_bcq(k, d, q, g, offset, seed=k + d)
    _save(tmp_path, "qweight", qt.qweight)
    _save(tmp_path, "alpha", qt.alpha)
    if offset:
        _save(tmp_path, "offset", qt.offset)
    out_bytes = {torch.float16: 2, torch.bfloat16: 3, torch.float32: 4}[dtype]
    _emulate(emulator, tmp_path, ["dequant", tmp_path, d, k, q, g, int(offset), out_bytes])
    w = torch.from_numpy(np.fromfile(tmp_path / "w.bin", dtype=np.uint8)).view(dtype).reshape(k, d)
    assert torch.equal(w, qt.dequantize(dtype))  # NaN start: equality also proves every element was written


# ---- GPU: the compiled extension ----------------------------------------------------------------

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops(requires):
    return requires("lutgemm")  # what lutgemm.kernels() returns where it is built


def _random_cases(count, seed):
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        n = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 8, 12, 17])
        k = 4 * rng.randint(1, 900)
        d = rng.choice([rng.randint(8, 3000), 32 * rng.randint(1, 96)])
        q = rng.randint(1, 8)
        g = rng.choice([32, 64, 128, 256, d])
        cases.append((n, k, d, q, g, rng.random() < 0.5, rng.random() < 0.5))
    return cases


_SHARED_WS = {}


def _lut_gemm(ops, x, qt, bias, mma_min_batch=9, kept_workspace=False):
    """One call into fresh NaN poison. kept_workspace: on one zero buffer shared by every such call of the
    test run (as QuantLinear keeps one per module), which the kernels must leave zero."""
    out = torch.full((x.shape[0], qt.shape[0]), float("nan"), dtype=torch.float16, device=x.device)
    ws = None
    if kept_workspace:
        need = ops.workspace_floats(x.shape[0], qt.shape[0])
        shared = _SHARED_WS.get(x.device)
        if shared is None or shared.numel() < need:
            shared = _SHARED_WS[x.device] = torch.zeros(max(need, 1 << 20), dtype=torch.float32, device=x.device)
        ws = shared[:need]
    ops.lut_gemm(x, qt.qweight, qt.alpha, qt.offset, bias, qt.group_size, out, mma_min_batch, ws)
    if kept_workspace:
        assert not shared.any(), "the kernels left partial sums or counters in the workspace"
    return out


# mma_min_batch 9: LUT kernel only; 1: the tensor-core kernel wherever the groups allow it
KERNELS = pytest.mark.parametrize("mma_min_batch", [9, 1], ids=["lut", "mma"])


@gpu
@KERNELS
@pytest.mark.parametrize("n,k,d,q,g,offset,bias", _random_cases(40, seed=8))
def test_lut_gemm_random_shapes(ops, n, k, d, q, g, offset, bias, mma_min_batch):
    if mma_min_batch == 1:  # the tensor-core kernel takes whole 128-column chunks per group
        g = 128 * max(1, g // 128) if g != d else d
    qt = make_bcq(k, d, q, g, offset, seed=k + d + q, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, d, device="cuda", generator=gen).half()
    b = (torch.randn(k, device="cuda", generator=gen) * 0.1).half() if bias else None
    # fresh poison each run: a later run must not lean on an earlier one's output; the kept workspace runs
    # after every earlier case's on the same buffer
    for kept in (False, True, True):
        y = _lut_gemm(ops, x, qt, b, mma_min_batch, kept_workspace=kept)
        assert not torch.isnan(y).any()
        assert rel_err(y, reference(x, qt, b)) < TOL


@gpu
@KERNELS
@pytest.mark.parametrize("k,d", [(4096, 4096), (11008, 4096), (4096, 11008)])
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("q,g", [(2, 128), (3, -1), (4, 128)])
def test_lut_gemm_model_shapes(ops, k, d, n, q, g, mma_min_batch):
    qt = make_bcq(k, d, q, d if g == -1 else g, offset=False, seed=q, device="cuda")
    x = torch.randn(n, d, device="cuda").half()
    y = _lut_gemm(ops, x, qt, None, mma_min_batch, kept_workspace=True)
    assert not torch.isnan(y).any()
    assert rel_err(y, reference(x, qt)) < TOL


@gpu
@pytest.mark.parametrize("k,d,q,g,offset", [(40, 100, 3, 48, True), (4096, 4096, 3, 128, False),
                                            (33, 577, 4, 128, True), (1000, 3000, 8, 7, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_is_exact(ops, k, d, q, g, offset, dtype):
    qt = make_bcq(k, d, q, g, offset, seed=d, device="cuda")
    out = torch.full((k, d), float("nan"), dtype=dtype, device="cuda")
    ops.dequantize(qt.qweight, qt.alpha, qt.offset, qt.group_size, out)
    assert torch.equal(out, qt.dequantize(dtype))


@gpu
@pytest.mark.parametrize("n,k,d,bits,g", [(1, 4096, 4096, 4, 128), (2, 1028, 600, 3, 64), (1, 2048, 300, 8, 300)])
def test_compact_alpha_matches_full_alpha(ops, n, k, d, bits, g):
    bt = bcq_from_uniform(_uniform_module(k, d, bits, g, seed=n).qtensor()).to("cuda")
    compact = lutgemm.power_of_two_planes(bt.alpha)
    x = torch.randn(n, d, device="cuda").half()
    outs, sums = [], []
    for alpha in (bt.alpha, compact):
        out = torch.full((n, k), float("nan"), dtype=torch.float16, device="cuda")
        ops.lut_gemm(x, bt.qweight, alpha, bt.offset, None, bt.group_size, out, 9, None, 1)  # one block: fixed order
        outs.append(out)
        acc = torch.zeros(n * k, dtype=torch.float32, device="cuda")
        ops.lut_accumulate(x, bt.qweight, alpha, bt.offset, bt.group_size, acc, 9, 1)
        sums.append(acc)
    assert rel_err(sums[1], sums[0].double()) < COMPACT_TOL and rel_err(outs[1], outs[0].double()) < 1e-3
    assert rel_err(outs[1], reference(x, bt)) < TOL


@gpu
def test_errors_name_the_problem(ops):
    qt = make_bcq(64, 128, 2, 32, offset=True, device="cuda")
    x = torch.randn(1, 128, device="cuda").half()
    out = torch.empty(1, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="fp16"):
        ops.lut_gemm(x.float(), qt.qweight, qt.alpha, qt.offset, None, 32, out)
    with pytest.raises(RuntimeError, match="words per row"):
        ops.lut_gemm(torch.randn(1, 200, device="cuda").half(), qt.qweight, qt.alpha, qt.offset, None, 32, out)
    with pytest.raises(RuntimeError, match="alpha"):
        ops.lut_gemm(x, qt.qweight, qt.alpha[:1].contiguous(), qt.offset, None, 32, out)
    x3 = torch.randn(3, 128, device="cuda").half()
    with pytest.raises(RuntimeError, match="compact alpha"):  # plane 0's α only serves up to 2 rows
        ops.lut_gemm(x3, qt.qweight, qt.alpha[:, :1].contiguous(), qt.offset, None, 32,
                     torch.empty(3, 64, dtype=torch.float16, device="cuda"))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.lut_gemm(x, qt.qweight, qt.alpha, qt.offset, None, 32, out[:, :32].contiguous())
    odd = make_bcq(62, 128, 2, 32, offset=False, device="cuda")
    with pytest.raises(RuntimeError, match="out_features % 4"):
        ops.lut_gemm(x, odd.qweight, odd.alpha, None, None, 32, torch.empty(1, 62, dtype=torch.float16, device="cuda"))
    split = make_bcq(64, 128, 2, 48, offset=False, device="cuda")
    with pytest.raises(RuntimeError, match="group_size % 32"):
        ops.lut_gemm(x, split.qweight, split.alpha, None, None, 48, out)


@gpu
@pytest.mark.parametrize("n,k,d,q,g,offset,mma_min_batch", [
    (1, 4096, 4096, 3, 128, True, 9), (1, 11008, 4096, 4, 128, False, 9), (3, 1028, 1000, 2, 64, True, 9),
    (8, 4096, 11008, 3, 128, False, 5), (12, 1100, 520, 2, 520, True, 5),
])
def test_accumulate_adds_the_sums_and_leaves_the_counters(ops, n, k, d, q, g, offset, mma_min_batch):
    qt = make_bcq(k, d, q, g, offset, seed=k + n, device="cuda")
    x = torch.randn(n, d, device="cuda").half()
    need = ops.workspace_floats(n, k)
    ws = torch.zeros(need + 8, dtype=torch.float32, device="cuda")
    ws[need:] = float("nan")  # nothing past the workspace is touched
    start = torch.randn(n, k, device="cuda")
    ws[: n * k] = start.flatten()  # accumulate adds to whatever is there
    ops.lut_accumulate(x, qt.qweight, qt.alpha, qt.offset, qt.group_size, ws, mma_min_batch)
    sums = ws[: n * k].view(n, k) - start
    ref = reference(x, qt)
    assert rel_err(sums, ref) < TOL
    assert not ws[n * k : need].any() and ws[need:].isnan().all()  # tile counters untouched
    # cleared by the consumer, the same buffer serves an ordinary call, which leaves it zero
    ws[: n * k] = 0
    out = torch.full((n, k), float("nan"), dtype=torch.float16, device="cuda")
    ops.lut_gemm(x, qt.qweight, qt.alpha, qt.offset, None, qt.group_size, out, mma_min_batch, ws[:need])
    assert rel_err(out, ref) < TOL and not ws[:need].any()
    assert (out.float() - sums).abs().max() <= 1e-3 * ref.abs().max()  # the same sums, up to atomics' order
    with pytest.raises(RuntimeError, match="acc must be"):
        ops.lut_accumulate(x, qt.qweight, qt.alpha, qt.offset, qt.group_size, ws[: n * k - 1], mma_min_batch)


@gpu
@KERNELS
def test_cuda_graph_capture(ops, mma_min_batch):
    qt = make_bcq(4096, 4096, 3, 128, offset=True, device="cuda")
    x = torch.randn(4, 4096, device="cuda").half()
    out = torch.empty(4, 4096, dtype=torch.float16, device="cuda")
    ops.lut_gemm(x, qt.qweight, qt.alpha, qt.offset, None, 128, out, mma_min_batch)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.lut_gemm(x, qt.qweight, qt.alpha, qt.offset, None, 128, out, mma_min_batch)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(x, qt)) < TOL


@gpu
@KERNELS
@pytest.mark.parametrize("n", [1, 8])
def test_overlapped_chain_waits_for_its_input(ops, n, mma_min_batch):
    """Launched with overlap (kernels/overlap.py), a kernel starts before the previous one ends and must
    wait for it before reading x: a chain of matvecs, each on the previous one's output, eagerly and in a
    CUDA graph, with every output poisoned before each run. Each link equals the reference on the input it
    got, and the chain ends where the same chain launched without overlap does (not bit for bit: the
    split-K atomics add in a different order from run to run). 8192 x 4096 and back: at the default grid
    both kernels' blocks run more than one step, so the prologue and the ring's refills both overlap."""
    shapes = [(8192, 4096), (4096, 8192)] * 2  # (out, in); α as make_bcq draws them keep the activations' size
    links = [make_bcq(k, d, q, 128, offset=q == 3, seed=10 + i, device="cuda")
             for i, ((k, d), q) in enumerate(zip(shapes, (2, 3, 4, 3)))]
    x = torch.randn(n, shapes[0][1], device="cuda").half()
    outs = {flag: [torch.empty(n, k, dtype=torch.float16, device="cuda") for k, _ in shapes] for flag in (False, True)}
    workspaces = [torch.zeros(ops.workspace_floats(n, k), dtype=torch.float32, device="cuda") for k, _ in shapes]

    def chain(flag):
        inp = x
        for qt, out, ws in zip(links, outs[flag], workspaces):
            ops.lut_gemm(inp, qt.qweight, qt.alpha, qt.offset, None, 128, out, mma_min_batch, ws, overlap=flag)
            inp = out

    for _ in replay_chains(chain, x, outs):
        inp = x
        for qt, out in zip(links, outs[True]):
            assert rel_err(out, reference(inp, qt)) < TOL
            inp = out
        assert rel_err(outs[True][-1], outs[False][-1].double()) < TOL
        assert not any(ws.any() for ws in workspaces)


@gpu
@pytest.mark.parametrize("fmt", ["bcq", "rtn-asym", "rtn-sym"])
@pytest.mark.parametrize("tokens", [1, 5, lutgemm.MATVEC_MAX_TOKENS, 64])
def test_quant_linear_on_cuda(ops, fmt, tokens):
    torch.manual_seed(tokens)
    k, d = 1536, 576  # SmolLM2's MLP: 576 = 4·128 + 64, a partial last group
    if fmt == "bcq":
        qtensor = make_bcq(k, d, 3, 128, offset=True, seed=1)
    else:
        codes, scales, zeros, g = rtn_quantize(torch.randn(k, d) * 0.02, 4, 128, fmt == "rtn-sym")
        qtensor = UniformQuantizedTensor.from_codes(codes, scales, zeros, 4, g, fmt == "rtn-sym")
    module = QuantLinear(qtensor, bias=torch.randn(k) * 0.1, compute_dtype=torch.float16).cuda()
    x = torch.randn(2, tokens, d, device="cuda").half()
    y = module(x)
    module.use_kernels = False
    module._cached = None
    ref = module(x)
    assert y.shape == ref.shape == (2, tokens, k) and y.dtype == torch.float16
    assert rel_err(y.float(), ref.double()) < TOL
    if fmt != "bcq":
        assert module._lutgemm_bcq[0] == x.device  # converted once, kept on the module


@gpu
def test_deterministic_mode_repeats_bit_for_bit(ops, deterministic, monkeypatch):
    """A decode-sized call repeated 20 times: bit-identical under torch's deterministic mode (the LUT
    kernel gave 50 distinct outputs in 50 calls on this shape on an H100 without it)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what torch's deterministic cuBLAS asks for
    qt = make_bcq(11008, 4096, 3, 128, offset=False, seed=2)
    module = QuantLinear(qt, compute_dtype=torch.float16).cuda()
    x = torch.randn(1, 4096, device="cuda").half()
    first = module(x)
    assert all(torch.equal(module(x), first) for _ in range(20))
    assert rel_err(first.float().cpu(), reference(x.cpu(), qt)) < TOL


@gpu
def test_quant_linear_uniform_with_g_idx_uses_the_reference(ops):
    module = _uniform_module(g_idx=True).cuda()
    x = torch.randn(3, 160, device="cuda")
    y = module(x)
    assert not hasattr(module, "_lutgemm_bcq")
    module.use_kernels = False
    assert torch.equal(y, module(x))
