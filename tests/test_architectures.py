"""Every decoder-only architecture quantkit promises, from a tiny random config (no download): quantize
(RTN and GPTQ) -> artifact -> quantkit.load, whose logits must equal those of the same float model, run by
transformers' own code, with the dequantized weights put back. Plus the discovery itself: the layer walk
and sequential groups learned by watching a forward, the per-block calls (sliding-window masks), the
mixture-of-experts routing statistics, and one-line refusals of what is not a decoder-only causal LM."""

import json

import pytest
import torch
from click.testing import CliRunner

from arch_oracle import dequantized_reference
from factories import save_tiny, tiny_causal_lm
from quantkit.artifact import read_config
from quantkit.cli import main
from quantkit.engine import capture_layer_inputs
from quantkit.engine.driver import _run_layer
from quantkit.models import adapter_for
from quantkit.models.adapters import observe_calls
from quantkit.pipeline import evaluate_ppl, quantize_checkpoint
from quantkit.runtime import QuantLinear, load_quantized
from quantkit.runtime.experts import RoutedExperts, replace_fused_experts, routed_from_fused

DENSE = ("llama", "mistral", "qwen2", "qwen3", "opt", "gemma2", "gemma3_text", "phi3", "gpt_neox")
MOE = ("qwen3_moe", "mixtral")
NSAMPLES, SEQLEN, TOP_K = 4, 32, 2


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one thread


@pytest.fixture(scope="module")
def checkpoints(tiny_tokenizer, tmp_path_factory):
    """{architecture: directory of a tiny random checkpoint}, made on first use."""
    made = {}

    def get(arch):
        if arch not in made:
            model = tiny_causal_lm(arch, vocab=len(tiny_tokenizer), max_positions=256, seed=3)
            made[arch] = save_tiny(model, tiny_tokenizer, tmp_path_factory.mktemp(arch))
        return made[arch]

    return get


def _quantize(src, out, method, small_data):
    nsamples = NSAMPLES if method == "gptq" else 0
    return quantize_checkpoint(str(src), out, method, {"bits": 4, "group_size": 32}, nsamples=nsamples,
                               seqlen=SEQLEN, calib="ptb", device="cpu", data_dir=small_data, progress=False,
                               checkpoint=False)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("arch", DENSE + MOE)
def test_artifact_reloads_with_the_logits_of_its_dequantized_weights(arch, method, checkpoints, small_data, data_dir,
                                                                      tmp_path):
    src = checkpoints(arch)
    out = tmp_path / "art"
    summary = _quantize(src, out, method, small_data)
    model = load_quantized(out)
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == summary["modules_quantized"]
    assert read_config(out)["quantization_config"]["architecture"] == arch

    reference = dequantized_reference(src, out)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()

    # every linear of every block, none other: the float model's nn.Linear modules in the blocks
    # (fused experts counted one matrix per expert and projection), the router and the head left out
    float_model = tiny_causal_lm(arch, vocab=model.config.vocab_size, max_positions=256, seed=3)
    replace_fused_experts(float_model)
    adapter = adapter_for(float_model)
    expected = {f"{adapter.layers_path}.{i}.{name}" for i, layer in enumerate(adapter.layers(float_model))
                for name in adapter.linears(layer)}
    assert quantized == expected
    assert not any("router" in n or n.endswith("mlp.gate") or "lm_head" in n for n in quantized)

    if method == "gptq":  # calibration ran through every block: each module has its output error
        log = json.loads((out / "quant_log.json").read_text())
        assert {e["module"] for e in log["modules"]} == expected
        assert all(e["output_mse"] >= 0 and e["gptq_loss"] >= 0 for e in log["modules"])
        # and the artifact evaluates: the perplexity of its logits on the GPTQ protocol's windows
        scores = evaluate_ppl(str(out), ["wikitext2"], seqlen=64, max_windows=2, data_dir=data_dir, progress=False)
        assert scores[0]["windows"] == 2 and 1 < scores[0]["ppl"] < float("inf")


# --- discovery ----------------------------------------------------------------------------------

# the sequential groups quantkit used to declare by hand for these architectures
HAND_TABLES = {
    "llama": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
    "opt": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.out_proj",), ("fc1",),
            ("fc2",)),
}
HAND_TABLES.update(mistral=HAND_TABLES["llama"], qwen2=HAND_TABLES["llama"], qwen3=HAND_TABLES["llama"])


def _plan(arch, layers=2):
    model = tiny_causal_lm(arch, layers=layers, vocab=128, max_positions=64, seed=0)
    replace_fused_experts(model)
    adapter = adapter_for(model)
    blocks = adapter.layers(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs, calls = capture_layer_inputs(model, blocks, ids, "cpu")
    observed = observe_calls(blocks[0], adapter.linear_names(blocks[0]),
                             lambda: _run_layer(blocks[0], inputs[:1], *calls[0], keep_outputs=False))
    return model, adapter, adapter.steps(blocks[0], observed)


@pytest.mark.parametrize("arch", sorted(HAND_TABLES))
def test_discovered_groups_equal_the_former_hand_tables(arch):
    _, adapter, steps = _plan(arch)
    assert all(len(step) == 1 for step in steps)
    assert tuple(step[0] for step in steps) == HAND_TABLES[arch]
    assert adapter.layers_path == ("model.decoder.layers" if arch == "opt" else "model.layers")


def test_fused_and_parallel_blocks_are_observed_as_they_run():
    _, _, phi3 = _plan("phi3")
    assert [step[0] for step in phi3] == [("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",),
                                         ("mlp.down_proj",)]
    # GPT-NeoX runs attention and MLP side by side, each on its own layernorm of the same input
    model, adapter, neox = _plan("gpt_neox")
    assert model.config.use_parallel_residual and adapter.layers_path == "gpt_neox.layers"
    assert [step[0] for step in neox] == [("attention.query_key_value",), ("attention.dense",),
                                         ("mlp.dense_h_to_4h",), ("mlp.dense_4h_to_h",)]


def test_experts_are_planned_per_expert_and_routers_stay_float():
    model, adapter, steps = _plan("qwen3_moe")
    block = adapter.layers(model)[0]
    assert isinstance(block.mlp.experts, RoutedExperts) and "mlp.gate" not in adapter.linears(block)
    assert steps[:2] == ((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),), (("self_attn.o_proj",),))
    assert steps[2] == tuple((f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj") for e in range(4))
    assert steps[3] == tuple((f"mlp.experts.{e}.down_proj",) for e in range(4))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_every_block_gets_its_own_call(arch):
    """Sliding-window and global blocks get different masks (and, in Gemma 3, position embeddings): the
    captured calls are what the model passes each block, and running the blocks with them reproduces the
    model's hidden states (three layers: the last but one checks a global block's output)."""
    model = tiny_causal_lm(arch, layers=3, vocab=128, max_positions=64, seed=0,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    adapter = adapter_for(model)
    blocks = adapter.layers(model)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))  # 20 > sliding window 8
    inputs, calls = capture_layer_inputs(model, blocks, ids, "cpu")
    seen = {}
    handles = [block.register_forward_pre_hook(lambda m, a, kw, i=i: seen.__setitem__(i, kw), with_kwargs=True)
               for i, block in enumerate(blocks)]
    with torch.no_grad():
        hidden = model(ids[:1], output_hidden_states=True, use_cache=False).hidden_states
    for handle in handles:
        handle.remove()
    for i, (_, kwargs) in enumerate(calls):
        mask = seen[i]["attention_mask"]
        assert (kwargs["attention_mask"] is None) == (mask is None)
        if mask is not None:
            assert torch.equal(kwargs["attention_mask"], mask)
    sliding, full = calls[0][1]["attention_mask"], calls[1][1]["attention_mask"]
    assert sliding is not None and (full is None or not torch.equal(sliding, full))
    x = inputs[:1]
    with torch.no_grad():
        for i in range(2):
            x = _run_layer(blocks[i], x, *calls[i])
            assert torch.allclose(x, hidden[i + 1], atol=1e-5), i


# --- mixture of experts -----------------------------------------------------------------------

@pytest.mark.parametrize("arch", MOE)
def test_routed_experts_compute_what_the_fused_module_computes(arch):
    model = tiny_causal_lm(arch, vocab=128, max_positions=64, seed=0)
    fused = model.model.layers[0].mlp.experts
    model.config._experts_implementation = "eager"
    routed = routed_from_fused("mlp.experts", fused)
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(1))
    index = torch.randint(0, 4, (30, TOP_K), generator=torch.Generator().manual_seed(2))
    weights = torch.rand(30, TOP_K, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(routed(x, index, weights), fused(x, index, weights), atol=1e-6)
        # calibrating expert 1 on all tokens: it sees every row and contributes nothing
        sizes = []
        handle = routed.expert(1).gate_proj.register_forward_pre_hook(lambda m, a: sizes.append(a[0].shape[0]))
        routed.calibrate_on_all_tokens = frozenset({1})
        partial = routed(x, index, weights)
        routed.calibrate_on_all_tokens = frozenset()
        handle.remove()
    assert sizes == [30]
    without_1 = torch.where((index == 1).unsqueeze(-1), torch.zeros_like(weights).unsqueeze(-1),
                            weights.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        assert torch.allclose(partial, fused(x, index, without_1), atol=1e-6)


def test_expert_token_counts_and_the_few_token_rule(checkpoints, small_data, tmp_path, caplog):
    out = tmp_path / "art"
    with caplog.at_level("WARNING"):
        _quantize(checkpoints("qwen3_moe"), out, "gptq", small_data)
    log = json.loads((out / "quant_log.json").read_text())
    experts = [e for e in log["modules"] if ".experts." in e["module"]]
    assert experts and all("routed_tokens" in e for e in experts)
    for layer in range(2):
        gates = [e for e in experts if e["module"].startswith(f"model.layers.{layer}.") and
                 e["module"].endswith("gate_proj")]
        # every token goes to TOP_K experts: the counts add up to what reached the block
        assert sum(e["routed_tokens"] for e in gates) == NSAMPLES * SEQLEN * TOP_K
        for entry in gates:
            few = entry["routed_tokens"] < 64  # the expert's input width
            assert entry["calibrated_on"] == ("all block tokens" if few else "routed tokens")
            down = next(e for e in experts if e["module"] == entry["module"].replace("gate_proj", "down_proj"))
            assert down["calibrated_on"] == entry["calibrated_on"] and down["routed_tokens"] == entry["routed_tokens"]
    if any(e["calibrated_on"] == "all block tokens" for e in experts):
        assert "routed too few tokens" in caplog.text


# --- refusals -----------------------------------------------------------------------------------

def _one_line(result):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.usefixtures("loader_never_called")
def test_not_a_decoder_only_causal_lm_is_refused_from_its_config(tmp_path):
    save_tiny(tiny_causal_lm("bert", layers=1, hidden=32, heads=2, vocab=64), None, tmp_path / "bert")
    line = _one_line(CliRunner().invoke(main, ["quantize", "--model", str(tmp_path / "bert"), "--out",
                                               str(tmp_path / "q")]))
    assert "unsupported architecture 'bert' (BertForMaskedLM)" in line and "decoder-only causal LM" in line
    assert "LlamaForCausalLM" in line and not (tmp_path / "q").exists()
    # a causal LM whose projections are not nn.Linear: refused from the structure built on the meta device
    save_tiny(tiny_causal_lm("gpt2", layers=1, hidden=32, heads=2, vocab=64), None, tmp_path / "gpt2")
    line = _one_line(CliRunner().invoke(main, ["quantize", "--model", str(tmp_path / "gpt2"), "--out",
                                               str(tmp_path / "q")]))
    assert "unsupported architecture 'gpt2'" in line and "no nn.Linear" in line and "Conv1D" in line


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_neox", "qwen3_moe", "mixtral"])
def test_transformers_from_pretrained_equals_quantkit_load(arch, checkpoints, small_data, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "art"
    _quantize(checkpoints(arch), out, "rtn", small_data)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, device_map="cpu").eval()
    ours = load_quantized(out)
    names = [name for name, module in ours.named_modules() if isinstance(module, QuantLinear)]
    assert names and all(isinstance(theirs.get_submodule(name), QuantLinear) for name in names)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)


# --- the checkpoint's own dtype -----------------------------------------------------------------

def test_compute_dtype_follows_the_checkpoint():
    from quantkit.errors import QuantkitError
    from quantkit.pipeline import resolve_dtype

    assert resolve_dtype("auto", "cuda", torch.bfloat16) == torch.bfloat16  # no fp16 overflow for bf16 models
    assert resolve_dtype(None, "cuda:1", torch.float16) == torch.float16
    assert resolve_dtype("auto", "cuda", torch.float32) == torch.float16
    assert resolve_dtype("auto", "cuda", None) == torch.float16  # GGUF: the config does not say
    assert resolve_dtype("auto", "cpu", torch.bfloat16) == torch.float32
    assert resolve_dtype("bfloat16", "cpu", torch.float32) == torch.bfloat16
    with pytest.raises(QuantkitError, match="unknown dtype 'half'"):
        resolve_dtype("half", "cpu")


def test_bf16_checkpoint_keeps_its_dtype(tiny_tokenizer, small_data, tmp_path):
    """A bf16 checkpoint: computed in fp32 on the CPU unless asked, in bf16 when asked; either way the
    artifact says bfloat16, stores its unquantized tensors in bf16, and serves bf16 activations."""
    from safetensors import safe_open

    model = tiny_causal_lm("qwen3", vocab=len(tiny_tokenizer), max_positions=256, seed=3).to(torch.bfloat16)
    src = save_tiny(model, tiny_tokenizer, tmp_path / "bf16")
    for dtype, computed in (("auto", "float32"), ("bfloat16", "bfloat16")):
        out = tmp_path / f"art-{dtype}"
        result = CliRunner().invoke(main, ["quantize", "--model", str(src), "--out", str(out), "--method", "gptq",
                                           "--bits", "4", "--group-size", "32", "--calib", "ptb", "--nsamples", "2",
                                           "--seqlen", "32", "--data-dir", str(small_data), "--device", "cpu",
                                           "--dtype", dtype, "--no-checkpoint"])
        assert result.exit_code == 0, result.output
        assert json.loads((out / "quant_log.json").read_text())["dtype"] == computed
        assert read_config(out)["dtype"] == "bfloat16"
        with safe_open(str(out / "model.safetensors"), "pt") as fh:
            assert fh.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    served = load_quantized(out, dtype=torch.bfloat16)
    exact = load_quantized(out, dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        low, high = served(ids).logits, exact(ids).logits
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert (low.float() - high).abs().max() < 0.05 * high.abs().max()


def test_an_encoder_config_without_architectures_is_refused_unless_it_is_a_decoder():
    """BERT's model_type maps to a causal-LM class (BertLMHeadModel), but only with is_decoder set is that
    model causal: a plain encoder config is refused from the config alone."""
    from quantkit.errors import QuantkitError
    from quantkit.models.loading import causal_lm_class

    with pytest.raises(QuantkitError, match="an encoder config"):
        causal_lm_class({"model_type": "bert"})
    assert causal_lm_class({"model_type": "bert", "is_decoder": True}) == "BertLMHeadModel"
    assert causal_lm_class({"model_type": "llama"}) == "LlamaForCausalLM"
