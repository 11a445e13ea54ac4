"""Any-precision upscaling with the child bits chosen in GPTQ's column sweep (methods/upscale_gptq.py)."""

import pytest
import torch

from gptq_helpers import correlated_inputs, hessian_stats
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.methods import make_method
from quantkit.methods.bcq_output import output_error
from quantkit.methods.kmeans import SortedRows, grouped_rows, split_runs
from quantkit.methods.upscale_gptq import child_sweep, split_children


def _problem(k=32, d=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(k, d, generator=gen) * 0.02
    weight[:, :3] *= 6  # a few outlying columns, as in LLM weights
    return weight, hessian_stats(correlated_inputs(3 * d, d, gen))


def _errors(weight, qt, xtx, bits):
    return output_error(weight.double(), qt.dequantize(bits=bits).double(), xtx.double())


def test_grouped_rows_split_equals_the_sorted_split_on_contiguous_clusters():
    """A k-means partition is a set of sorted runs: grouping its members by code must cut them alike."""
    weight, _ = _problem(k=8, d=96)
    sens = torch.rand(8, 96, generator=torch.Generator().manual_seed(3)) + 0.1
    sr = SortedRows(weight, sens)
    starts = torch.linspace(0, 96, 5).round().long().expand(8, 5).contiguous()  # 4 runs of the sorted rows
    codes = sr.codes(starts)
    want = sr.codes(split_runs(sr, starts, exact=True))
    grouped, gstarts = grouped_rows(weight, sens, codes, 4)
    assert torch.equal(gstarts, starts)
    assert torch.equal(grouped.codes(split_runs(grouped, gstarts, exact=True)), want)


def test_sweep_with_identity_hessian_takes_the_nearest_child():
    weight, _ = _problem()
    gen = torch.Generator().manual_seed(1)
    parent = torch.randint(0, 4, weight.shape, generator=gen)
    table = torch.randn(weight.shape[0], 8, generator=gen, dtype=torch.float64) * 0.02
    low, high = table.gather(1, 2 * parent), table.gather(1, 2 * parent + 1)
    nearest = 2 * parent + ((weight - high).abs() < (weight - low).abs()).long()
    u = torch.eye(weight.shape[1], dtype=torch.float64)
    perm = torch.randperm(weight.shape[1], generator=gen)
    assert torch.equal(child_sweep(weight, u, None, parent, table, block_size=16), nearest)
    assert torch.equal(child_sweep(weight, u, perm, parent, table, block_size=16), nearest)


def test_diagonal_hessian_gives_the_split_codes():
    """No feedback (H diagonal) and k-means tables: the sweep's nearest child is the exact 2-means cut."""
    weight, stats = _problem(seed=2)
    stats = {**stats, "xtx": torch.diag(stats["xtx"].diagonal())}
    settings = {"seed_bits": 2, "parent_bits": 5, "table_refit": "none"}
    split, _ = make_method("anyprec", upscale="split", **settings).quantize(weight, stats)
    gptq, _ = make_method("anyprec", upscale="gptq", **settings).quantize(weight, stats)
    assert torch.equal(gptq.codes(), split.codes())
    for b in range(2, 6):
        torch.testing.assert_close(gptq.luts[b], split.luts[b], rtol=0, atol=0)


@pytest.mark.parametrize("table_refit", ["output", "none"])
def test_codes_nested_seed_exact_and_output_error_below_split_at_4_and_5_bits_near_it_at_6(table_refit):
    weight, stats = _problem()
    settings = {"seed_bits": 3, "parent_bits": 6, "table_refit": table_refit}
    split, _ = make_method("anyprec", upscale="split", **settings).quantize(weight, stats)
    gptq, info = make_method("anyprec", upscale="gptq", **settings).quantize(weight, stats)
    parent = gptq.codes()
    for b in range(3, 7):
        assert torch.equal(gptq.codes(b), parent >> (6 - b))  # nested at every width
    # the seed is independent SqueezeLLM at 3 bits, table and codes, whatever the refit
    seed, _ = make_method("squeezellm", bits=3).quantize(weight, stats)
    assert torch.equal(gptq.dequantize(bits=3), seed.dequantize())
    ratios = [(_errors(weight, gptq, stats["xtx"], b).sum() / _errors(weight, split, stats["xtx"], b).sum()).item()
              for b in range(4, 7)]
    # the feedback gains most at the first widths above the seed; the clusters it mixes (bounded by the band)
    # cost the top widths a little
    assert ratios[0] < 0.8 and ratios[1] < 1 and ratios[2] < 1.15, ratios
    assert set(info["gptq_rows"]) == {4, 5, 6} and info["gptq_rows"][4] > 0


def test_never_above_the_split_of_its_own_parent_row_by_row():
    """The per-row guard: at each width every row is at most the split children of its parent codes."""
    from quantkit.methods.table_refit import refit_table

    weight, stats = _problem(seed=4)
    qt, _ = make_method("anyprec", seed_bits=2, parent_bits=4).quantize(weight, stats)
    w64, h = weight.double(), stats["xtx"].double()
    for b in (3, 4):
        parent = qt.codes(b - 1)
        diag = stats["xtx"].diagonal().double()
        sens = (diag + 1e-6 * diag.mean())[None, :].expand_as(w64)
        codes, table = split_children(w64, sens, parent, qt.luts[b - 1].double(), b - 1)
        table = refit_table(w64, codes, table, h)[0].double().half().double()
        split_err = output_error(w64, table.gather(1, codes), h)
        assert (_errors(weight, qt, stats["xtx"], b) <= split_err * (1 + 1e-9)).all(), b


def test_gptq_artifact_reloads_and_refuses_without_calibration(tmp_path, tiny_llama_dir, data_dir):
    from quantkit.errors import QuantkitError
    from quantkit.pipeline import quantize_checkpoint
    from quantkit.runtime import load_quantized

    weight, stats = _problem(k=16, d=96)
    qt, _ = make_method("anyprec", seed_bits=2, parent_bits=4).quantize(weight, stats)
    again = quantized_tensor_from_state_dict(qt.meta(), qt.state_dict())
    for b in (2, 3, 4):
        assert torch.equal(again.dequantize(bits=b), qt.dequantize(bits=b))
    assert make_method("anyprec", sensitivity="none", table_refit="none").stats == ("hessian",)
    assert make_method("anyprec", sensitivity="none", table_refit="none", upscale="split").stats == ()
    out = tmp_path / "ap"
    summary = quantize_checkpoint(str(tiny_llama_dir), out, "anyprec", {"seed_bits": 2, "parent_bits": 4}, nsamples=4,
                                  seqlen=32, data_dir=data_dir, progress=False)
    assert summary["settings"]["upscale"] == "gptq"
    models = {b: load_quantized(out, bits=b) for b in (2, 3, 4)}
    ids = torch.randint(0, models[2].config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = {b: model(ids).logits for b, model in models.items()}
    assert all(torch.isfinite(t).all() for t in logits.values()) and not torch.allclose(logits[2], logits[4])
    with pytest.raises(QuantkitError, match="calibration"):
        quantize_checkpoint(str(tiny_llama_dir), tmp_path / "x", "anyprec", {"sensitivity": "none",
                            "table_refit": "none"}, nsamples=0, data_dir=data_dir, progress=False)
