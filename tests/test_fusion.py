"""runtime.fusion: the compiled pointwise pieces compute what transformers' own do."""

import functools
import inspect

import pytest
import torch

from factories import tiny_causal_lm
from oracles import decode_torch
from quantkit.runtime.fusion import RECOMPILE_LIMIT, fuse_pointwise, unfuse_pointwise
from quantkit.runtime.generate import StaticGreedyDecoder


def test_fused_llama_matches_eager_and_decodes_the_same_tokens():
    from transformers.models.llama import modeling_llama

    model = tiny_causal_lm(vocab=97)
    original_rotary = modeling_llama.apply_rotary_pos_emb
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        want_tokens = StaticGreedyDecoder(model, max_len=24, batch_size=2).generate(ids, 8)
    try:
        counts = fuse_pointwise(model)
        assert counts == {"rms_norm": 2 * 2 + 1, "mlp": 2, "rotary": 1, "rotary_angles": 1, "residual_norm": 2}
        assert modeling_llama.apply_rotary_pos_emb is not original_rotary
        assert fuse_pointwise(model) == counts  # idempotent
        assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT  # room for every layout in a process
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
    model = tiny_causal_lm(vocab=97, layers=1)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    try:
        counts = fuse_pointwise(model)
        assert counts["mlp"] == 0 and counts["rms_norm"] == 3
        assert "forward" not in vars(model.model.layers[0].mlp)
    finally:
        unfuse_pointwise(model)
    opt = tiny_causal_lm("opt", vocab=50, hidden=32, intermediate=64, layers=1, heads=2, max_positions=32)
    assert fuse_pointwise(opt) == {"rms_norm": 0, "mlp": 0, "rotary": 0, "rotary_angles": 0, "residual_norm": 0}


def test_residual_adds_are_normed_in_the_kernel_that_adds_them(monkeypatch):
    """Each layer adds its residuals and norms the sums in one call (the next layer's input norm and the
    final norm included): with the compiled functions run eagerly the logits are bit-equal to the unfused
    model's, and only the first input norm is computed on its own."""
    from quantkit.runtime import fusion

    calls = []

    def eager(fn):
        def run(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return run

    monkeypatch.setattr(fusion, "_compiled", eager)
    model = tiny_causal_lm(vocab=97, layers=3)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = model(ids, output_hidden_states=True)
    keys, modules = list(model.state_dict()), len(list(model.modules()))
    try:
        assert fuse_pointwise(model)["residual_norm"] == 3
        assert model.model.layers[2]._quantkit_next_norm is model.model.norm
        assert list(model.state_dict()) == keys and len(list(model.modules())) == modules  # no new submodules
        calls.clear()
        with torch.inference_mode():
            got = model(ids, output_hidden_states=True)
        assert torch.equal(got.logits, want.logits)
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states, strict=True))
        assert calls.count("rms_norm_torch") == 1 and calls.count("add_rms_norm_torch") == 2 * 3
        assert not any("_quantkit_pending" in vars(m) for m in model.modules())  # every handed-on norm was taken
        # a norm given another tensor than the one the layer added computes it itself
        norm = model.model.layers[1].input_layernorm
        x = torch.randn(2, 7, 64)
        norm._quantkit_pending = (x.clone(), torch.zeros(2, 7, 64), x._version)
        assert torch.equal(norm(x), fusion.add_norm.rms_norm_torch(x, norm.weight, norm.variance_epsilon))
    finally:
        unfuse_pointwise(model)
    assert not any(name in vars(m) for m in model.modules()
                   for name in ("forward", "_quantkit_next_norm", "_quantkit_pending"))


def test_a_handed_on_norm_is_not_used_after_an_in_place_change(monkeypatch):
    """A forward hook that scales a layer's output in place (outside inference mode, where torch counts
    in-place changes): the next layer norms the changed tensor, as unfused."""
    from quantkit.runtime import fusion

    monkeypatch.setattr(fusion, "_compiled", lambda fn: fn)
    model = tiny_causal_lm(vocab=97, layers=2)
    model.model.layers[0].register_forward_hook(lambda module, args, out: out.mul_(2))
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(ids).logits
        try:
            fuse_pointwise(model)
            assert torch.equal(model(ids).logits, want)
        finally:
            unfuse_pointwise(model)


def test_a_decoder_layer_that_differs_is_not_restated(monkeypatch):
    from transformers.models.llama import modeling_llama

    from quantkit.runtime import fusion
    from quantkit.runtime.fusion import _restated_layer

    monkeypatch.setattr(fusion, "_compiled", lambda fn: fn)  # eager: bit-equal to the unfused model

    assert _restated_layer(modeling_llama.LlamaDecoderLayer.forward)

    class ScaledLayer(modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):
            return 2 * super().forward(hidden_states, *args, **kwargs)

    assert not _restated_layer(ScaledLayer.forward)

    def passthrough(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            return fn(*args, **kwargs)
        return run

    # the same statements under an unknown decorator: what the decorator does would be lost
    assert not _restated_layer(passthrough(inspect.unwrap(modeling_llama.LlamaDecoderLayer.forward)))
    model = tiny_causal_lm(vocab=97, layers=2)
    layer = model.model.layers[1]
    layer.__class__ = ScaledLayer  # its own forward: the residual fusion must leave it alone
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = model(ids).logits
    try:
        assert fuse_pointwise(model)["residual_norm"] == 1
        assert "forward" not in vars(layer)
        # layer 0 hands no norm on to a layer whose code is not known: it adds and returns
        assert "_quantkit_next_norm" not in vars(model.model.layers[0])
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, want)
    finally:
        unfuse_pointwise(model)


def _quantize_linears(model, kind):
    """Every decoder linear as a QuantLinear: "uniform" (RTN 4-bit g32) or "anyprec" (random 5-bit parent)."""
    from quantkit.formats.anyprec import AnyPrecisionTensor
    from quantkit.methods import make_method
    from quantkit.runtime import QuantLinear

    gen = torch.Generator().manual_seed(3)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    for name, linear in linears:
        k, d = linear.weight.shape
        if kind == "uniform":
            qt, _ = make_method("rtn", bits=4, group_size=32).quantize(linear.weight.detach(), None)
        else:
            planes = torch.randint(-(2**31), 2**31 - 1, (5, k, d // 32), dtype=torch.int32, generator=gen)
            luts = {b: (0.05 * torch.randn(k, 2**b, generator=gen)).sort(dim=1).values.half() for b in (3, 4, 5)}
            qt = AnyPrecisionTensor(planes=planes, luts=luts, seed_bits=3, parent_bits=5, in_features=d)
        model.set_submodule(name, QuantLinear(qt, None, bits=4 if kind == "anyprec" else None))
    return model


@pytest.mark.parametrize("kind", ["float", "uniform", "anyprec"])
def test_stacked_projections_compute_the_same_outputs(kind):
    from quantkit.runtime.fusion import fuse_projections

    model = tiny_causal_lm(vocab=97)
    if kind != "float":
        _quantize_linears(model, kind)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = model(ids).logits
    stacked = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    originals = {n: m for n, m in model.named_modules() if n.endswith(stacked)}
    handle = fuse_projections(model)
    assert handle.count == 2 * 2  # qkv and gate/up of both layers
    stacked = model.model.layers[0].self_attn.fused_q_k_v
    assert stacked.out_features == 64 + 2 * 32  # 4 query heads, 2 key/value heads of 16
    if kind == "float":  # with the compiled pointwise parts too: SiLU*mul then reads the stacked [gate | up]
        fuse_pointwise(model)
    try:
        with torch.inference_mode():
            got = model(ids).logits
            tokens = StaticGreedyDecoder(model, max_len=20, batch_size=2).generate(ids, 6)
    finally:
        unfuse_pointwise(model)
    # uniform runs on its BCQ form, which rounds the offset to fp16: not bit-equal to the reference
    tol = 1e-5 if kind != "uniform" else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    handle.undo()
    assert {n: m for n, m in model.named_modules() if n in originals} == originals
    assert not any(n.startswith("fused") for layer in model.model.layers for n, _ in layer.named_children())
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)
        assert torch.equal(StaticGreedyDecoder(model, max_len=20, batch_size=2).generate(ids, 6), tokens)


def test_projections_that_differ_stay_apart():
    from quantkit.runtime.fusion import fuse_projections

    model = _quantize_linears(tiny_causal_lm(vocab=97, layers=2), "anyprec")
    model.model.layers[0].self_attn.k_proj.set_bits(3)  # q, v serve 4 bits
    # gate uniform, up BCQ (the same codes converted): both serve bits=None, but they are different formats
    from quantkit.formats.bcq import bcq_from_uniform
    from quantkit.runtime import QuantLinear

    uniform = _quantize_linears(tiny_causal_lm(vocab=97, layers=1), "uniform").model.layers[0].mlp
    model.model.layers[1].mlp.gate_proj = uniform.gate_proj
    model.model.layers[1].mlp.up_proj = QuantLinear(bcq_from_uniform(uniform.up_proj.qtensor()), None)
    handle = fuse_projections(model)
    assert handle.count == 2
    assert hasattr(model.model.layers[0].mlp, "fused_gate_up")
    assert hasattr(model.model.layers[1].self_attn, "fused_q_k_v")
    assert not hasattr(model.model.layers[0].self_attn, "fused_q_k_v")
    assert not hasattr(model.model.layers[1].mlp, "fused_gate_up")


def _fake_accumulations(monkeypatch):
    """QuantLinear.accumulate as the LUT kernels do it, faked on the CPU with the contract's checks (the
    sums are zero on entry); returns the list of modules it ran for. The fused functions run eagerly, so
    that bit-equality can be the check."""
    import torch.nn.functional as F

    from quantkit.runtime import QuantLinear, fusion

    calls = []

    def fake_accumulate(module, x):
        tokens = x.reshape(-1, x.shape[-1]).shape[0]
        if tokens > 8:
            return None  # more tokens go to dequantize + cuBLAS
        sums = module.__dict__.setdefault("_fake_sums", torch.zeros(8 * module.out_features))
        assert not sums.any(), "the previous sums were not consumed"
        calls.append(module)
        view = sums[: tokens * module.out_features].view(*x.shape[:-1], module.out_features)
        view += F.linear(x, module.dequantized_weight(x.dtype)).float()  # rounds to the matvec's fp16 output
        return view

    monkeypatch.setattr(QuantLinear, "accumulate", fake_accumulate)
    monkeypatch.setattr(fusion, "_compiled", lambda fn: fn)
    return calls


def test_quantized_matvecs_leave_their_sums_to_the_next_kernel(monkeypatch):
    """With stacked quantized projections, each fused layer runs o_proj, gate/up and down as accumulations
    (faked on the CPU, `_fake_accumulations`): the add + norm and SiLU·mul finish them, the logits are
    bit-equal to the unfused model's, and every accumulator is left zero. A module with a forward hook
    (layer 1's down projection, layer 2's attention) keeps its call."""
    from quantkit.runtime import QuantLinear
    from quantkit.runtime.fusion import fuse_projections

    calls = _fake_accumulations(monkeypatch)
    model = _quantize_linears(tiny_causal_lm(vocab=97, layers=3), "uniform").half()
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(8))
    handle = fuse_projections(model)  # stacked uniform projections run on their BCQ form: the reference too
    ids10 = torch.cat([ids, ids], dim=1)  # 10 tokens: past the fused decode path, ordinary calls
    with torch.inference_mode():
        want = model(ids).logits
        want10 = model(ids10).logits  # its own reference: CPU GEMMs may sum 10 rows in another order than 5
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, out: None)
    model.model.layers[2].self_attn.register_forward_hook(lambda module, args, out: None)
    try:
        fuse_pointwise(model)
        with torch.inference_mode():
            got = model(ids).logits
            assert torch.equal(got, want)
            layers = model.model.layers
            expected = [layers[0].self_attn.o_proj, layers[0].mlp.fused_gate_up, layers[0].mlp.down_proj,
                        layers[1].self_attn.o_proj, layers[2].mlp.fused_gate_up, layers[2].mlp.down_proj]
            assert [id(m) for m in calls] == [id(m) for m in expected]
            assert all(layer.self_attn._modules["o_proj"] is layer.self_attn.o_proj for layer in layers)  # put back
            assert all(isinstance(layer.self_attn.o_proj, QuantLinear) for layer in layers)
            sums = [m.__dict__["_fake_sums"] for m in model.modules() if "_fake_sums" in m.__dict__]
            assert len(sums) == 6 and not any(s.any() for s in sums)
            calls.clear()
            assert torch.equal(model(ids10).logits, want10)
            assert calls == []
    finally:
        unfuse_pointwise(model)
        handle.undo()


def test_attention_outputs_are_accumulated_only_when_returned_untouched():
    from transformers.models.llama import modeling_llama

    from quantkit.runtime.fusion import _returns_o_proj_output

    assert _returns_o_proj_output(modeling_llama.LlamaAttention.forward)

    class Scaled(modeling_llama.LlamaAttention):
        def forward(self, hidden_states, **kwargs):
            attn_output, attn_weights = super().forward(hidden_states, **kwargs)
            return 2 * attn_output, attn_weights

    class Rescaled(modeling_llama.LlamaAttention):  # ends the same way, but uses o_proj's output before
        def forward(self, hidden_states, **kwargs):
            attn_output = self.o_proj(hidden_states)
            attn_weights = None
            attn_output = self.o_proj(attn_output)
            return attn_output, attn_weights

    assert not _returns_o_proj_output(Scaled.forward) and not _returns_o_proj_output(Rescaled.forward)


def _split_decoder(model, max_len):
    """A StaticGreedyDecoder whose decode steps hand each layer's key and value to its attention call, as
    on CUDA with Triton (forced here on the CPU)."""
    from quantkit.runtime import decode_attention

    decoder = StaticGreedyDecoder(model, max_len=max_len)
    decoder.split_attention = True
    decoder._attention_step = decode_attention.DecodeStep(
        decoder.pos, decode_attention.counters(1, model.config.num_attention_heads, "cpu"),
        layer_cache=decoder._layer_cache)
    return decoder


@pytest.mark.parametrize("kernel", ["emulated", "not-served"])
def test_decode_steps_rotate_and_finish_qkv_in_the_attention_call(monkeypatch, kernel):
    """In a decode step of the split decoder, a fused layer restates the attention: the stacked q/k/v
    matvec stops at its sums and the attention kernel finishes them, rotates the query and key and writes
    the cache (here `decode_torch`, the kernel's PyTorch form, stands in for it on the CPU). Where the
    kernel does not serve ("not-served": the CPU as it is), the restated forward finishes, rotates and
    calls the attention function itself. Either way: the tokens of the unfused model, and every
    accumulator left zero."""
    from quantkit.runtime import decode_attention
    from quantkit.runtime.fusion import fuse_projections

    calls = _fake_accumulations(monkeypatch)
    model = _quantize_linears(tiny_causal_lm(vocab=97, layers=3), "uniform").half()
    handle = fuse_projections(model)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(8))
    kernel_calls = []
    if kernel == "emulated":
        def decode(query, keys, values, position, scale, head_counters=None, new_kv=None, rope=None, consume=False):
            kernel_calls.append((rope is not None, consume))
            return decode_torch(query, keys, values, position, scale, new_kv, rope, consume)

        monkeypatch.setattr(decode_attention, "supported", lambda *args, **kwargs: True)
        monkeypatch.setattr(decode_attention, "decode", decode)
    with torch.inference_mode():
        want = _split_decoder(model, 16).generate(ids, 6)
        assert kernel_calls == ([(False, False)] * 3 * 5 if kernel == "emulated" else [])  # unfused: plain calls
    try:
        fuse_pointwise(model)
        calls.clear()
        kernel_calls.clear()
        with torch.inference_mode():
            got = _split_decoder(model, 16).generate(ids, 6)
        assert torch.equal(got, want)
        layers = model.model.layers
        prefill = [m for layer in layers
                   for m in (layer.self_attn.o_proj, layer.mlp.fused_gate_up, layer.mlp.down_proj)]
        per_step = [m for layer in layers for m in (layer.self_attn.fused_q_k_v, layer.self_attn.o_proj,
                                                    layer.mlp.fused_gate_up, layer.mlp.down_proj)]
        assert [id(m) for m in calls] == [id(m) for m in prefill + per_step * 5]  # 5 decode steps
        if kernel == "emulated":
            assert kernel_calls == [(True, True)] * 3 * 5
        sums = [m.__dict__["_fake_sums"] for m in model.modules() if "_fake_sums" in m.__dict__]
        assert len(sums) == 4 * 3 and not any(s.any() for s in sums)
    finally:
        unfuse_pointwise(model)
        handle.undo()


def test_the_restated_attention_is_llamas():
    from transformers.models.llama import modeling_llama

    from quantkit.runtime.fusion import _restated_attention

    restated = _restated_attention(modeling_llama.LlamaAttention.forward)
    assert restated is not None and restated[0] in ("past_key_values", "cache")

    class Scaled(modeling_llama.LlamaAttention):  # the same statements but one
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value_states = 2 * self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)  # noqa: F821
            if past_key_values is not None:
                key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(  # noqa: F821
                self.config._attn_implementation, eager_attention_forward)  # noqa: F821
            attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask, dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)  # noqa: E501
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
            attn_output = self.o_proj(attn_output)
            return attn_output, attn_weights

    assert _restated_attention(Scaled.forward) is None


def test_rotary_angles_are_restated_for_static_rope_types_only():
    from transformers.models.llama import modeling_llama

    from quantkit.runtime.fusion import _restates_rotary

    assert _restates_rotary(modeling_llama.LlamaRotaryEmbedding.forward)
    model = tiny_causal_lm(vocab=97)
    rotary = model.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float16)
    positions = torch.tensor([[0, 1, 7, 63], [5, 6, 8, 9]])
    want = rotary(x, positions)
    try:
        assert fuse_pointwise(model)["rotary_angles"] == 1 and "forward" in vars(rotary)
        got = rotary(x, positions)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == torch.float16 and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
    finally:
        unfuse_pointwise(model)
    assert "forward" not in vars(rotary)
    rotary.rope_type = "dynamic"  # frequencies that the decorator updates: left alone
    try:
        assert fuse_pointwise(model)["rotary_angles"] == 0
    finally:
        unfuse_pointwise(model)
