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

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gpt2")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # Llama's layer shape; Qwen2 adds q/k/v biases, Qwen3 q/k norms


def _config_and_class(arch, layers, hidden, intermediate, vocab, heads, kv_heads, max_positions):
    if arch in LLAMA_FAMILY:
        import transformers

        prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
        sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                     head_dim=hidden // heads)  # Qwen3's default head_dim (128) would not follow the sizes
        return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM"), sizes
    if arch == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        return OPTConfig, OPTForCausalLM, dict(
            vocab_size=vocab, hidden_size=hidden, ffn_dim=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=max_positions, word_embed_proj_dim=hidden)
    if arch == "gpt2":  # an architecture quantkit does not support, for the error paths
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2Config, GPT2LMHeadModel, dict(
            vocab_size=vocab, n_embd=hidden, n_inner=intermediate, n_layer=layers, n_head=heads,
            n_positions=max_positions)
    raise ValueError(f"unknown architecture {arch!r}; one of {', '.join(ARCHITECTURES)}")


def tiny_causal_lm(arch="llama", *, layers=2, hidden=64, intermediate=160, vocab=128, heads=4, kv_heads=2,
                   max_positions=64, seed=0, **overrides):
    """A randomly initialized `arch` causal LM in eval mode, its weights drawn after torch.manual_seed(seed).
    intermediate is the MLP width (OPT's ffn_dim, GPT-2's n_inner); kv_heads applies to the Llama family only."""
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
