"""Fewer kernels between the linears of a decode step: torch.compile of the pointwise parts.

At batch 1 a decode step of a Llama-style decoder launches about 40 kernels per layer and only 7 of them
are linears: RMSNorm alone is 7 (cast, square, mean, add, rsqrt, two multiplies), the rotary embedding 10,
SiLU·mul 2. Even replayed from a CUDA graph each costs a few µs, which on an H100 adds up to ~2.5 ms of an
8 ms fp16 Llama-2-7B step, the same for every weight format: the part of the step quantized linears cannot
speed up. `fuse_pointwise(model)` compiles those three pieces with torch.compile (one fused kernel each)
and leaves the linears, attention, cache writes and residual adds as they are, so float and quantized
models get the same fusion and their speed ratio stays a statement about the linears.

Only pieces whose code is known are touched: an RMSNorm / MLP forward or rotary function is replaced when
its source equals transformers' Llama one (other architectures copy it verbatim: Mistral, Qwen2, ...),
and the MLP only with a SiLU activation. The fused functions compute the same expressions; inductor keeps
intermediates in fp32 where eager rounds each op to the input dtype, so fp16 outputs can differ in the
last bit. The rotary function is replaced in the model's modeling module, i.e. for every model of that
architecture in the process (it is the same function, compiled).
"""

import functools
import inspect
import sys
import types

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError


def _rms_norm(hidden, weight, eps):
    dtype = hidden.dtype
    h = hidden.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _silu_mul(gate, up):
    return F.silu(gate) * up


@functools.cache
def _compiled(fn):
    return torch.compile(fn, fullgraph=True)


def _fused_rms_forward(self, hidden_states):
    return _compiled(_rms_norm)(hidden_states, self.weight, self.variance_epsilon)


def _fused_mlp_forward(self, x):
    return self.down_proj(_compiled(_silu_mul)(self.gate_proj(x), self.up_proj(x)))


@functools.cache
def _llama_sources():
    from transformers.models.llama import modeling_llama as llama

    rotary = inspect.unwrap(llama.apply_rotary_pos_emb)
    return (inspect.getsource(llama.LlamaRMSNorm.forward), inspect.getsource(llama.LlamaMLP.forward),
            inspect.getsource(rotary))


def _same_source(fn, source):
    try:
        return inspect.getsource(inspect.unwrap(fn)) == source
    except (OSError, TypeError):
        return False


def fuse_pointwise(model):
    """Compile the RMSNorms, SiLU·mul MLP activations and rotary embedding of `model` in place (see the
    module docstring); returns {"rms_norm": n, "mlp": n, "rotary": n} modules/functions replaced.
    Idempotent; unfuse_pointwise undoes it. Raises QuantkitError when torch.compile is unusable here (probed on a tiny input)."""
    norm_src, mlp_src, rotary_src = _llama_sources()
    device = next(model.parameters()).device
    try:  # fail here, clearly, rather than on the first decode step
        probe = torch.ones(2, 8, device=device)
        _compiled(_silu_mul)(probe, probe)
    except Exception as exc:
        raise QuantkitError(f"torch.compile is not usable on {device}: {type(exc).__name__}: {exc}") from exc
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0}
    modeling_modules = set()
    for module in model.modules():
        cls = type(module)
        if cls.__name__.endswith("RMSNorm") and _same_source(cls.forward, norm_src):
            module.forward = types.MethodType(_fused_rms_forward, module)
            counts["rms_norm"] += 1
        elif (hasattr(module, "gate_proj") and _same_source(cls.forward, mlp_src)
              and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")):
            module.forward = types.MethodType(_fused_mlp_forward, module)
            counts["mlp"] += 1
        elif hasattr(module, "q_proj"):
            modeling_modules.add(sys.modules[cls.__module__])
    for modeling in modeling_modules:
        rotary = getattr(modeling, "apply_rotary_pos_emb", None)
        if rotary is None:
            continue
        if getattr(rotary, "_quantkit_fused", False):
            counts["rotary"] += 1
        elif _same_source(rotary, rotary_src):
            fused = _compiled(inspect.unwrap(rotary))
            fused._quantkit_fused, fused._quantkit_original = True, rotary
            modeling.apply_rotary_pos_emb = fused
            counts["rotary"] += 1
    return counts


def unfuse_pointwise(model):
    """Undo fuse_pointwise: the classes' own forwards and the original rotary function again."""
    for module in model.modules():
        if getattr(module.forward, "__func__", None) in (_fused_rms_forward, _fused_mlp_forward):
            del module.forward
        if hasattr(module, "q_proj"):
            modeling = sys.modules[type(module).__module__]
            rotary = getattr(modeling, "apply_rotary_pos_emb", None)
            if getattr(rotary, "_quantkit_fused", False):
                modeling.apply_rotary_pos_emb = rotary._quantkit_original
