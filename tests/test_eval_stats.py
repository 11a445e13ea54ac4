"""Perplexity's standard error and the KL divergence / top-1 agreement against a reference model:
exact at the fixed points (a model against itself), consistent with a direct computation, and
growing with the distance between the models."""

import math

import pytest
import torch
import torch.nn.functional as F

from quantkit.eval.perplexity import perplexity


@pytest.fixture(scope="module")
def model_and_ids(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (5 * 32 + 7,), generator=torch.Generator().manual_seed(0))
    return model, ids


def _noisy_copy(model, scale, seed=0):
    import copy

    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if name.endswith("proj.weight"):
                param.add_(scale * param.abs().mean() * torch.randn(param.shape, generator=generator))
    return other


def test_stderr_is_over_windows_and_matches_direct_computation(model_and_ids):
    model, ids = model_and_ids
    got = perplexity(model, ids, seqlen=32, progress=False)
    windows = ids[: 5 * 32].view(5, 32)
    with torch.no_grad():
        logits = model(windows).logits
    per_window = torch.stack([F.cross_entropy(logits[i, :-1], windows[i, 1:]) for i in range(5)]).double()
    assert got["windows"] == 5 and got["tokens_scored"] == 5 * 31
    assert got["ppl"] == pytest.approx(math.exp(per_window.mean().item()), rel=1e-6)
    assert got["ppl_stderr"] == pytest.approx(got["ppl"] * per_window.std().item() / math.sqrt(5), rel=1e-5)
    assert perplexity(model, ids, seqlen=32, max_windows=1, progress=False)["ppl_stderr"] is None


def test_against_itself_is_zero_divergence_and_full_agreement(model_and_ids):
    model, ids = model_and_ids
    got = perplexity(model, ids, seqlen=32, progress=False, reference=model)
    assert got["kld_mean"] == pytest.approx(0, abs=1e-7) and got["kld_p99"] == pytest.approx(0, abs=1e-6)
    assert got["top1_agreement"] == 1.0 and got["reference_ppl"] == got["ppl"]


def test_divergence_grows_with_the_perturbation_and_agrees_with_a_direct_sum(model_and_ids):
    model, ids = model_and_ids
    small = perplexity(_noisy_copy(model, 0.05), ids, seqlen=32, progress=False, reference=model)
    large = perplexity(_noisy_copy(model, 0.5), ids, seqlen=32, progress=False, reference=model)
    assert 0 < small["kld_mean"] < large["kld_mean"] and small["kld_p99"] >= small["kld_mean"]
    assert small["top1_agreement"] >= large["top1_agreement"] and large["top1_agreement"] < 1
    assert small["reference_ppl"] == large["reference_ppl"]

    noisy = _noisy_copy(model, 0.5)
    windows = ids[: 5 * 32].view(5, 32)
    with torch.no_grad():
        p = F.log_softmax(model(windows).logits[:, :-1].double(), -1)
        q = F.log_softmax(noisy(windows).logits[:, :-1].double(), -1)
    direct = (p.exp() * (p - q)).sum(-1)
    assert large["kld_mean"] == pytest.approx(direct.mean().item(), rel=1e-4)


def test_cli_against_reports_divergence_columns_and_json(tiny_llama_dir, data_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from quantkit.cli import main
    from quantkit.pipeline import quantize_checkpoint

    artifact = tmp_path / "rtn3"
    quantize_checkpoint(str(tiny_llama_dir), artifact, "rtn", {"bits": 3, "group_size": 32}, nsamples=0,
                        device="cpu", progress=False, checkpoint=False)
    out = tmp_path / "ppl.json"
    result = CliRunner().invoke(main, ["eval", "ppl", "--model", str(artifact), "--against", str(tiny_llama_dir),
                                       "--seqlen", "32", "--max-windows", "4", "--device", "cpu", "--data-dir",
                                       str(data_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    header = result.stdout.splitlines()[0]  # progress bars go to stderr
    assert "KLD mean" in header and "top-1" in header and " ± " in result.stdout
    row = json.loads(out.read_text())["results"][0]
    assert row["kld_mean"] > 0 and 0 < row["top1_agreement"] <= 1 and row["reference"] == str(tiny_llama_dir)
    assert row["ppl_stderr"] > 0 and row["reference_ppl"] != row["ppl"]
