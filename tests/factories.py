"""Tiny random causal LMs built from their configs (no download), for every test that needs a model.

    tiny_causal_lm("llama", layers=2, hidden=64, intermediate=160, vocab=128, heads=4, kv_heads=2,
                   max_positions=64, seed=0, **overrides) -> an eval-mode model (also mistral, qwen2, qwen3,
                   opt, gpt2)
    save_tiny(model, tokenizer, path) -> path, holding the model and (unless None) the tokenizer

The weights depend on the seed and the sizes only: torch's global generator is seeded right before the
model is built, as transformers initializes parameters from it. `overrides` go to the config unchanged
(tie_word_embeddings, rope_theta, initializer_range, attn_implementation, ...), so each test states what
its assertions depend on and nothing else.
"""

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gemma2", "gemma3_text", "phi3", "gpt_neox",
                 "qwen3_moe", "mixtral", "gpt2", "bert")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # Llama's layer shape; Qwen2 adds q/k/v biases, Qwen3 q/k norms


def _config_and_class(arch, layers, hidden, intermediate, vocab, heads, kv_heads, max_positions):
    """(config class, model class, sizes) of `arch`, built through transformers' auto classes."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=max_positions)
    grouped = dict(common, num_key_value_heads=kv_heads)
    sizes = {
        "llama": grouped,
        "mistral": grouped,
        "qwen2": grouped,
        "qwen3": dict(grouped, head_dim=hidden // heads),
        "opt": dict(vocab_size=vocab, hidden_size=hidden, ffn_dim=intermediate, num_hidden_layers=layers,
                    num_attention_heads=heads, max_position_embeddings=max_positions, word_embed_proj_dim=hidden),
        # sliding-window layers beside global ones, soft-capping, scaled embeddings: a window shorter than
        # the calibration windows, so the two kinds of masks differ
        "gemma2": dict(grouped, head_dim=hidden // heads, sliding_window=8),
        "gemma3_text": dict(grouped, head_dim=hidden // heads, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                            + ["sliding_attention"] * (layers % 2)),
        "phi3": dict(grouped, pad_token_id=0, bos_token_id=1, eos_token_id=2),  # fused qkv_proj, gate_up_proj
        "gpt_neox": common,  # fused query_key_value, parallel attention and MLP
        "qwen3_moe": dict(grouped, head_dim=hidden // heads, moe_intermediate_size=intermediate // 4, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True),
        "mixtral": dict(grouped, intermediate_size=intermediate // 4, num_local_experts=4, num_experts_per_tok=2),
        # a causal LM whose projections are transformers' Conv1D, not nn.Linear
        "gpt2": dict(vocab_size=vocab, n_embd=hidden, n_inner=intermediate, n_layer=layers, n_head=heads,
                     n_positions=max_positions),
        # an encoder: not a causal LM, for the error paths
        "bert": dict(common),
    }
    if arch not in sizes:
        raise ValueError(f"unknown architecture {arch!r}; one of {', '.join(ARCHITECTURES)}")
    if arch == "bert":
        from transformers import BertConfig, BertForMaskedLM

        return BertConfig, BertForMaskedLM, sizes[arch]
    config_class = type(AutoConfig.for_model(arch))
    return config_class, MODEL_FOR_CAUSAL_LM_MAPPING[config_class], sizes[arch]


def tiny_causal_lm(arch="llama", *, layers=2, hidden=64, intermediate=160, vocab=128, heads=4, kv_heads=2,
                   max_positions=64, seed=0, **overrides):
    """A randomly initialized `arch` causal LM in eval mode, its weights drawn after torch.manual_seed(seed).
    intermediate is the MLP width (OPT's ffn_dim, GPT-2's n_inner; MoE experts get a quarter of it);
    kv_heads applies to the architectures with grouped-query attention."""
    config_class, model_class, sizes = _config_and_class(arch, layers, hidden, intermediate, vocab, heads, kv_heads,
                                                         max_positions)
    config = config_class(**{**sizes, **overrides})
    torch.manual_seed(seed)
    return model_class(config).eval()


def save_tiny(model, tokenizer, path):
    """Write `model` (and `tokenizer`, unless None) as a Hugging Face checkpoint directory; returns `path`."""
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
