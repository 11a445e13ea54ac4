"""Runtime on the CPU: quantized artifacts generate through QuantLinear exactly as the float model with
the dequantized weights put back; any-precision widths switch at run time; `quantkit generate` with the
transformers model and with the fast decoder (tests/test_fast_model.py holds the decoder itself)."""

import json

import pytest
import torch
from click.testing import CliRunner

import quantkit
from factories import save_tiny, tiny_causal_lm
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.pipeline import load_for_eval, quantize_checkpoint
from quantkit.runtime import QuantLinear
from quantkit.runtime.generate import Sampling, generate

PROMPTS = ["The history of the", "In 1998 the band released"]
NEW_TOKENS = 16

# artifact name -> (method, settings, stored format option, format of its QuantLinear tensors)
SPECS = {
    "rtn": ("rtn", {"bits": 4, "group_size": 32}, None, "uniform"),
    "rtn-bcq": ("rtn", {"bits": 3, "group_size": 32}, "bcq", "bcq"),
    "gptq": ("gptq", {"bits": 3, "group_size": 32}, None, "uniform"),
    "bcq": ("bcq", {"bits": 3, "group_size": 32}, None, "bcq"),
    # the textbook inner GPTQ: on this tiny model every matrix then keeps an odd group (the ooc format)
    "ooc": ("ooc", {"group_size": 32, "act_order": False, "static_groups": False, "clip_search": False}, None, "ooc"),
    "anyprec": ("anyprec", {"seed_bits": 2, "parent_bits": 4}, None, "anyprec"),
}


@pytest.fixture(scope="module")
def lively_llama_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny llama whose greedy continuations vary from token to token: with the default init
    (std 0.02) a random 2-layer model repeats one token forever, which would make token equality
    say little; std 0.3 gives ~20 distinct tokens in 24."""
    model = tiny_causal_lm("llama", vocab=len(tiny_tokenizer), max_positions=256, tie_word_embeddings=True,
                           rope_theta=100000.0, initializer_range=0.3, seed=0)
    return save_tiny(model, tiny_tokenizer, tmp_path_factory.mktemp("lively-llama"))


@pytest.fixture(scope="module")
def artifact(lively_llama_dir, tmp_path_factory, data_dir):
    """artifact(name) -> directory, quantized once per module."""
    made = {}

    def get(name):
        if name not in made:
            method, params, fmt, _ = SPECS[name]
            out = tmp_path_factory.mktemp("art") / name
            quantize_checkpoint(str(lively_llama_dir), out, method, params, nsamples=None if
                                method in ("rtn", "bcq") else 4, seqlen=32, data_dir=data_dir, progress=False, fmt=fmt)
            made[name] = out
        return made[name]

    return get


def _prompt_ids(tokenizer):
    """PROMPTS left-padded with id 0 (the shared tiny tokenizer has no pad token and must not be mutated)."""
    rows = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    assert mask.sum() < mask.numel()  # the prompts differ in length: padding is exercised
    return {"input_ids": ids, "attention_mask": mask}


def _greedy(model, enc):
    """Greedy generation with the KV cache: (new token ids [B, NEW_TOKENS], step logits [B, NEW_TOKENS, V])."""
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                             pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, enc["input_ids"].shape[1]:], torch.stack(out.scores, dim=1)


def _float_twin(src, quantized):
    """The source float model with every quantized linear's dequantized weight put back (and the other
    tensors rounded to fp16, as the artifact stores them)."""
    twin, _, _ = load_for_eval(str(src))
    for param in twin.parameters():
        param.data = param.data.half().float()
    for name, module in quantized.named_modules():
        if isinstance(module, QuantLinear):
            twin.get_submodule(name).weight.data = module.dequantized_weight(torch.float32)
    return twin


def _qlinears(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize("name,bits", [("rtn", None), ("rtn-bcq", None), ("gptq", None), ("bcq", None), ("ooc", None),
                                       ("anyprec", 2), ("anyprec", 4)])
def test_greedy_tokens_equal_dequantized_float_model(name, bits, artifact, lively_llama_dir, tiny_tokenizer):
    model = quantkit.load(artifact(name), bits=bits)
    assert {m.meta["format"] for m in _qlinears(model)} == {SPECS[name][3]}
    assert len(_qlinears(model)) == 14
    enc = _prompt_ids(tiny_tokenizer)

    seen = []  # tokens per forward of one QuantLinear: the prompt once, then one per step if the cache is used
    _qlinears(model)[0].register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    tokens, scores = _greedy(model, enc)
    assert seen == [enc["input_ids"].shape[1]] + [1] * (NEW_TOKENS - 1)

    twin_tokens, twin_scores = _greedy(_float_twin(lively_llama_dir, model), enc)
    assert torch.equal(tokens, twin_tokens)
    assert torch.equal(scores, twin_scores)  # same weights, same ops: bit-identical logits on the CPU
    assert len(set(tokens[0].tolist())) > NEW_TOKENS // 2  # a varied continuation, not one repeated token

    original, _, _ = load_for_eval(str(lively_llama_dir))
    assert not torch.equal(_greedy(original, enc)[1], scores)  # the twin really carries the quantized weights


def test_set_bits_switches_width_without_reload(artifact, tiny_tokenizer):
    path = artifact("anyprec")
    enc = _prompt_ids(tiny_tokenizer)
    model = quantkit.load(path)  # parent width, 4 bits
    parent_tokens, parent_scores = _greedy(model, enc)
    for bits in (2, 3):
        for module in _qlinears(model):
            module.set_bits(bits)
        tokens, scores = _greedy(model, enc)
        fresh_tokens, fresh_scores = _greedy(quantkit.load(path, bits=bits), enc)
        assert torch.equal(tokens, fresh_tokens) and torch.equal(scores, fresh_scores)
        assert not torch.equal(scores, parent_scores)
    for module in _qlinears(model):
        module.set_bits(None)
    tokens, scores = _greedy(model, enc)
    assert torch.equal(tokens, parent_tokens) and torch.equal(scores, parent_scores)


def test_load_refuses_bits_it_cannot_serve(artifact):
    with pytest.raises(QuantkitError, match="any-precision"):
        quantkit.load(artifact("rtn"), bits=3)
    with pytest.raises(QuantkitError, match="not stored"):
        quantkit.load(artifact("anyprec"), bits=5)


def test_generate_refuses_bad_requests(artifact, tiny_tokenizer):
    model = quantkit.load(artifact("rtn"))
    with pytest.raises(QuantkitError, match="exceeds the model's context"):
        generate(model, tiny_tokenizer, PROMPTS[:1], max_new_tokens=300)
    with pytest.raises(QuantkitError, match="empty"):
        generate(model, tiny_tokenizer, [""], max_new_tokens=4)
    with pytest.raises(QuantkitError, match="temperature"):
        Sampling(greedy=False, temperature=0)
    with pytest.raises(QuantkitError, match="chat template"):
        generate(model, tiny_tokenizer, PROMPTS[:1], max_new_tokens=4, chat=True)


def test_cli_generate(artifact, lively_llama_dir, tiny_tokenizer, tmp_path):
    path = artifact("anyprec")
    runner = CliRunner()
    out = tmp_path / "g.json"
    args = ["generate", "--model", str(path), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "8",
            "--bits", "3"]
    result = runner.invoke(main, args + ["--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "runtime: transformers model (the fast decoder runs on CUDA)" in result.output  # auto, on the CPU
    (payload,) = json.loads(out.read_text())["runs"]
    api = generate(quantkit.load(path, bits=3), tiny_tokenizer, PROMPTS, max_new_tokens=8)
    assert payload["token_ids"] == api["token_ids"] and payload["served_bits"] == 3
    assert payload["runtime"] == "transformers" and payload["tokens_per_s"] > 0 and sum(payload["new_tokens"]) <= 16
    for prompt, completion in zip(PROMPTS, payload["completions"]):
        assert f"{prompt}{completion}" in result.output
    assert "tokens/s" in result.output and "ms/token" in result.output

    sampled = []
    for _ in range(2):
        result = runner.invoke(main, args + ["--sample", "--seed", "5", "--top-k", "20", "--json", str(out)])
        assert result.exit_code == 0, result.output
        (run_,) = json.loads(out.read_text())["runs"]
        sampled.append(run_["token_ids"])
    assert sampled[0] == sampled[1]  # seeded

    result = runner.invoke(main, ["generate", "--model", str(path), "--model", str(lively_llama_dir), "--prompt", "x",
                                  "--max-new-tokens", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["model_kind"] for r in runs] == ["artifact", "hf_dir"]

    result = runner.invoke(main, ["generate", "--model", str(lively_llama_dir), "--prompt", "x", "--bits", "3"])
    assert result.exit_code == 2 and "only to any-precision" in result.output


def test_cli_generate_fast_runtime_on_the_cpu(artifact, tiny_tokenizer, tmp_path):
    # --runtime fast forces quantkit's own decoder (eager steps on the CPU): the same greedy tokens as the
    # transformers model, for a batch of prompts of different lengths; stop strings cut the text
    path = artifact("bcq")
    out = tmp_path / "f.json"
    args = ["generate", "--model", str(path), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens",
            str(NEW_TOKENS), "--json", str(out)]
    result = CliRunner().invoke(main, args + ["--runtime", "fast"])
    assert result.exit_code == 0, result.output
    assert "runtime: fast decoder" in result.output and "ms/token" in result.output
    (fast,) = json.loads(out.read_text())["runs"]
    result = CliRunner().invoke(main, args + ["--runtime", "transformers"])
    assert result.exit_code == 0, result.output
    (reference,) = json.loads(out.read_text())["runs"]
    assert fast["runtime"] == "fast" and reference["runtime"] == "transformers"
    assert fast["token_ids"] == reference["token_ids"] and fast["completions"] == reference["completions"]
    stop = fast["completions"][0][3:7]
    result = CliRunner().invoke(main, args + ["--runtime", "fast", "--stop", stop])
    assert result.exit_code == 0, result.output
    (stopped,) = json.loads(out.read_text())["runs"]
    text = stopped["completions"][0]
    assert stop not in text and fast["completions"][0].startswith(text)
    assert len(stopped["token_ids"][0]) < len(fast["token_ids"][0])
