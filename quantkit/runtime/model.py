"""The fast decoder: quantkit's own model of the Llama family (Llama, Mistral, Qwen2, Qwen3) for generation.

A Decoder is built on the meta device from a DecoderConfig and given its weights by runtime/weights.py:
q/k/v stacked into one projection (wqkv) and gate/up into another (w13), each a QuantLinear of the
stored format (or an fp16 nn.Linear), so one matvec launch reads the rows three or two separate ones
would. `setup_caches(batch, max_len)` allocates a static KV cache [B, Hkv, max_len, D] per layer and the
rope tables. `prefill(ids, lengths)` runs the prompts (right-padded, each row its own length) through the
projections' prefill path (QuantLinear: dequantize + cuBLAS) and SDPA, writing the cache; `decode(ids,
positions)` is one step of B rows, each at its own position, every kernel a visible line below and a
custom operator (runtime/ops.py), so the step can be captured in a CUDA graph (runtime/generate.py).

A decode step of one layer, on CUDA with the LUT kernels (BCQ, and uniform via its BCQ form):
  wqkv matvec, its fp32 sums left unfinished -> decode attention (finishes and rotates q/k, writes k/v
  into the cache at each row's position, attends) -> wo matvec (sums) -> residual add + post-attention
  RMSNorm (finishes the sums) -> w13 matvec (sums) -> SiLU·mul (finishes them) -> w2 matvec (sums), which
  the next layer's add + input RMSNorm (or the final norm) finishes. fp16 projections leave sums too (the
  split-K matvec, runtime/dense_matvec.py); formats whose kernels leave none (any-precision, layers with a
  bias) hand their finished outputs to the same operators.

Everything is read from the transformers config object (`DecoderConfig.from_transformers`), nothing from
transformers' code. Qwen3's per-head q/k RMSNorm comes before the rotation; q/k/v biases (Qwen2, or
attention_bias) and any other bias come with the weights (runtime/weights.py checks that the q/k/v ones
are there when the config says so). Rotary: default, linear and llama3 frequency scaling.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.runtime import decode_attention, ops
from quantkit.runtime.quant_linear import QuantLinear

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(QuantkitError):
    """The fast decoder does not serve this model (the transformers model does)."""


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before the rotation
    attention_bias: bool  # q/k/v have biases (Qwen2 always; Llama and Qwen3 with attention_bias)
    rope_theta: float
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_factor: float = 1.0  # linear, llama3
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_positions: int = 8192  # llama3
    sliding_window: int | None = None  # attention window; served only where the cache fits in it
    eos_token_ids: tuple = ()

    @classmethod
    def from_transformers(cls, config):
        """The config of a transformers Llama-family config object; UnsupportedModel (one line) otherwise."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"the fast decoder serves {', '.join(SUPPORTED_MODEL_TYPES)}, not {model_type!r}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"the fast decoder's MLP is SiLU-gated; this model uses {act!r}")
        heads = config.num_attention_heads
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        window = getattr(config, "sliding_window", None) if layer_types != {"full_attention"} or \
            model_type == "mistral" else None
        eos = getattr(config, "eos_token_id", None)
        return cls(model_type=model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   qk_norm=model_type == "qwen3", sliding_window=window,
                   attention_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
                   eos_token_ids=tuple(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]),
                   **_rope_fields(config))


def _rope_fields(config):
    """The rotary settings from transformers' rope_parameters (5.x) or rope_theta / rope_scaling (earlier)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"the fast decoder's rotary embedding is {', '.join(ROPE_TYPES)}, not {rope_type!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel("the fast decoder rotates whole heads (partial_rotary_factor 1)")
    fields = {"rope_theta": float(params["rope_theta"]), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                      rope_high_freq_factor=float(params["high_freq_factor"]),
                      rope_original_max_positions=int(params["original_max_position_embeddings"]))
    return fields


def rope_inverse_frequencies(cfg: DecoderConfig):
    """fp32 [D/2] inverse frequencies θ^(-2i/D), with the config's scaling; on the CPU."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":  # Llama 3.1: long wavelengths slowed by `factor`, a smooth ramp between
        low_wavelen = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.rope_factor, inv_freq)
        smooth = (cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        ramp = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, ramp, scaled)
    return inv_freq


def rope_tables(cfg: DecoderConfig, length, dtype, device):
    """(cos, sin) [length, D] in `dtype`: row p holds position p's angles (each one fp32 product, then
    cos/sin on `device`, then rounded), both halves of a head alike."""
    freqs = torch.arange(length, device=device).float()[:, None] * rope_inverse_frequencies(cfg).to(device)[None]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_prefill(x, cos, sin):
    """x [B, heads, P, D] rotated by the tables' first P rows, in x's dtype op by op (a Llama attention's
    eager rotation): x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, width, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width), requires_grad=False)
        self.eps = eps


class Concat(nn.Module):
    """Projections that could not be stacked into one (formats, groups or bit-widths differ): their outputs
    side by side, as one stacked module would give them."""

    def __init__(self, parts):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x):
        return torch.cat([ops.project(p, x) for p in self.parts], dim=-1)


@dataclass
class LayerCache:
    keys: torch.Tensor  # [B, Hkv, max_len, D]
    values: torch.Tensor


class Block(nn.Module):
    """One decoder layer. wqkv, wo, w13, w2: QuantLinear, nn.Linear or Concat, given by runtime/weights.py."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.wqkv = self.wo = self.w13 = self.w2 = None
        self.scale = cfg.head_dim**-0.5

    def _qkv_normed(self, qkv):
        """q/k/v [..., (H + 2 Hkv)·D] with q and k RMS-normed per head (Qwen3)."""
        cfg = self.cfg
        q, k, v = qkv.split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                             cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q = ops.rms_norm(q.reshape(-1, cfg.head_dim), self.q_norm.weight, self.q_norm.eps).view(q.shape)
        k = ops.rms_norm(k.reshape(-1, cfg.head_dim), self.k_norm.weight, self.k_norm.eps).view(k.shape)
        return torch.cat([q, k, v], dim=-1)

    def decode(self, hidden, normed, cache: LayerCache, positions, rope, counters):
        """One step of B rows: hidden [B, hidden] the residual stream, normed its input norm -> (hidden after
        attention, the MLP's output to add, whether that is fp32 sums to consume)."""
        if self.cfg.qk_norm:
            qkv, consume = self._qkv_normed(ops.project(self.wqkv, normed)), False
        else:
            qkv, consume = ops.project_for_consumer(self.wqkv, normed)
        # cache_settled: this layer's cache is written only by this call, once per step, and every step starts
        # with the embedding lookup, launched without overlap: no kernel that may still run has written it
        attn = ops.attend(qkv, cache.keys, cache.values, positions, *rope, counters, self.cfg.num_heads, self.scale,
                          consume, True)
        out, consume = ops.project_for_consumer(self.wo, attn)
        hidden, normed = ops.add_rms_norm(hidden, out, self.mlp_norm.weight, self.mlp_norm.eps, consume)
        gate_up, consume = ops.project_for_consumer(self.w13, normed)
        act = ops.silu_mul_op(gate_up, hidden.dtype, consume)
        down, consume = ops.project_for_consumer(self.w2, act)
        return hidden, down, consume

    def prefill(self, hidden, normed, cache: LayerCache, rope):
        """The prompt [B, P, hidden] (rows right-padded; causal, so padding is never attended by real
        tokens): writes cache positions 0..P-1 -> (hidden after attention, the MLP's output to add)."""
        cfg = self.cfg
        b, p, _ = hidden.shape
        qkv = ops.project(self.wqkv, normed)
        if cfg.qk_norm:
            qkv = self._qkv_normed(qkv)
        q, k, v = qkv.split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                             cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q, k, v = (t.view(b, p, -1, cfg.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = (t[:p] for t in rope)
        q, k = rotate_prefill(q, cos, sin), rotate_prefill(k, cos, sin)
        cache.keys[:, :, :p] = k
        cache.values[:, :, :p] = v
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        out = ops.project(self.wo, attn.transpose(1, 2).reshape(b, p, -1))
        hidden, normed = ops.add_rms_norm(hidden, out, self.mlp_norm.weight, self.mlp_norm.eps, False)
        act = ops.silu_mul_op(ops.project(self.w13, normed), hidden.dtype, False)
        return hidden, ops.project(self.w2, act)


class Decoder(nn.Module):
    """The model: embeddings, layers, final norm, head (tied to the embeddings or not). Build on the meta
    device and load with runtime/weights.py; then setup_caches, prefill, decode."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.caches, self.rope, self.counters = [], None, None
        self.weights_version = 0  # counts set_bits calls: a graph captured before one is stale
        self.requires_grad_(False)

    @property
    def device(self):
        return self.embed.weight.device

    @property
    def dtype(self):
        return self.embed.weight.dtype

    def set_bits(self, bits):
        """Serve `bits` of every any-precision projection (QuantLinear.set_bits; generators capture again)."""
        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.set_bits(bits)
        self.weights_version += 1

    def setup_caches(self, batch, max_len):
        """Static KV caches for `batch` rows of up to `max_len` positions, rope tables, attention counters.
        Allocated once per (batch, max_len): a captured graph keeps pointing at them."""
        cfg = self.cfg
        if self.caches and self.caches[0].keys.shape[0] == batch and self.caches[0].keys.shape[2] == max_len:
            return
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.caches = [LayerCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                                  torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]
        self.rope = rope_tables(cfg, max_len, self.dtype, self.device)
        self.counters = decode_attention.counters(batch, cfg.num_heads, self.device)

    @property
    def max_len(self):
        return self.caches[0].keys.shape[2] if self.caches else 0

    def _head(self, hidden, delta, consume):
        """The last residual add with the final norm, then the head: logits [rows, vocab]."""
        _, normed = ops.add_rms_norm(hidden, delta, self.norm.weight, self.norm.eps, consume)
        return F.linear(normed, self.lm_head)

    @torch.inference_mode()
    def prefill(self, ids, lengths):
        """ids [B, P] right-padded prompts, lengths [B] (each >= 1) -> logits [B, vocab] at each row's last
        prompt token. Writes cache positions 0..P-1 (the padding's entries are overwritten before any read)."""
        b, p = ids.shape
        first = self.layers[0]
        hidden = self.embed(ids)
        normed = ops.rms_norm(hidden, first.attn_norm.weight, first.attn_norm.eps)
        delta = None  # the previous layer's MLP output, added in the kernel of the next norm
        for layer, cache in zip(self.layers, self.caches):
            if delta is not None:
                hidden, normed = ops.add_rms_norm(hidden, delta, layer.attn_norm.weight, layer.attn_norm.eps, False)
            hidden, delta = layer.prefill(hidden, normed, cache, self.rope)
        rows = torch.arange(b, device=ids.device)
        last = lengths.to(ids.device) - 1
        return self._head(hidden[rows, last], delta[rows, last], False)

    def decode(self, ids, positions):
        """One decode step: ids [B] the rows' tokens, positions [B] where each goes in the cache (a device
        tensor: one captured step serves every position) -> logits [B, vocab]. No host synchronisation."""
        first = self.layers[0]
        hidden = self.embed(ids)
        normed = ops.rms_norm(hidden, first.attn_norm.weight, first.attn_norm.eps)
        delta, consume = None, False  # the previous layer's MLP output (or its fp32 sums), added in the next norm
        for layer, cache in zip(self.layers, self.caches):
            if delta is not None:
                hidden, normed = ops.add_rms_norm(hidden, delta, layer.attn_norm.weight, layer.attn_norm.eps, consume)
            hidden, delta, consume = layer.decode(hidden, normed, cache, positions, self.rope, self.counters)
        return self._head(hidden, delta, consume)
