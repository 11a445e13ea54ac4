"""The fast decoder (runtime/model.py, weights.py, ops.py, generate.py) against its oracle, the transformers
model with QuantLinear modules that `quantkit.load` builds (the reference path).

On the CPU (float32, the operators' PyTorch paths; the Triton kernels once more through Triton's
interpreter): for every Llama-family architecture (tiny random llama, mistral, qwen2 with q/k/v biases,
qwen3 with q/k norms) and every format (float; RTN and GPTQ uniform; BCQ; any-precision at two widths), the
fast decoder's greedy tokens equal the reference's and its logits, step by step along the reference's
tokens, agree to float32 rounding (STRICT, relative to the largest logit). Batched prompts of different
lengths decode as each alone; sampling is reproducible and follows its distribution; projections are
stacked exactly; the operators pass torch.library's checks and torch.compile traces a decode step.

On the GPU (fp16, the CUDA and Triton kernels, CUDA graphs): the fast decoder's logits stay within
KERNEL_NOISE_FACTOR of the fp16 reference path's own distance from fp32, greedy tokens agree, and a
captured step decodes as eager steps, batches as single prompts, up to near-ties of the logits (the LUT
kernels add fp32 partial sums in no fixed order: docs/lutgemm-kernel.md#determinism).
"""

import json
import re
from pathlib import Path

import pytest
import torch

import quantkit
from factories import LLAMA_FAMILY, save_tiny, tiny_causal_lm
from quantkit.errors import QuantkitError
from quantkit.pipeline import quantize_checkpoint
from quantkit.runtime import ops
from quantkit.runtime.generate import FastGenerator, Sampling, _picker, pick_greedy, pick_sampled
from quantkit.runtime.model import DecoderConfig, UnsupportedModel, rope_inverse_frequencies
from quantkit.runtime.quant_linear import QuantLinear
from quantkit.runtime.weights import decoder_from_transformers, projection, stack_quantized

REPO = Path(__file__).resolve().parents[1]
STRICT = 2e-5  # float32 on the CPU: same weights, same operations up to summation order
NEW_TOKENS = 12
PROMPTS = [[5, 17, 99, 3, 42, 8, 250, 31, 7], [12, 300, 4, 4], [77, 2, 190, 61, 9, 11]]  # three lengths

# format -> (method, settings) for quantize_checkpoint; None: the float checkpoint itself
FORMATS = {
    "float": None,
    "rtn": ("rtn", {"bits": 4, "group_size": 32}),
    "gptq": ("gptq", {"bits": 3, "group_size": 32}),
    "bcq": ("bcq", {"bits": 3, "group_size": 32}),
    "anyprec": ("anyprec", {"seed_bits": 2, "parent_bits": 4}),
}
CASES = [(arch, fmt, bits) for arch in LLAMA_FAMILY for fmt, bits in
         [("float", None), ("rtn", None), ("gptq", None), ("bcq", None), ("anyprec", 2), ("anyprec", 4)]]


WORDS = ("the of and to in a is was for on as by with he at from that his it an were are which this be "
         "first new city river north game season film album band song team war school town world year").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A seeded text of common words, as a calibration file: no dataset needed, on any machine."""
    gen = torch.Generator().manual_seed(0)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (6000,), generator=gen).tolist()]
    path = tmp_path_factory.mktemp("corpus") / "calibration.txt"
    path.write_text("\n\n".join(" ".join(words[i : i + 60]) for i in range(0, len(words), 60)))
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus):
    """A byte-level BPE tokenizer of 384 entries trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus.read_text()], trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _checkpoints(tokenizer, corpus, tmp_path_factory, formats, sizes, nsamples, seqlen):
    """checkpoint(arch, fmt) -> directory: the tiny float model of `arch`, or its artifact quantized in `fmt`
    (calibrated on the corpus), made once."""
    made = {}

    def get(arch, fmt="float"):
        if (arch, fmt) not in made:
            if fmt == "float":
                model = tiny_causal_lm(arch, vocab=len(tokenizer), max_positions=256, seed=0, **sizes,
                                       **({"attention_bias": True} if arch == "llama" else {}))
                made[arch, fmt] = save_tiny(model, tokenizer, tmp_path_factory.mktemp(arch))
            else:
                method, params = formats[fmt]
                out = tmp_path_factory.mktemp("art") / f"{arch}-{fmt}"
                quantize_checkpoint(str(get(arch)), out, method, params, calib=str(corpus),
                                    nsamples=None if method in ("rtn", "bcq") else nsamples, seqlen=seqlen,
                                    progress=False)
                made[arch, fmt] = out
        return made[arch, fmt]

    return get


@pytest.fixture(scope="module")
def checkpoint(tokenizer, corpus, tmp_path_factory):
    """Tiny CPU models (std 0.3: greedy continuations vary) and their artifacts."""
    return _checkpoints(tokenizer, corpus, tmp_path_factory, FORMATS, {"initializer_range": 0.3}, 4, 32)


def load_pair(checkpoint, arch, fmt, bits=None, device="cpu", dtype=None):
    """(reference transformers model, fast decoder) of one checkpoint."""
    path = checkpoint(arch, fmt)
    if fmt == "float":
        from quantkit.pipeline import load_for_eval

        reference = load_for_eval(str(path), device, dtype)[0]
        return reference, decoder_from_transformers(reference)
    return (quantkit.load(path, device=device, dtype=dtype, bits=bits),
            quantkit.load(path, device=device, dtype=dtype, bits=bits, runtime="fast"))


@torch.inference_mode()
def reference_greedy(model, prompt, steps):
    """(tokens [steps], logits [steps, V]) of the transformers model's greedy generation from one prompt."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         use_cache=True, pad_token_id=0, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[0, len(prompt):], torch.stack(out.logits, dim=1)[0].float()


@torch.inference_mode()
def fast_logits(model, prompts, tokens):
    """Logits [B, n, V] of the fast decoder fed each row's prompt (right-padded, each its own length), then
    tokens [B, n - 1] one decode step at a time, each row at its own position."""
    batch, steps = len(prompts), tokens.shape[1] + 1
    lengths = torch.tensor([len(p) for p in prompts], device=model.device)
    ids = torch.zeros(batch, max(map(len, prompts)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    model.setup_caches(batch, ids.shape[1] + steps)
    logits = [model.prefill(ids.to(model.device), lengths)]
    positions = lengths.clone()
    for i in range(steps - 1):
        logits.append(model.decode(tokens[:, i].to(model.device), positions))
        positions += 1
    return torch.stack(logits, dim=1).float()


def relative_gap(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


# --- equality with the reference, on the CPU -------------------------------------------------------------


@pytest.mark.parametrize("arch,fmt,bits", CASES, ids=lambda v: str(v))
def test_greedy_tokens_and_logits_equal_the_reference(arch, fmt, bits, checkpoint):
    reference, fast = load_pair(checkpoint, arch, fmt, bits)
    if fmt != "float":
        stacked = {m.meta["format"] for layer in fast.layers for m in (layer.wqkv, layer.w13)}
        assert stacked == {"bcq" if fmt == "bcq" else "anyprec" if fmt == "anyprec" else "uniform"}
    generator = FastGenerator(fast)
    for prompt in PROMPTS:
        want_tokens, want_logits = reference_greedy(reference, prompt, NEW_TOKENS)
        assert len(set(want_tokens.tolist())) > NEW_TOKENS // 3  # a varied continuation
        got = generator.run([prompt], NEW_TOKENS)["token_ids"][0]
        assert got == want_tokens.tolist(), (arch, fmt, bits)
        logits = fast_logits(fast, [prompt], want_tokens[None, :-1])[0]
        assert relative_gap(logits, want_logits) < STRICT


def test_the_decoder_serves_the_checkpoints_parts(checkpoint):
    """Qwen2's q/k/v biases, Qwen3's q/k norms and Llama's optional biases end up where they act (the logits
    test above checks the arithmetic; this that the pieces exist, so the test cannot pass without them)."""
    cases = {"qwen2": (True, False), "qwen3": (False, True), "llama": (True, False), "mistral": (False, False)}
    for arch, (bias, qk_norm) in cases.items():
        fast = load_pair(checkpoint, arch, "rtn")[1]
        assert (fast.layers[0].wqkv.bias is not None) == bias and fast.cfg.qk_norm == qk_norm, arch
        assert hasattr(fast.layers[0], "q_norm") == qk_norm


def test_config_is_read_from_the_transformers_config():
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    llama = DecoderConfig.from_transformers(LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, eos_token_id=[5, 9]))
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (3, 8, 2, 16)
    assert (llama.rope_type, llama.rope_theta, llama.rope_factor, llama.rope_original_max_positions) == (
        "llama3", 500000.0, 8.0, 64)
    assert llama.tie_word_embeddings and llama.rms_norm_eps == 1e-5 and llama.eos_token_ids == (5, 9)
    assert not llama.qk_norm and llama.sliding_window is None and not llama.attention_bias
    qwen3 = DecoderConfig.from_transformers(Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32,
                                                        num_hidden_layers=1))
    assert qwen3.qk_norm and qwen3.head_dim == 32
    from transformers import Qwen2Config

    assert DecoderConfig.from_transformers(Qwen2Config()).attention_bias
    assert DecoderConfig.from_transformers(LlamaConfig(attention_bias=True)).attention_bias
    assert DecoderConfig.from_transformers(MistralConfig(sliding_window=256)).sliding_window == 256
    with pytest.raises(UnsupportedModel, match="serves"):
        DecoderConfig.from_transformers(tiny_causal_lm("opt", vocab=50, hidden=32, intermediate=64, layers=1,
                                                       heads=2, max_positions=32).config)
    with pytest.raises(UnsupportedModel, match="rotary"):
        DecoderConfig.from_transformers(LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                     "factor": 2.0}))
    with pytest.raises(UnsupportedModel, match="SiLU"):
        DecoderConfig.from_transformers(LlamaConfig(hidden_act="gelu"))


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 100000.0},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 128}],
                         ids=lambda r: r["rope_type"])
def test_rope_frequencies_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope)
    assert torch.equal(rope_inverse_frequencies(DecoderConfig.from_transformers(config)),
                       LlamaRotaryEmbedding(config).inv_freq)


def test_unfinished_sums_are_finished_and_cleared_by_their_consumers(checkpoint, monkeypatch):
    """The LUT kernels' contract, emulated on the CPU: a bias-free projection may leave its fp32 sums in its
    workspace, and the operator after it (attention, add + norm, SiLU·mul, the final norm) must round them as
    the kernel's fp16 output and clear them. A decode with every such projection leaving sums equals, bit for
    bit, one whose projections hand over their fp16-rounded outputs, and leaves every workspace zero."""
    fast = load_pair(checkpoint, "mistral", "float")[1]
    workspaces = {}

    def leave_sums(module, x):
        ws = workspaces.setdefault(module, torch.zeros(ops.MATVEC_MAX_ROWS * module.out_features))
        assert not ws.any(), "the last call's sums were not cleared"
        sums = ws[: x.shape[0] * module.out_features].view(x.shape[0], module.out_features)
        sums += torch.nn.functional.linear(x, module.weight)
        return sums

    monkeypatch.setattr(ops, "project", lambda module, x: module(x).half().float())  # the kernel's fp16 output
    tokens = torch.tensor([[3, 99, 12], [250, 7, 7], [31, 1, 200]])
    monkeypatch.setattr(ops, "project_sums", leave_sums)
    consumed = fast_logits(fast, PROMPTS, tokens)
    assert len(workspaces) == 4 * fast.cfg.num_layers and not any(ws.any() for ws in workspaces.values())
    monkeypatch.setattr(ops, "project_sums", lambda module, x: None)
    assert torch.equal(consumed, fast_logits(fast, PROMPTS, tokens))


# --- batches, sampling, stopping ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch,fmt", [("llama", "bcq"), ("qwen2", "rtn"), ("qwen3", "anyprec")])
def test_batched_prompts_of_different_lengths_decode_as_each_alone(arch, fmt, checkpoint):
    fast = load_pair(checkpoint, arch, fmt)[1]
    generator = FastGenerator(fast)
    batched = generator.run(PROMPTS, NEW_TOKENS)["token_ids"]
    alone = [generator.run([p], NEW_TOKENS)["token_ids"][0] for p in PROMPTS]
    assert batched == alone
    tokens = torch.tensor(batched)[:, :-1]
    together = fast_logits(fast, PROMPTS, tokens)
    for row, prompt in enumerate(PROMPTS):
        assert relative_gap(together[row], fast_logits(fast, [prompt], tokens[row : row + 1])[0]) < STRICT


def test_sampling_is_seeded_and_its_limits_hold(checkpoint):
    generator = FastGenerator(load_pair(checkpoint, "llama", "bcq")[1])
    greedy = generator.run(PROMPTS, NEW_TOKENS)["token_ids"]
    sampled = {seed: generator.run(PROMPTS, NEW_TOKENS, Sampling(greedy=False, temperature=1.5, seed=seed))["token_ids"]
               for seed in (0, 0, 1)}
    first = generator.run(PROMPTS, NEW_TOKENS, Sampling(greedy=False, temperature=1.5, seed=0))["token_ids"]
    assert first == sampled[0]  # the same seed, the same tokens
    assert sampled[0] != sampled[1] and sampled[0] != greedy  # a real draw
    for limit in (Sampling(greedy=False, top_k=1, seed=3), Sampling(greedy=False, top_p=1e-6, seed=3)):
        assert generator.run(PROMPTS, NEW_TOKENS, limit)["token_ids"] == greedy  # one token left: the argmax


def test_set_bits_serves_the_new_width(checkpoint):
    """One generator across Decoder.set_bits: each width decodes as a decoder loaded at that width."""
    fast = load_pair(checkpoint, "llama", "anyprec", bits=4)[1]
    generator = FastGenerator(fast)
    at4 = generator.run(PROMPTS, NEW_TOKENS)["token_ids"]
    fast.set_bits(2)
    at2 = generator.run(PROMPTS, NEW_TOKENS)["token_ids"]
    assert at2 != at4
    fresh = FastGenerator(load_pair(checkpoint, "llama", "anyprec", bits=2)[1])
    assert at2 == fresh.run(PROMPTS, NEW_TOKENS)["token_ids"]


def test_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).expand(40000, -1)
    torch.manual_seed(0)

    def frequencies(**kwargs):
        draws = pick_sampled(logits, **kwargs)
        return torch.bincount(draws, minlength=6).float() / len(draws)

    probs = (logits[0] / 0.8).softmax(-1)
    assert (frequencies(temperature=0.8, top_k=0, top_p=1.0) - probs).abs().max() < 0.01
    top3 = probs[:3] / probs[:3].sum()
    assert (frequencies(temperature=0.8, top_k=3, top_p=1.0)[:3] - top3).abs().max() < 0.01
    assert frequencies(temperature=0.8, top_k=3, top_p=1.0)[3:].sum() == 0
    # top_p: the smallest prefix of the sorted probabilities holding top_p (here the first two)
    nucleus = frequencies(temperature=0.8, top_k=0, top_p=float(probs[0] + probs[1] / 2))
    assert nucleus[2:].sum() == 0 and (nucleus[:2] - probs[:2] / probs[:2].sum()).abs().max() < 0.01
    assert torch.equal(pick_greedy(logits[:2]), torch.tensor([0, 0]))


def test_rows_end_at_eos_or_a_stop(checkpoint):
    generator = FastGenerator(load_pair(checkpoint, "llama", "rtn")[1])
    full = generator.run(PROMPTS, NEW_TOKENS)["token_ids"]
    eos = full[0][4]  # row 0's fifth token ends it there (and any other row where it appears)
    out = generator.run(PROMPTS, NEW_TOKENS, eos_ids={eos}, check_every=3)["token_ids"]
    for row, tokens in zip(full, out):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert tokens == row[:cut]
    stopped = generator.run(PROMPTS, NEW_TOKENS, stop=lambda t: 2 if len(t) >= 2 else None, check_every=4)
    assert stopped["token_ids"] == [row[:2] for row in full] and stopped["steps"] == 4  # ended at the first look


# --- loading -------------------------------------------------------------------------------------------------


def _uniform(k, d, bits, g, sym, seed, g_idx=None):
    from quantkit.formats.uniform import UniformQuantizedTensor, num_groups

    gen = torch.Generator().manual_seed(seed)
    groups = num_groups(d, g)
    zeros = torch.randint(0, 2**bits, (k, groups), generator=gen).float()
    return UniformQuantizedTensor.from_codes(torch.randint(0, 2**bits, (k, d), generator=gen),
                                             torch.rand(k, groups, generator=gen) + 0.1, zeros, bits, g, sym, g_idx)


def _bcq(k, d, bits, g, offset, seed):
    from quantkit.formats.bcq import BCQQuantizedTensor
    from quantkit.formats.uniform import num_groups

    gen = torch.Generator().manual_seed(seed)
    return BCQQuantizedTensor.from_signs(torch.rand(bits, k, d, generator=gen) > 0.5,
                                         torch.rand(k, num_groups(d, g), bits, generator=gen),
                                         torch.randn(k, num_groups(d, g), generator=gen) if offset else None, g)


def _anyprec(k, d, seed):
    from quantkit.formats.anyprec import AnyPrecisionTensor

    gen = torch.Generator().manual_seed(seed)
    return AnyPrecisionTensor.from_codes(torch.randint(0, 16, (k, d), generator=gen),
                                         {b: torch.randn(k, 2**b, generator=gen) for b in (2, 3, 4)}, 2, 4)


@pytest.mark.parametrize("make", [
    lambda s: _uniform(13, 70, 3, 32, False, s),  # 13 rows of 3-bit zeros: the parts' zeros start mid-word
    lambda s: _uniform(16, 64, 4, 32, True, s),
    lambda s: _uniform(12, 64, 4, 16, False, s, g_idx=torch.arange(64).flip(0) // 16),  # act-order map, shared
    lambda s: _bcq(12, 70, 3, 32, True, s),
    lambda s: _bcq(8, 64, 2, 64, False, s),
    lambda s: _anyprec(12, 70, s),
], ids=["uniform-asym-odd", "uniform-sym", "uniform-g_idx", "bcq-offset", "bcq", "anyprec"])
def test_stacked_projections_are_exact(make):
    parts = [make(seed) for seed in range(3)]
    stacked = stack_quantized(parts)
    assert stacked is not None and stacked.shape == (sum(p.shape[0] for p in parts), parts[0].shape[1])
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    if stacked.format_name == "anyprec":
        assert torch.equal(stacked.dequantize(bits=2), torch.cat([p.dequantize(bits=2) for p in parts]))


def test_projections_that_differ_stay_apart():
    parts = [(_bcq(8, 64, 3, 32, True, 0), None), (_bcq(8, 64, 2, 32, True, 1), torch.ones(8))]
    assert stack_quantized([w for w, _ in parts]) is None  # 3 and 2 planes
    module = projection(parts, torch.device("cpu"), torch.float32, None)
    assert not isinstance(module, QuantLinear) and module.out_features == 16
    x = torch.randn(5, 64)
    want = torch.cat([x @ parts[0][0].dequantize().t(), x @ parts[1][0].dequantize().t() + 1], dim=-1)
    torch.testing.assert_close(ops.project(module, x), want, rtol=1e-5, atol=1e-5)
    mixed = projection([(torch.randn(8, 64), None), parts[0]], torch.device("cpu"), torch.float32, None)
    assert mixed.out_features == 16 and ops.project(mixed, x).shape == (5, 16)


def test_unknown_tensors_are_refused(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint("llama"))
    model.model.layers[0].self_attn.register_buffer("scale_table", torch.ones(3))  # a piece the decoder lacks
    with pytest.raises(UnsupportedModel, match="scale_table"):
        decoder_from_transformers(model)


def test_a_config_and_weights_that_disagree_are_refused(checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint("qwen2"))
    model.config.model_type = "llama"  # a llama without attention_bias: the q/k/v biases have no place
    with pytest.raises(QuantkitError, match="attention_bias"):
        decoder_from_transformers(model)


def test_chat_prompts_go_through_the_template(checkpoint):
    from transformers import AutoTokenizer

    from quantkit.runtime.generate import encode_prompts, generate

    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llama"))
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast = load_pair(checkpoint, "llama", "bcq")[1]
    (ids,) = encode_prompts(tokenizer, ["Tell me"], chat=True)
    assert ids == tokenizer("<s>user: Tell me</s><s>assistant:", add_special_tokens=False)["input_ids"]
    chat = generate(fast, tokenizer, ["Tell me"], max_new_tokens=6, chat=True)
    plain = FastGenerator(fast).run([ids], 6)
    assert chat["token_ids"] == plain["token_ids"] and chat["prompt_tokens"] == [len(ids)]


def test_cli_falls_back_for_other_architectures(tokenizer, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    opt = save_tiny(tiny_causal_lm("opt", vocab=len(tokenizer), hidden=32, intermediate=64, layers=1, heads=2,
                                   max_positions=64), tokenizer, tmp_path / "opt")
    result = CliRunner().invoke(main, ["generate", "--model", str(opt), "--prompt", "The", "--max-new-tokens", "3",
                                       "--runtime", "fast"])
    assert result.exit_code == 2 and "fast decoder serves" in result.output
    with pytest.raises(QuantkitError, match="runtime"):
        quantkit.load(opt, runtime="vllm")


# --- operators, graphs, compile --------------------------------------------------------------------------------


def _op_samples():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    keys, values = torch.randn(2, 2, 24, 16, generator=g), torch.randn(2, 2, 24, 16, generator=g)
    table = torch.randn(24, 16, generator=g)
    qkv = torch.randn(2, (4 + 2 * 2) * 16, generator=g)
    counters = torch.zeros(16, dtype=torch.int32)
    return [
        (ops.rms_norm, (x, w, 1e-6)),
        (ops.add_rms_norm, (x, torch.randn(3, 64, generator=g), w, 1e-6, False)),
        (ops.add_rms_norm, (x, torch.randn(3, 64, generator=g), w, 1e-6, True)),
        (ops.silu_mul_op, (torch.randn(3, 64, generator=g), torch.float32, False)),
        (ops.silu_mul_op, (torch.randn(3, 64, generator=g), torch.float32, True)),
        (ops.attend, (qkv, keys, values, torch.tensor([5, 23]), table, table.flip(0), counters, 4, 0.25, False)),
        (ops.attend, (qkv.clone(), keys, values, torch.tensor([0, 9]), None, None, counters, 4, 0.25, True)),
    ]


@pytest.mark.parametrize("index", range(7))
def test_operators_pass_torch_library_checks(index):
    """Schema (declared mutations), fake implementations, and tracing by AOT dispatch (torch.compile's path)."""
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args)


def test_a_decode_step_compiles_to_one_graph(checkpoint):
    """torch.compile traces the float decoder's whole decode step, the custom operators included, without a
    graph break, and the compiled step computes what the eager one does."""
    fast = load_pair(checkpoint, "qwen3", "float")[1]
    fast.setup_caches(2, 32)
    ids, positions = torch.tensor([3, 7]), torch.tensor([4, 9])
    with torch.inference_mode():
        fast.prefill(torch.randint(0, 300, (2, 10)), torch.tensor([5, 10]))
        saved = [(c.keys.clone(), c.values.clone()) for c in fast.caches]
        want = fast.decode(ids, positions)
        for cache, (k, v) in zip(fast.caches, saved):
            cache.keys.copy_(k), cache.values.copy_(v)
        got = torch.compile(fast.decode, backend="aot_eager", fullgraph=True)(ids, positions)
    assert relative_gap(got.float(), want.float()) < STRICT


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
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


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(greedy=False, top_k=5, top_p=0.8)],
                         ids=["greedy", "sampled"])
def test_a_decode_step_reads_nothing_back_to_the_host(sampling, checkpoint):
    # what a CUDA graph captures must not synchronise; on the CPU we can check the ops for it
    with _HostReads() as control:
        torch.ones(2).sum().item()
    assert control.seen == ["aten::_local_scalar_dense"]
    generator = FastGenerator(load_pair(checkpoint, "llama", "anyprec", bits=3)[1])
    generator.run(PROMPTS, 4, sampling)  # first calls fill QuantLinear's weight caches (on CUDA kernels serve)
    ((_, state),) = generator.graphs.values()
    with torch.inference_mode(), _HostReads() as spy:
        state.count.zero_()  # a step more than the generation held: its token goes to the first slot
        generator._step(state, _picker(sampling, generator.device))
    assert spy.seen == []


def test_nothing_reads_another_librarys_source():
    """The runtime is owned code: no module of quantkit reads source text (inspect.getsource and kin)."""
    pattern = re.compile(r"getsource|getsourcelines|getsourcefile|linecache|__code__|co_code")
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "quantkit").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


# the fast decoder in fp16 with its Triton kernels, run by Triton's interpreter on the CPU, against the same
# decoder with the operators' PyTorch paths (TRITON_INTERPRET switched off in the same process)
_INTERPRETED = """
import json, os, sys, torch
sys.path[:0] = {paths!r}
from factories import tiny_causal_lm
from quantkit.runtime import add_norm, decode_attention, silu_mul
from quantkit.runtime.weights import decoder_from_transformers
model = tiny_causal_lm("qwen3", vocab=97, hidden=64, heads=4, kv_heads=2, initializer_range=0.3, seed=0)
fast = decoder_from_transformers(model, dtype=torch.float16)
prompts = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
lengths, tokens = torch.tensor([6, 3]), torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(2))
calls = []
for module, name in ((add_norm, "add_rms_norm"), (add_norm, "rms_norm"), (silu_mul, "silu_mul"),
                     (decode_attention, "decode")):
    original = getattr(module, name)
    setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))

def run():
    fast.setup_caches(2, 12)
    with torch.inference_mode():
        out = [fast.prefill(prompts, lengths)]
        positions = lengths.clone()
        for i in range(4):
            out.append(fast.decode(tokens[:, i], positions))
            positions += 1
    return torch.stack(out).float()

kernels = run()
kernel_calls = sorted(set(calls))
os.environ["TRITON_INTERPRET"] = "0"
calls.clear()
reference = run()
print(json.dumps({{"kernel_calls": kernel_calls, "reference_calls": calls,
                  "gap": ((kernels - reference).abs().max() / reference.abs().max()).item()}}))
"""


def test_interpreted_kernels_decode_like_the_pytorch_paths(run_interpreted):
    report = run_interpreted(_INTERPRETED)
    assert report["kernel_calls"] == ["add_rms_norm", "decode", "rms_norm", "silu_mul"]
    assert not report["reference_calls"]
    assert report["gap"] < 5e-3  # fp16: the kernels round once where PyTorch rounds op by op


# --- SmolLM2 ---------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_smollm2_decodes_as_the_reference(smollm2_path):
    from quantkit.pipeline import load_for_eval

    reference, tokenizer, _ = load_for_eval(str(smollm2_path))
    fast = decoder_from_transformers(reference)
    prompt = tokenizer("The history of the city")["input_ids"]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    assert FastGenerator(fast).run([prompt], 8)["token_ids"][0] == want_tokens.tolist()
    assert relative_gap(fast_logits(fast, [prompt], want_tokens[None, :-1])[0], want_logits) < 1e-4


# --- on the GPU --------------------------------------------------------------------------------------------------

KERNEL_NOISE_FACTOR = 4  # fast decoder's error vs fp32 / the fp16 reference path's error vs fp32
MIN_TOKEN_AGREEMENT = 0.9
NEAR_TIE = 1e-2  # logit gap, relative to the largest logit, that fp16 rounding may flip
GPU_STEPS = 32
# kernel-friendly sizes: groups of 128 divide every row, out_features % 4 == 0
GPU_MODEL = {"hidden": 256, "intermediate": 768, "heads": 4, "kv_heads": 2, "initializer_range": 0.15}
GPU_FORMATS = {"float": None, "rtn": ("rtn", {"bits": 4, "group_size": 128}),
               "gptq": ("gptq", {"bits": 4, "group_size": 128}), "bcq": ("bcq", {"bits": 3, "group_size": 128}),
               "anyprec": ("anyprec", {"seed_bits": 3, "parent_bits": 5})}


@pytest.fixture(scope="module")
def gpu_checkpoint(tokenizer, corpus, tmp_path_factory):
    return _checkpoints(tokenizer, corpus, tmp_path_factory, GPU_FORMATS, GPU_MODEL, 8, 64)


def _gpu_prompts(batch=3):
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (16, 9, 13)[:batch]]


def _require_kernels(fast):
    """Skip unless the matvec kernels serve every quantized projection (else the test compares the reference
    with itself)."""
    from quantkit.kernels import build, lutgemm

    for module in fast.modules():
        if isinstance(module, QuantLinear):
            x = torch.randn(1, module.in_features, device="cuda", dtype=torch.float16)
            if module.meta["format"] == "anyprec":
                served = build.load("anyprec") is not None
            else:
                served = ops._lut_served(module, x) is not None
            if not served:
                pytest.skip(f"no CUDA kernel serves {module.meta['format']} here ({lutgemm.kernels() is not None})")


def _assert_same_until_near_tie(fast, prompt, a, b, what):
    """Greedy continuations a, b (lists) must be equal up to their first difference, and there the two tokens
    must be a near-tie of that step's logits: rounding can flip a near-tie, after which the contexts differ."""
    step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if step is None:
        assert len(a) == len(b), what
        return
    logits = fast_logits(fast, [prompt], torch.tensor([a[:step]], dtype=torch.long).reshape(1, step))[0, -1]
    gap = (logits[a[step]] - logits[b[step]]).abs().item()
    assert gap <= NEAR_TIE * logits.abs().max().item(), f"{what}: token {step} differs by a logit gap of {gap:.3e}"


@pytest.mark.requires("cuda")
@pytest.mark.parametrize("arch,fmt,bits", [("llama", "float", None), ("llama", "rtn", None), ("llama", "gptq", None),
                                           ("llama", "bcq", None), ("llama", "anyprec", 3), ("llama", "anyprec", 5),
                                           ("qwen2", "bcq", None), ("qwen3", "rtn", None), ("mistral", "anyprec", 4),
                                           ("mistral", "float", None)],
                         ids=lambda v: str(v))
def test_cuda_decoder_matches_the_reference_path(arch, fmt, bits, gpu_checkpoint):
    reference, fast = load_pair(gpu_checkpoint, arch, fmt, bits, device="cuda")
    _require_kernels(fast)
    exact = load_pair(gpu_checkpoint, arch, fmt, bits, device="cuda", dtype=torch.float32)[0]
    for module in [*reference.modules(), *exact.modules()]:
        if isinstance(module, QuantLinear):
            module.use_kernels = False  # the dequantized weights with cuBLAS
    prompt = _gpu_prompts(1)[0]
    tokens, ref_logits = reference_greedy(reference, prompt, GPU_STEPS)
    exact_logits = _teacher_forced(exact, prompt, tokens)
    got = fast_logits(fast, [prompt], tokens[None, :-1].cuda())[0]
    noise = relative_gap(ref_logits, exact_logits)
    err = relative_gap(got, exact_logits)
    assert noise < 5e-2, f"fp16 reference path {noise:.2e} away from fp32"
    assert err <= KERNEL_NOISE_FACTOR * max(noise, 1e-3), (err, noise)
    assert (got.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= MIN_TOKEN_AGREEMENT
    generator = FastGenerator(fast)
    graphed = generator.run([prompt], GPU_STEPS)
    assert graphed["cuda_graph"]
    eager = FastGenerator(fast, use_graphs=False).run([prompt], GPU_STEPS)["token_ids"][0]
    _assert_same_until_near_tie(fast, prompt, graphed["token_ids"][0], eager, "graph vs eager")
    _assert_same_until_near_tie(fast, prompt, graphed["token_ids"][0], tokens.tolist(), "fast vs reference")


@torch.inference_mode()
def _teacher_forced(model, prompt, tokens):
    """Logits [steps, V] of a transformers model fed prompt + tokens[:-1] (one forward, causal)."""
    ids = torch.tensor([prompt + tokens.tolist()[:-1]], device=model.device)
    return model(ids).logits[0, len(prompt) - 1 :].float()


@pytest.mark.requires("cuda")
@pytest.mark.parametrize("fmt", ["bcq", "anyprec", "float"])
def test_cuda_batched_prompts_decode_as_each_alone(fmt, gpu_checkpoint):
    fast = load_pair(gpu_checkpoint, "llama", fmt, 3 if fmt == "anyprec" else None, device="cuda")[1]
    _require_kernels(fast)
    generator = FastGenerator(fast)
    prompts = _gpu_prompts()
    batched = generator.run(prompts, GPU_STEPS)
    assert batched["cuda_graph"]
    for prompt, row in zip(prompts, batched["token_ids"]):
        _assert_same_until_near_tie(fast, prompt, row, generator.run([prompt], GPU_STEPS)["token_ids"][0],
                                    "batched vs alone")


@pytest.mark.requires("cuda")
def test_cuda_sampling_is_seeded(gpu_checkpoint):
    """The float model on cuBLAS: the LUT kernels and the split-K fp16 matvec add their fp32 partial sums in no
    fixed order, so with them two seeded runs agree only until a draw lands near a boundary of the sampled
    distribution."""
    from quantkit.runtime import dense_matvec

    fast = load_pair(gpu_checkpoint, "llama", "float", device="cuda")[1]
    sampling = Sampling(greedy=False, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    with dense_matvec.disabled():  # cuBLAS: the split-K matvec's atomics add in no fixed order, like the LUT kernels'
        generator = FastGenerator(fast)
        runs = [generator.run(_gpu_prompts(), GPU_STEPS, sampling)["token_ids"] for _ in range(2)]
        other = generator.run(_gpu_prompts(), GPU_STEPS, Sampling(greedy=False, temperature=1.0, seed=8))["token_ids"]
    assert runs[0] == runs[1] and runs[0] != other


@pytest.mark.requires("cuda", "triton")
@pytest.mark.parametrize("fmt,sums", [("bcq", True), ("anyprec", False), ("float", True)])
def test_cuda_captured_step_runs_the_kernels(fmt, sums, gpu_checkpoint, monkeypatch):
    """The captured step launches the Triton kernels (attention, add + norm, SiLU·mul), the matvec operators,
    sums left for the next kernel where the LUT kernels (BCQ) or the split-K matvec (fp16) serve; on sm_90+ the
    launches overlap."""
    from quantkit.kernels import lutgemm, overlap
    from quantkit.runtime import add_norm, decode_attention, dense_matvec, silu_mul

    # mistral: no biases, so every projection of the BCQ model may leave its sums (the llama here has q/k/v biases)
    fast = load_pair(gpu_checkpoint, "mistral", fmt, 3 if fmt == "anyprec" else None, device="cuda")[1]
    _require_kernels(fast)
    calls = []

    def spy(module, name):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append((name, k.get("consume"))) or original(*a, **k))

    for module, name in ((add_norm, "add_rms_norm"), (silu_mul, "silu_mul"), (decode_attention, "decode"),
                         (ops, "lut_accumulate"), (ops, "lut_matvec"), (ops, "anyprec_matvec"),
                         (ops, "dense_accumulate")):
        spy(module, name)
    launched = []
    triton_launch = overlap.triton_launch
    monkeypatch.setattr(overlap, "triton_launch",
                        lambda d: launched.append(triton_launch(d)["GDC"]) or triton_launch(d))
    generator = FastGenerator(fast)
    calls.clear()
    generator.run(_gpu_prompts(1), 4)  # warm-up steps, the capture, prefill, replays
    layers = fast.cfg.num_layers
    names = [n for n, _ in calls]
    assert names.count("decode") >= layers and names.count("silu_mul") >= layers
    assert ("lut_accumulate" in names) == (fmt == "bcq") and ("anyprec_matvec" in names) == (fmt == "anyprec")
    x = torch.zeros(1, fast.cfg.hidden_size, device="cuda", dtype=torch.float16)
    dense_served = fmt == "float" and dense_matvec.serves(fast.layers[0].wo.weight, x)
    assert ("dense_accumulate" in names) == dense_served
    sums = sums and (fmt != "float" or dense_served)
    for module in fast.modules():  # every consumer left the sums it finished zero
        for attr in (dense_matvec._WORKSPACE_ATTR, lutgemm._WORKSPACE_ATTR):
            ws = getattr(module, attr, None)
            assert ws is None or not ws.any(), f"{type(module).__name__}.{attr} left non-zero"
    if sums:
        assert ("decode", True) in calls and ("silu_mul", True) in calls and ("add_rms_norm", True) in calls
    if overlap.for_device("cuda"):
        assert any(launched)


@pytest.mark.requires("cuda", "lutgemm")
def test_cuda_matvec_operators_pass_checks_and_compile(gpu_checkpoint):
    fast = load_pair(gpu_checkpoint, "llama", "bcq", device="cuda")[1]
    module = fast.layers[0].w13
    offset = module.offset if module.meta["offset"] else None
    x = torch.randn(2, module.in_features, device="cuda", dtype=torch.float16)
    args = (x, module.qweight, module.alpha, offset, None, module.meta["group_size"])
    want = x @ module.dequantized_weight(torch.float16).t()
    torch.library.opcheck(ops.lut_matvec, (*args, None, False))
    compiled = torch.compile(lambda x: ops.lut_matvec(x, *args[1:], None, False), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), want, rtol=2e-2, atol=2e-2)
    acc = torch.zeros(2 * module.out_features, device="cuda")
    torch.library.opcheck(ops.lut_accumulate, (x, *args[1:4], module.meta["group_size"], acc.clone(), False))
    ops.lut_accumulate(x, *args[1:4], module.meta["group_size"], acc, False)
    torch.testing.assert_close(acc.view(2, -1).half(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.requires("cuda", "triton")
def test_cuda_dense_operator_passes_checks_and_compiles():
    weight = torch.randn(384, 256, device="cuda", dtype=torch.float16)
    x = torch.randn(3, 256, device="cuda", dtype=torch.float16)
    acc = torch.zeros(3 * 384, device="cuda")
    torch.library.opcheck(ops.dense_accumulate, (x, weight, acc.clone()))
    compiled = torch.compile(lambda x, acc: ops.dense_accumulate(x, weight, acc), backend="aot_eager", fullgraph=True)
    compiled(x, acc)
    torch.testing.assert_close(acc.view(3, -1), (x.float() @ weight.float().t()), rtol=1e-3, atol=1e-3)


@pytest.mark.requires("cuda")
def test_the_compiled_greedy_pick_is_argmax():
    from quantkit.runtime.generate import _compiled_greedy

    logits = torch.randn(3, 32000, device="cuda").half()
    logits[1, [5, 17, 31000]] = 30.0  # equal maxima: the first one, as torch.argmax
    logits[2] = -1.0
    picked = _compiled_greedy()(logits)
    assert torch.equal(picked, logits.argmax(dim=-1)) and picked[1] == 5 and picked[2] == 0


@pytest.mark.integration
@pytest.mark.requires("cuda")
def test_cuda_smollm2_decodes_as_the_reference(smollm2_path, tmp_path):
    """SmolLM2 RTN w4 g64 (uniform, served by the LUT kernels through its BCQ form): the fast decoder's
    logits within the fp16 noise of the reference path's."""
    from quantkit.models import load_tokenizer, resolve_source

    out = tmp_path / "smol"
    quantize_checkpoint(str(smollm2_path), out, "rtn", {"bits": 4, "group_size": 64}, device="cuda", progress=False)
    reference, fast = quantkit.load(out, device="cuda"), quantkit.load(out, device="cuda", runtime="fast")
    exact = quantkit.load(out, device="cuda", dtype=torch.float32)
    for module in [*reference.modules(), *exact.modules()]:
        if isinstance(module, QuantLinear):
            module.use_kernels = False
    prompt = load_tokenizer(resolve_source(str(smollm2_path)))("The history of the city")["input_ids"]
    tokens, ref_logits = reference_greedy(reference, prompt, 16)
    exact_logits = _teacher_forced(exact, prompt, tokens)
    got = fast_logits(fast, [prompt], tokens[None, :-1].cuda())[0]
    noise = relative_gap(ref_logits, exact_logits)
    assert relative_gap(got, exact_logits) <= KERNEL_NOISE_FACTOR * max(noise, 1e-3)
    assert json.dumps(FastGenerator(fast).run([prompt], 16)["token_ids"])  # a captured generation runs
