"""runtime.fusion: the compiled pointwise pieces compute what transformers' own do."""

import torch

from quantkit.runtime.fusion import fuse_pointwise, unfuse_pointwise
from quantkit.runtime.generate import StaticGreedyDecoder


def _tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_fused_llama_matches_eager_and_decodes_the_same_tokens():
    from transformers.models.llama import modeling_llama

    model = _tiny_llama()
    original_rotary = modeling_llama.apply_rotary_pos_emb
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        want_tokens = StaticGreedyDecoder(model, max_len=24, batch_size=2).generate(ids, 8)
    try:
        counts = fuse_pointwise(model)
        assert counts == {"rms_norm": 2 * 2 + 1, "mlp": 2, "rotary": 1}
        assert modeling_llama.apply_rotary_pos_emb is not original_rotary
        assert fuse_pointwise(model) == counts  # idempotent
        with torch.inference_mode():
            got = model(ids).logits
            got_tokens = StaticGreedyDecoder(model, max_len=24, batch_size=2).generate(ids, 8)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got_tokens, want_tokens)
    finally:
        unfuse_pointwise(model)
    assert modeling_llama.apply_rotary_pos_emb is original_rotary
    assert all("forward" not in vars(m) for m in model.modules())


def test_unknown_pieces_are_left_alone():
    """An MLP with another activation keeps its forward; a non-Llama model gets nothing replaced."""
    from transformers import OPTConfig, OPTForCausalLM

    model = _tiny_llama(layers=1)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    try:
        counts = fuse_pointwise(model)
        assert counts["mlp"] == 0 and counts["rms_norm"] == 3
        assert "forward" not in vars(model.model.layers[0].mlp)
    finally:
        unfuse_pointwise(model)
    opt = OPTForCausalLM(OPTConfig(vocab_size=50, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32))
    assert fuse_pointwise(opt) == {"rms_norm": 0, "mlp": 0, "rotary": 0}
