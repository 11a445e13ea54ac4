"""End to end on every architecture quantkit supports, on the CPU: quantize -> artifact -> `quantkit generate`
(and quantkit.load + model.generate) -> the same greedy tokens as transformers' float model with the
dequantized weights put back (tests/arch_oracle.py); `quantkit eval ppl` of the Gemma 3 and mixture-of-experts
artifacts -> the perplexity of that float model on the same windows. tests/test_architectures.py holds the
logits of every architecture and method; this file checks what users run on them."""

import json
import math

import pytest
import torch
from click.testing import CliRunner

import quantkit
from arch_oracle import dequantized_reference, lively, window_ppl
from factories import save_tiny, tiny_causal_lm
from quantkit.cli import main
from quantkit.models import load_tokenizer, resolve_source
from quantkit.pipeline import quantize_checkpoint
from quantkit.runtime import QuantLinear

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gemma2", "gemma3_text", "phi3", "gpt_neox",
                 "qwen3_moe", "mixtral")
PROMPTS = ["The history of the", "In 1998 the band released"]  # different lengths: the batch is padded
NEW_TOKENS = 8  # Gemma's sliding window is 8 tokens: prompt + new tokens run past it
PPL_SEQLEN, PPL_WINDOWS = 64, 2


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one thread


@pytest.fixture(scope="module")
def made(tiny_tokenizer, small_data, tmp_path_factory):
    """made(arch, method) -> (float checkpoint, artifact), each made once: RTN w4 g32, or GPTQ w4 g32
    calibrated on 4 PTB windows of 32 tokens."""
    done = {}

    def get(arch, method):
        if (arch, method) not in done:
            root = tmp_path_factory.mktemp(f"{arch}-{method}")
            model = tiny_causal_lm(arch, vocab=len(tiny_tokenizer), max_positions=256, seed=3, **lively(arch))
            src = save_tiny(model, tiny_tokenizer, root / "float")
            quantize_checkpoint(str(src), root / "art", method, {"bits": 4, "group_size": 32},
                                nsamples=4 if method == "gptq" else 0, seqlen=32, calib="ptb", device="cpu",
                                data_dir=small_data, progress=False, checkpoint=False)
            done[arch, method] = (src, root / "art")
        return done[arch, method]

    return get


def _greedy_alone(model, rows):
    """Each prompt's NEW_TOKENS greedy tokens, one prompt at a time (no padding), end-of-sequence ignored."""
    out = []
    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor([row])
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 use_cache=True, pad_token_id=0, eos_token_id=None)
            out.append(new[0, len(row):].tolist())
    return out


def _cut_at_eos(tokens, eos):
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_gives_the_tokens_of_the_dequantized_float_model(arch, made, tiny_tokenizer, tmp_path):
    src, art = made(arch, "rtn")
    tokenizer = load_tokenizer(resolve_source(str(art)))  # transformers may pick a class by model type (Qwen2's)
    rows = [tokenizer(p)["input_ids"] for p in PROMPTS]
    reference = dequantized_reference(src, art)
    want = _greedy_alone(reference, rows)
    assert len(set(want[0] + want[1])) > NEW_TOKENS // 2, want  # varied continuations, not one repeated token

    out = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["generate", "--model", str(art), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                                       "--max-new-tokens", str(NEW_TOKENS), "--runtime", "auto", "--json", str(out)])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("runtime:")]
    assert notes == ["runtime: transformers model (the fast decoder runs on CUDA)"]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["runtime"] == "transformers" and run["device"] == "cpu" and run["dtype"] == "float32"
    eos = {tokenizer.eos_token_id}  # the CLI ends a row at end-of-sequence (the tiny vocabulary's </s>)
    assert run["token_ids"] == [_cut_at_eos(w, eos) for w in want]
    for prompt, completion in zip(PROMPTS, run["completions"]):
        assert f"{prompt}{completion}" in result.output

    # the Python API: quantkit.load, then transformers' generate on the padded batch
    model = quantkit.load(art)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
        new = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    assert new[:, width:].tolist() == want

    # the oracle carries the quantized weights: the float model's own logits differ
    original = tiny_causal_lm(arch, vocab=len(tiny_tokenizer), max_positions=256, seed=3, **lively(arch))
    prompt = torch.tensor([rows[1]])
    with torch.inference_mode():
        assert not torch.allclose(original(prompt).logits, reference(prompt).logits, atol=1e-3)


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_moe", "mixtral"])
def test_eval_ppl_equals_the_dequantized_float_model(arch, made, data_dir, tmp_path):
    from quantkit.data import eval_tokens

    src, art = made(arch, "gptq")
    out = tmp_path / "ppl.json"
    result = CliRunner().invoke(main, ["eval", "ppl", "--model", str(art), "--dataset", "wikitext2", "--seqlen",
                                       str(PPL_SEQLEN), "--max-windows", str(PPL_WINDOWS), "--device", "cpu",
                                       "--data-dir", str(data_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    (scores,) = json.loads(out.read_text())["results"]
    assert scores["windows"] == PPL_WINDOWS and math.isfinite(scores["ppl"])
    ids, _ = eval_tokens("wikitext2", load_tokenizer(resolve_source(str(art))), PPL_SEQLEN, data_dir)
    want = window_ppl(dequantized_reference(src, art), ids, PPL_SEQLEN, PPL_WINDOWS)
    assert scores["ppl"] == pytest.approx(want, rel=1e-5)
    # and the quantization shows: the float model's own perplexity on those windows is another number
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    assert window_ppl(original, ids, PPL_SEQLEN, PPL_WINDOWS) != pytest.approx(want, rel=1e-4)
