"""The C++ any-precision path (kernels/anyprec_cpu.cpp via methods/kmeans_native.py): exactness
against the plain-Python reference (tests/anyprec_reference.py) and brute force, quality against the torch
path, determinism, and the fallback when the extension cannot be built."""

import itertools
import warnings

import pytest
import torch

import anyprec_reference as ref
from quantkit.errors import QuantkitError
from quantkit.methods import kmeans_native as kn
from quantkit.methods import make_method
from quantkit.methods.anyprec import upscale as torch_upscale
from quantkit.methods.kmeans import SortedRows, kmeans_runs

needs_ext = pytest.mark.requires("anyprec_cpu")


def _rows(kind, rows, n, seed):
    """(weights fp32 [rows, n], sensitivity fp64 [rows, n]): gaussian with a few outliers, or heavy-tailed."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(rows, n, generator=g) * 0.05
        x[:, :3] *= 8
    else:  # a gaussian over the root of a uniform: heavy tails, a few very large values per row
        x = torch.randn(rows, n, generator=g) / (torch.rand(rows, n, generator=g) + 1e-3).sqrt() * 0.01
    w = torch.rand(rows, n, generator=g, dtype=torch.float64) ** 2 + 1e-3
    return x, w


def _assert_same(a, b, bits):
    assert torch.equal(a.codes, b.codes)
    for k in bits:
        assert torch.allclose(a.luts[k], b.luts[k], rtol=1e-12, atol=1e-15), k
        assert torch.allclose(a.sse[k], b.sse[k], rtol=1e-9, atol=1e-18), k


@needs_ext
@pytest.mark.parametrize("kind,s,p,columns", [("gauss", 2, 4, False), ("heavy", 2, 5, True), ("gauss", 3, 5, True),
                                              ("heavy", 1, 3, False), ("gauss", 3, 3, True)])
def test_native_equals_reference(kind, s, p, columns):
    """Divide and conquer, Knuth bounds and pruning give exactly the brute-force result."""
    x, w = _rows(kind, 5, 70, seed=s * 10 + p)
    if columns:
        w = w[0]  # one sensitivity per column, broadcast over the rows
    native = kn.native_anyprec(x, w, s, p, threads=2)
    _assert_same(native, ref.reference_anyprec(x, w, s, p), range(s, p + 1))


@needs_ext
def test_seed_is_the_exact_optimum():
    """The seed DP against every partition of the sorted values into K runs (tiny rows)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 10, generator=g)
    x[:, 0] = x[:, 1]  # equal values share a cluster
    w = torch.rand(6, 10, generator=g, dtype=torch.float64) + 0.1
    for K in (2, 3, 4):
        inertia = kn.native_kmeans_exact(x, w, K)
        for r in range(6):
            row = ref.RefRow(x[r].tolist(), w[r].tolist())
            best = min(sum(row.S(a, b) for a, b in zip((0,) + cuts, cuts + (row.m,)))
                       for cuts in itertools.combinations(range(1, row.m), K - 1))
            assert inertia[r].item() == pytest.approx(best, rel=1e-12, abs=1e-15)


def _torch_levels(x, w, s, p):
    sr = SortedRows(x, w.expand_as(x))
    starts, centroids = kmeans_runs(sr, 2**s)
    starts, _ = torch_upscale(sr, starts, centroids, s, p)
    return torch.stack([sr.run_sse(starts[:, :: 2 ** (p - b)]).sum() for b in range(s, p + 1)])


@needs_ext
@pytest.mark.parametrize("kind,seed", [("gauss", 7), ("gauss", 9), ("heavy", 8)])
def test_quality_against_torch_path(kind, seed):
    """The native seed is the exact optimum, so never above the torch heuristic's SSE; the finer widths are
    not asserted: greedy splits of a better seed land up to ~3 % either side of the torch path's."""
    s, p = 3, 8
    x, w = _rows(kind, 24, 576, seed=seed)
    torch_sse = _torch_levels(x, w, s, p)
    split = kn.native_anyprec(x, w, s, p)
    assert split.sse[s].sum() <= torch_sse[0] * (1 + 1e-9)


@needs_ext
@pytest.mark.parametrize("isa", ["generic", "auto"])
def test_codes_nest_and_tables_are_cluster_means(isa):
    s, p = 2, 6
    x, w = _rows("heavy", 9, 200, seed=5)
    res = kn.native_anyprec(x, w, s, p, isa=isa)
    assert res.codes.dtype == torch.uint8 and res.codes.shape == x.shape and int(res.codes.max()) < 2**p
    for b in range(s, p + 1):
        code = res.codes.long() >> (p - b)  # the b-bit code is the top b bits of the parent code
        mass = torch.zeros(9, 2**b, dtype=torch.float64).scatter_add_(1, code, w)
        moment = torch.zeros(9, 2**b, dtype=torch.float64).scatter_add_(1, code, w * x.double())
        used = mass > 0
        assert torch.allclose(res.luts[b][used], (moment / mass.clamp_min(1e-300))[used], rtol=1e-9, atol=1e-15)
        sse = (w * (x.double() - torch.gather(res.luts[b], 1, code)) ** 2).sum(1)
        assert torch.allclose(res.sse[b], sse, rtol=1e-9)
    errors = torch.stack([res.sse[b].sum() for b in range(s, p + 1)])
    assert (errors[1:] < errors[:-1]).all(), errors  # each extra bit refines every cluster


@needs_ext
def test_deterministic_and_independent_of_threads():
    x, w = _rows("gauss", 40, 96, seed=11)
    runs = [kn.native_anyprec(x, w[0], 3, 6, threads=t) for t in (1, 2, 3, 2)]
    for other in runs[1:]:
        assert torch.equal(runs[0].codes, other.codes)
        for b in range(3, 7):
            assert torch.equal(runs[0].luts[b], other.luts[b]) and torch.equal(runs[0].sse[b], other.sse[b])


@needs_ext
@pytest.mark.parametrize("kind,rows,n,s,p", [("gauss", 12, 576, 3, 8), ("heavy", 7, 333, 2, 7), ("gauss", 5, 61, 3, 3)])
def test_instruction_sets_agree(kind, rows, n, s, p):
    """The AVX2 scans (four candidates per step) and the plain ones give the same bits, also on degenerate
    rows (ties, zero weights, fewer distinct values than clusters)."""
    if kn.native_isa("avx2") != "avx2":
        pytest.skip("this CPU has no AVX2")
    x, w = _rows(kind, rows, n, seed=n + s)
    x[0, : n // 2] = x[0, n // 2 :][: n // 2]  # duplicated values
    x[1] = torch.round(x[1] * 50) / 50  # few distinct values
    w[2, ::3] = 0.0  # zero sensitivities
    plain = kn.native_anyprec(x, w, s, p, isa="generic")
    fast = kn.native_anyprec(x, w, s, p, isa="avx2")
    assert torch.equal(plain.codes, fast.codes)
    for b in range(s, p + 1):
        assert torch.equal(plain.luts[b], fast.luts[b]) and torch.equal(plain.sse[b], fast.sse[b])
    for K in (2**s, 2 ** (s + 1)):
        a = kn.native_kmeans_exact(x, w, K, isa="generic", cuts=True)
        b = kn.native_kmeans_exact(x, w, K, isa="avx2", cuts=True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_ext
@pytest.mark.parametrize("isa", ["generic", "auto"])
def test_long_rows_equal_reference(isa):
    """Rows of a few hundred distinct values, where the DP layers are pruned by the upper bound and the
    scans run several steps: still exactly the brute-force reference."""
    x, w = _rows("heavy", 2, 240, seed=1)
    _assert_same(kn.native_anyprec(x, w, 3, 6, isa=isa), ref.reference_anyprec(x, w, 3, 6), range(3, 7))
    x, w = _rows("gauss", 2, 180, seed=2)
    for K in (4, 16):
        cuts, inertia = kn.native_kmeans_exact(x, w, K, isa=isa, cuts=True)
        for r in range(2):
            row = ref.RefRow(x[r].tolist(), w[r].tolist())
            assert cuts[r].tolist() == ref.ref_kmeans_dp(row, K)
            assert inertia[r].item() == pytest.approx(sum(row.S(a, b) for a, b in zip(cuts[r][:-1].tolist(),
                                                                                     cuts[r][1:].tolist())), rel=1e-12)


@needs_ext
def test_sse_per_width_against_independent_kmeans():
    """On a 576-wide matrix: split's seed is the independent exact k-means at the seed width, and every
    finer width costs at least the independent exact k-means of that width (nesting is a constraint)."""
    s, p = 3, 8
    x, w = _rows("gauss", 48, 576, seed=3)
    split = kn.native_anyprec(x, w[0], s, p)
    exact = kn.native_kmeans_exact(x, w[0], 2**s).sum()
    assert split.sse[s].sum().item() == pytest.approx(exact.item(), rel=1e-12)
    for b in range(s + 1, p + 1):
        assert split.sse[b].sum() >= kn.native_kmeans_exact(x, w[0], 2**b).sum() * (1 - 1e-12)  # nesting costs


def test_isa_argument_is_checked():
    with pytest.raises(QuantkitError, match="isa"):
        kn.native_anyprec(torch.zeros(2, 4), torch.ones(4), 1, 2, isa="sse9")


@needs_ext
def test_degenerate_rows_and_bad_input():
    # fewer distinct values than clusters, -0 and +0, zero-weight columns, one column
    x = torch.tensor([[0.0, -0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 5.0], [3.0] * 8])
    w = torch.tensor([1.0, 2.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    res = kn.native_anyprec(x, w, 2, 4)
    _assert_same(res, ref.reference_anyprec(x, w, 2, 4), range(2, 5))
    for b in range(2, 5):
        assert torch.isfinite(res.luts[b]).all()
    assert res.sse[4].abs().max() < 1e-12  # 4 distinct values fit exactly
    deq = torch.gather(res.luts[4], 1, res.codes.long())
    assert torch.equal(deq[:, :2], torch.zeros(2, 2, dtype=torch.float64).index_fill_(0, torch.tensor([1]), 3.0))
    one = kn.native_anyprec(torch.tensor([[0.5], [-1.0]]), torch.ones(1, dtype=torch.float64), 1, 3)
    assert torch.equal(torch.gather(one.luts[3], 1, one.codes.long()).float(), torch.tensor([[0.5], [-1.0]]))
    bad = x.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(QuantkitError, match="row 1"):
        kn.native_anyprec(bad, w, 2, 4)
    with pytest.raises(QuantkitError, match="sensitivity"):
        kn.native_anyprec(x, -w, 2, 4)
    with pytest.raises(QuantkitError, match="upscale"):
        make_method("anyprec", upscale="greedy")
    # the extension's two entry points check their inputs alike (the Python wrappers normally shape them)
    ext = kn.extension()
    entry_points = {"kmeans_exact": lambda W, sens: ext.kmeans_exact(W, sens, 2, 1, "auto"),
                    "anyprec_cpu": lambda W, sens: ext.quantize(W, sens, 2, 4, 1, "auto")}
    for name, call in entry_points.items():
        with pytest.raises(RuntimeError, match=f"{name}: sensitivity must be"):
            call(x, torch.cat([w, w]))  # 2n values: neither [n] nor [R, n]
        with pytest.raises(RuntimeError, match=f"{name}: W must be a contiguous fp32 CPU matrix"):
            call(x.double(), w)


@needs_ext
def test_methods_use_the_native_path():
    torch.manual_seed(0)
    weight = torch.randn(32, 96) * 0.02
    x = torch.randn(64, 96) * torch.rand(96) * 3
    stats = {"xtx": x.t() @ x, "nsamples": 4, "ntokens": 64}
    sens = stats["xtx"].diagonal().double()
    sens = sens + 1e-6 * sens.mean()
    sq, info = make_method("squeezellm", bits=3).quantize(weight, stats)
    assert info["weighted_sse"] == pytest.approx(kn.native_kmeans_exact(weight, sens, 8).sum().item(), rel=1e-9)
    split, info = make_method("anyprec", seed_bits=3, parent_bits=6, table_refit="none",
                              upscale="split").quantize(weight, stats)
    assert torch.equal(sq.dequantize(), split.dequantize(bits=3))  # split keeps the squeezellm seed
    for b in range(3, 7):
        assert torch.equal(split.codes(b), split.codes() >> (6 - b))
    err = lambda qt, b: (qt.dequantize(bits=b) - weight).pow(2).mul(sens).sum().item()  # noqa: E731
    assert info["parent_weighted_sse"] == pytest.approx(err(split, 6), rel=1e-2)  # fp16 tables


def test_fallback_without_the_extension(monkeypatch):
    monkeypatch.setattr(kn, "extension", lambda: None)
    weight = torch.randn(8, 40) * 0.02
    assert kn.native_anyprec(weight, torch.ones(40), 2, 3) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the method runs on the torch path without a word
        qt, _ = make_method("anyprec", seed_bits=2, parent_bits=3, sensitivity="none",
                            table_refit="none", upscale="split").quantize(weight, None)
    for b in (2, 3):
        assert torch.equal(qt.codes(b), qt.codes() >> (3 - b))


def test_load_cpu_reports_a_failed_build(monkeypatch, tmp_path):
    from quantkit.kernels import build

    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.delenv("QUANTKIT_NO_KERNELS", raising=False)
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("QUANTKIT_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="broken"):
        assert build.load_cpu("broken") is None
    assert build.load_cpu("broken") is None  # remembered: no second build, no second warning
    monkeypatch.setenv("QUANTKIT_NO_KERNELS", "1")
    assert build.load_cpu("absent") is None


def test_no_kernels_cuda_keeps_the_cpu_extension(monkeypatch, tmp_path):
    from quantkit.kernels import build

    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("QUANTKIT_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QUANTKIT_NO_KERNELS", "cuda")
    assert build.unavailable_reason("gptq") == "QUANTKIT_NO_KERNELS=cuda" and build.load("gptq") is None
    with pytest.warns(UserWarning, match="no source"):  # the CPU loader still tries: it looks for the source
        assert build.load_cpu("absent") is None


@needs_ext
def test_cli_records_the_upscale_rule(tiny_llama_dir, tmp_path, data_dir):
    """--upscale is a command-line choice every anyprec artifact records; a dropped rule is refused."""
    import json

    from click.testing import CliRunner

    from quantkit.cli import main

    out = tmp_path / "ap"
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--method", "anyprec", "--seed-bits", "2",
                                  "--parent-bits", "3", "--sensitivity", "none", "--table-refit", "none",
                                  "--upscale", "split", "--out", str(out), "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["upscale"] == "split"
    result = runner.invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--method", "anyprec",
                                  "--upscale", "joint", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2, result.output
