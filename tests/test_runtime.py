"""Runtime on the CPU: quantized artifacts generate through QuantLinear exactly as the float model with
the dequantized weights put back; any-precision widths switch at run time; the static-cache decoder
(whose step the benchmark captures in a CUDA graph) matches transformers' generate; `quantkit generate`."""

import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils._python_dispatch import TorchDispatchMode

import quantkit
from factories import save_tiny, tiny_causal_lm
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.pipeline import load_for_eval, quantize_checkpoint
from quantkit.runtime import QuantLinear
from quantkit.runtime.generate import StaticGreedyDecoder, generate_static, generate_text

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


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_decoder_matches_generate(attn, artifact, tiny_tokenizer):
    model = quantkit.load(artifact("bcq"))
    model.set_attn_implementation(attn)
    ids = tiny_tokenizer(PROMPTS[:1] * 2, return_tensors="pt")["input_ids"]  # batch 2 of equal length
    ids[1, -1] = (ids[1, -1] + 7) % model.config.vocab_size  # ...with different contents
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    want, _ = _greedy(model, enc)
    assert not torch.equal(want[0], want[1])
    decoder = StaticGreedyDecoder(model, max_len=ids.shape[1] + NEW_TOKENS, batch_size=2)
    assert torch.equal(decoder.generate(ids, NEW_TOKENS), want)
    assert torch.equal(decoder.generate(ids, NEW_TOKENS), want)  # prefill resets the cache in place
    decoder.prefill(ids)
    with pytest.raises(QuantkitError, match="overflow"):
        decoder.steps(NEW_TOKENS + 1)


def test_static_decoder_steps_bypass_transformers_cache_update(artifact, tiny_tokenizer):
    # decode steps write keys and values at the decoder's position buffer instead of transformers'
    # StaticCache.update (five kernels a layer); only prefill goes through it. Same tokens as generate().
    model = quantkit.load(artifact("rtn"))
    ids = tiny_tokenizer(PROMPTS[1:], return_tensors="pt")["input_ids"]
    want, _ = _greedy(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    decoder = StaticGreedyDecoder(model, max_len=ids.shape[1] + NEW_TOKENS)
    layers_seen = []
    transformers_update = decoder._cache_update
    decoder._cache_update = lambda k, v, layer_idx, *a, **kw: (layers_seen.append(layer_idx),
                                                                 transformers_update(k, v, layer_idx, *a, **kw))[1]
    assert torch.equal(decoder.generate(ids, NEW_TOKENS), want)
    assert layers_seen == list(range(model.config.num_hidden_layers))  # the prefill, once per layer


def test_static_decoder_warm_up_after_full_generation(artifact, tiny_tokenizer):
    # capture() warms up (and records) decode steps on whatever cache the last generate() left full; the
    # StaticCache writes at its own device-side counter, so without a rewind those steps index past
    # max_len (on CUDA a device assert that poisons the process). warm_up is capture's CPU-runnable part.
    model = quantkit.load(artifact("rtn"))
    ids = tiny_tokenizer(PROMPTS[1:], return_tensors="pt")["input_ids"]
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    want, _ = _greedy(model, enc)
    assert len(set(want[0].tolist())) > NEW_TOKENS // 4  # decoding past the prompt goes somewhere
    decoder = StaticGreedyDecoder(model, max_len=ids.shape[1] + NEW_TOKENS)
    decoder.warm_up(2)  # on a fresh cache (capture before any prefill)
    assert torch.equal(decoder.generate(ids, NEW_TOKENS), want)  # every cache slot used
    decoder.warm_up(3)
    with pytest.raises(QuantkitError, match="overflow"):
        decoder.steps(1)  # warm-up junk in the cache: only a prefill may follow
    assert torch.equal(decoder.generate(ids, NEW_TOKENS), want)
    with pytest.raises(QuantkitError, match="do not fit"):
        decoder.warm_up(decoder.max_len)


class _HostReads(TorchDispatchMode):
    """Records ops that copy a device value to the host (forbidden inside CUDA-graph capture)."""

    NAMES = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero",
             "aten::unique_consecutive", "aten::_unique2", "aten::equal"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.NAMES:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_decode_step_reads_nothing_back_to_host(artifact, tiny_tokenizer):
    # what a CUDA graph captures must not synchronise; on the CPU we can check the ops for it
    with _HostReads() as control:
        torch.ones(2).sum().item()
    assert control.seen == ["aten::_local_scalar_dense"]
    model = quantkit.load(artifact("anyprec"), bits=3)
    decoder = StaticGreedyDecoder(model, max_len=32)
    decoder.prefill(tiny_tokenizer(PROMPTS[:1], return_tensors="pt")["input_ids"])
    with torch.inference_mode():
        decoder._step()  # first call fills QuantLinear's weight cache (on CUDA a kernel serves instead)
        with _HostReads() as spy:
            decoder._step()
    assert spy.seen == []


@pytest.mark.parametrize("case", ["kernel-writes", "attention-drops-the-step"])
def test_static_decoder_split_attention_plumbing(artifact, tiny_tokenizer, monkeypatch, case):
    # The decoder's split-attention path, forced on the CPU (on CUDA with Triton it is the default):
    # each layer's new key and value wait on the step until its attention call takes them. Here the
    # registered attention function cannot use the kernel (CPU), so it writes them and runs SDPA: the
    # tokens equal transformers' greedy decode, which also shows that the step reaches every layer
    # through the model's forward kwargs. With an attention that drops the step, the decoder must notice
    # the untaken keys, go back to SDPA and redo the step: the same tokens again.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from quantkit.runtime import decode_attention

    model = quantkit.load(artifact("rtn"))
    ids = tiny_tokenizer(PROMPTS[1:], return_tensors="pt")["input_ids"]
    want, _ = _greedy(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    decoder = StaticGreedyDecoder(model, max_len=ids.shape[1] + NEW_TOKENS)
    decoder.split_attention = True
    decoder._attention_step = decode_attention.DecodeStep(
        decoder.pos, decode_attention.counters(1, model.config.num_attention_heads, "cpu"))
    if case != "attention-drops-the-step":
        got = decoder.generate(ids, NEW_TOKENS)
        assert decoder.split_attention
    else:
        def drops_the_step(module, query, key, value, mask, **kwargs):
            kwargs.pop(decode_attention.STEP_KWARG)
            return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, decode_attention.register(), drops_the_step)
        with pytest.warns(UserWarning, match="did not reach every layer"):
            got = decoder.generate(ids, NEW_TOKENS)
        assert not decoder.split_attention
    assert torch.equal(got, want) and not decoder._attention_step.pending
    assert model.config._attn_implementation == "sdpa"


def test_static_decoder_refuses_an_unknown_attention(artifact):
    with pytest.raises(QuantkitError, match="attention must be one of"):
        StaticGreedyDecoder(quantkit.load(artifact("rtn")), max_len=32, attention="flash")


def test_generate_text_refuses_bad_requests(artifact, tiny_tokenizer):
    model = quantkit.load(artifact("rtn"))
    with pytest.raises(QuantkitError, match="exceeds the model's context"):
        generate_text(model, tiny_tokenizer, PROMPTS[:1], max_new_tokens=300)
    with pytest.raises(QuantkitError, match="empty"):
        generate_text(model, tiny_tokenizer, [""], max_new_tokens=4)
    with pytest.raises(QuantkitError, match="temperature"):
        generate_text(model, tiny_tokenizer, PROMPTS[:1], greedy=False, temperature=0)


def test_cli_generate(artifact, lively_llama_dir, tiny_tokenizer, tmp_path):
    path = artifact("anyprec")
    runner = CliRunner()
    out = tmp_path / "g.json"
    args = ["generate", "--model", str(path), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "8",
            "--bits", "3"]
    result = runner.invoke(main, args + ["--json", str(out)])
    assert result.exit_code == 0, result.output
    (payload,) = json.loads(out.read_text())["runs"]
    api = generate_text(quantkit.load(path, bits=3), tiny_tokenizer, PROMPTS, max_new_tokens=8)
    assert payload["token_ids"] == api["token_ids"] and payload["served_bits"] == 3
    assert payload["tokens_per_s"] > 0 and sum(payload["new_tokens"]) <= 16
    for prompt, completion in zip(PROMPTS, payload["completions"]):
        assert f"{prompt}{completion}" in result.output
    assert "tokens/s" in result.output

    sampled = []
    for _ in range(2):
        result = runner.invoke(main, args + ["--sample", "--seed", "5", "--json", str(out)])
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


def test_generate_static_matches_generate(artifact, tiny_tokenizer, tmp_path):
    # the static-cache path (eager steps on the CPU; CUDA graphs on the device) decodes the same greedy
    # tokens as model.generate, also for a batch of equal-length prompts; unequal lengths are refused
    model = quantkit.load(artifact("bcq"))
    batch = [PROMPTS[0], PROMPTS[0] + " old"]
    assert len({len(tiny_tokenizer(p)["input_ids"]) for p in batch}) == 2  # the second is longer
    same = [PROMPTS[1], PROMPTS[1].replace("band", "team")]
    assert len({len(tiny_tokenizer(p)["input_ids"]) for p in same}) == 1
    want = generate_text(model, tiny_tokenizer, same, max_new_tokens=NEW_TOKENS)
    got = generate_static(model, tiny_tokenizer, same, max_new_tokens=NEW_TOKENS)
    assert got["token_ids"] == want["token_ids"] and got["completions"] == want["completions"]
    assert got["cuda_graph"] is False and got["tokens_per_s"] > 0 and got["prefill_ms"] > 0
    with pytest.raises(QuantkitError, match="tokenize to"):
        generate_static(model, tiny_tokenizer, batch, max_new_tokens=4)
    with pytest.raises(QuantkitError, match="at least 2"):
        generate_static(model, tiny_tokenizer, same, max_new_tokens=1)

    out = tmp_path / "s.json"
    args = ["generate", "--model", str(artifact("bcq")), "--prompt", same[0], "--max-new-tokens", str(NEW_TOKENS)]
    result = CliRunner().invoke(main, args + ["--static-cache", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "static cache, eager steps" in result.output and f"{same[0]}{want['completions'][0]}" in result.output
    (run_,) = json.loads(out.read_text())["runs"]
    assert run_["decoding"]["static_cache"] and run_["token_ids"] == want["token_ids"][:1]
    result = CliRunner().invoke(main, args + ["--static-cache", "--sample"])
    assert result.exit_code == 2 and "decodes greedily" in result.output
