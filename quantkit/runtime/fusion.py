"""Fewer kernels between the linears of a decode step: torch.compile of the pointwise parts, and more.

At batch 1 a decode step of a Llama-style decoder launches about 40 kernels per layer and only 7 of them
are linears: RMSNorm alone is 7 (cast, square, mean, add, rsqrt, two multiplies), the rotary embedding
10 (and 8 more per step for its angles), SiLU·mul 2. Even replayed from a CUDA graph each costs a few µs,
which on an H100 adds up to ~2.5 ms of an 8 ms fp16 Llama-2-7B step, the same for every weight format: the
part of the step quantized linears cannot speed up. `fuse_pointwise(model)` compiles those pieces with
torch.compile (one fused kernel each), and each residual add with the RMSNorm that follows it (the decoder
layer's post-attention norm, and the next layer's input norm or the final norm after the MLP): one kernel
returns both the sum and its norm. In the decode steps of StaticGreedyDecoder's split attention, a fused
layer restates the attention (`_decode_step_attention`): decode_attention's kernel rotates q and k itself.
Linears stay as they are, so float and quantized models get the same fusion and their speed ratio stays a
statement about the linears. One exception belongs to the linears: in a fused layer, a matvec on the LUT
kernels whose consumer is known stops at its fp32 split-K sums (QuantLinear.accumulate) and that consumer
finishes them, saving the matvec its own tile-completion step: the stacked q/k/v's go to the attention
kernel, the stacked gate/up's to the SiLU·mul, down's and o_proj's to the add + norm after them.

Only pieces whose code is known are touched: an RMSNorm / MLP / rotary embedding / decoder-layer /
attention forward or rotary function is replaced when its source equals transformers' Llama one (other
architectures copy it verbatim: Mistral, Qwen2, ...), the MLP only with a SiLU activation, and the decoder
layer, attention and rotary angles only when their bodies are the ones restated here (checked statement by
statement). The fused functions compute the same expressions; inductor keeps intermediates in fp32 where
eager rounds each op to the input dtype, so fp16 outputs can differ in the last bit. The rotary function is
replaced in the model's modeling module, i.e. for every model of that architecture in the process (it is
the same function, compiled).
"""

import functools
import inspect
import sys
import types
import warnings

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.formats.bcq import BCQQuantizedTensor, bcq_from_uniform
from quantkit.runtime import add_norm, decode_attention, silu_mul
from quantkit.runtime.quant_linear import QuantLinear


def _silu_mul(gate, up):
    return F.silu(gate) * up


# Compiled variants one function may collect: prefill and decode, separate and stacked projections (a
# strided view), each float or quantized model in the process. Dynamo's default of 8 ran out in the
# decode benchmark, after which new variants ran eagerly (two kernels for SiLU·mul instead of one).
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn):
    # dynamic: prefill and decode shapes, and the strided views of stacked projections, share one graph
    # where dynamo can. Not fullgraph: past the recompile limit these run eagerly instead of failing.
    return torch.compile(fn, dynamic=True)


def _version(tensor):
    return None if tensor.is_inference() else tensor._version  # inference tensors keep no version counter


def _fused_rms_forward(self, hidden_states):
    # the previous decoder layer may have normed this very tensor already, in the kernel that added it
    # (unchanged since, where torch counts in-place changes)
    pending = self.__dict__.pop("_quantkit_pending", None)
    if pending is not None and pending[0] is hidden_states and pending[2] == _version(hidden_states):
        return pending[1]
    return _compiled(add_norm.rms_norm_torch)(hidden_states, self.weight, self.variance_epsilon)


def _add_then_norm(residual, delta, norm, consume=False):
    """residual + delta, and norm(residual + delta), from one kernel: runtime.add_norm's on CUDA (1 µs
    less per call than inductor's at batch 1), else the compiled expression. consume: delta is a matvec's
    fp32 accumulator (QuantLinear.accumulate), added as its output would be and left zero."""
    if add_norm.supported(residual, delta, norm.weight, consume):
        return add_norm.add_rms_norm(residual, delta, norm.weight, norm.variance_epsilon, consume=consume)
    if consume:
        delta = QuantLinear.finish(delta, residual.dtype)
    return _compiled(add_norm.add_rms_norm_torch)(residual, delta, norm.weight, norm.variance_epsilon)


def _hooked(modules):
    hooks = torch.nn.modules.module
    return (bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)
            or any(m._forward_hooks or m._forward_pre_hooks for m in modules))


class _Accumulating(torch.nn.Module):
    """Stands in for a QuantLinear during one call of an attention forward that returns its output as it
    is (`_attention_output`): the matvec as an accumulation, its sums kept in `sums`, else the call."""

    def __init__(self, inner):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a submodule: the stand-in is never registered
        self.sums = None

    def forward(self, x):
        self.sums = self.inner.accumulate(x)
        return self.inner(x) if self.sums is None else self.sums


@functools.cache  # per class forward
def _returns_o_proj_output(forward):
    """Whether an attention forward ends with `attn_output = self.o_proj(attn_output)` and returns that
    tensor untouched, uses o_proj nowhere else, and has no decorator but transformers' deprecate_kwarg
    renames (which touch only the arguments). transformers' Llama attention, and those copying it."""
    import ast
    import textwrap

    if _rename_wrappers(forward) is None:
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return False
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return False
    body = [ast.unparse(statement) for statement in tree.body[0].body[-2:]]
    uses = sum(isinstance(node, ast.Attribute) and node.attr == "o_proj" for node in ast.walk(tree))
    decorators_known = all(ast.unparse(getattr(d, "func", d)) == "deprecate_kwarg" for d in tree.body[0].decorator_list)
    return (body == ["attn_output = self.o_proj(attn_output)", "return (attn_output, attn_weights)"]
            and uses == 1 and decorators_known)


def _attention_output(attn, x, kwargs):
    """(attention output, whether it is o_proj's fp32 accumulator, for the caller to consume). A decode
    step of StaticGreedyDecoder goes to `_decode_step_attention` where it serves. Otherwise, when o_proj
    is a QuantLinear and the attention's forward returns its output untouched (`_returns_o_proj_output`),
    o_proj runs as an accumulation through a stand-in put in its place for this one call."""
    restated = _decode_step_attention(attn, x, kwargs)
    if restated is not None:
        return restated
    o_proj = attn._modules.get("o_proj")
    if not (isinstance(o_proj, QuantLinear) and _returns_o_proj_output(type(attn).forward)
            and not _hooked((attn, o_proj))):
        return attn(hidden_states=x, **kwargs)[0], False
    stand_in = attn.__dict__.get("_quantkit_accumulating")
    if stand_in is None or stand_in.inner is not o_proj:
        stand_in = _Accumulating(o_proj)
        object.__setattr__(attn, "_quantkit_accumulating", stand_in)  # kept, not registered
    attn._modules["o_proj"] = stand_in  # the dict itself: no registration work per call
    try:
        out = attn(hidden_states=x, **kwargs)[0]
    finally:
        attn._modules["o_proj"] = o_proj
    sums, stand_in.sums = stand_in.sums, None
    if sums is None:
        return out, False
    if out is not sums:  # not for the forwards accepted above; clear the sums rather than leave them
        sums.zero_()
        return out.to(x.dtype), False
    return out, True


# LlamaAttention.forward's statements, which _decode_step_attention restates for a decode step; {cache} is
# its cache parameter's name, {update} what else its update call passes (both changed in transformers 5.24)
_ATTENTION_STATEMENTS = """
input_shape = hidden_states.shape[:-1]
hidden_shape = (*input_shape, -1, self.head_dim)
query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
cos, sin = position_embeddings
query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
if {cache} is not None:
    key_states, value_states = {cache}.update(key_states, value_states, self.layer_idx{update})
attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask, dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
attn_output = attn_output.reshape(*input_shape, -1).contiguous()
attn_output = self.o_proj(attn_output)
return attn_output, attn_weights
"""


@functools.cache  # per class forward
def _restated_attention(forward):
    """(cache parameter name, (old, new) keyword renames) when `forward` is the attention forward that
    _decode_step_attention restates (transformers' Llama one, and those copying it): self, hidden_states,
    position_embeddings, attention_mask, the cache and **kwargs; the statements of _ATTENTION_STATEMENTS;
    no decorator but deprecate_kwarg renames. Else None."""
    import ast
    import textwrap

    depth = _rename_wrappers(forward)
    if depth is None:
        return None
    try:
        parameters = list(inspect.signature(forward).parameters.values())
        found = _renames_and_body(ast.parse(textwrap.dedent(inspect.getsource(forward))), depth)
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    names = [p.name for p in parameters]
    if (found is None or len(names) != 6 or names[:4] != ["self", "hidden_states", "position_embeddings", "attention_mask"]
            or parameters[-1].kind is not inspect.Parameter.VAR_KEYWORD or names[-1] != "kwargs"):
        return None
    renames, body = found
    for update in ("", ", kwargs=kwargs"):
        expected = ast.parse(_ATTENTION_STATEMENTS.format(cache=names[4], update=update)).body
        if body == tuple(ast.unparse(statement) for statement in expected):
            return names[4], renames
    return None


@functools.cache  # per function
def _has_llama_source(fn, which):
    return _same_source(fn, _llama_sources()[which])


def _rotates_as_llama(modeling):
    """Whether a modeling module's apply_rotary_pos_emb (ours compiled, or its own) and rotate_half are
    transformers' Llama ones: the rotation decode_attention's kernel does."""
    rotary = getattr(modeling, "apply_rotary_pos_emb", None)
    rotary = getattr(rotary, "_quantkit_original", rotary)
    return (rotary is not None and _has_llama_source(rotary, "rotary")
            and _has_llama_source(getattr(modeling, "rotate_half", None), "rotate_half"))


def _decode_step_attention(attn, x, kwargs):
    """One decode step's attention as transformers' Llama forward computes it (`_restated_attention`), with
    the rotary embedding done inside decode_attention's kernel, which also writes the step's key and value
    into the cache; where q/k/v are slices of one stacked QuantLinear on the LUT kernels, their matvec
    stops at its fp32 sums (QuantLinear.accumulate) and that kernel finishes and clears them too: the
    rotary kernel and the matvec's tile completion fewer per layer. Serves the steps of StaticGreedyDecoder that hand the key and value to the
    attention call (their DecodeStep has `layer_cache`), the attention function being decode_attention's;
    returns what _attention_output does, or None where it does not serve (the forward runs as usual)."""
    step = kwargs.get(decode_attention.STEP_KWARG)
    if step is None or step.layer_cache is None or attn.training or _hooked((attn,)):
        return None
    restated = _restated_attention(type(attn).forward)
    if restated is None:
        return None
    cache_name, renames = restated
    kwargs = dict(kwargs)
    for old, new in renames:  # what the forward's deprecate_kwarg decorators do (the layer warned already)
        if old in kwargs:
            kwargs.setdefault(new, kwargs.pop(old))
    position_embeddings = kwargs.pop("position_embeddings", None)
    attention_mask = kwargs.pop("attention_mask", None)
    cache = kwargs.pop(cache_name, None)
    modeling = sys.modules[type(attn).__module__]
    interfaces = getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None)
    if (position_embeddings is None or cache is None or interfaces is None or not _rotates_as_llama(modeling)
            or interfaces.get(attn.config._attn_implementation) is not decode_attention.attention_forward
            or not decode_attention.plain(attn, kwargs)):
        return None
    layer_kv = step.layer_cache(attn.layer_idx)
    if layer_kv is None:  # the cache allocates it in its own update: the forward as written
        return None
    keys, values = layer_kv
    names = ("q_proj", "k_proj", "v_proj")
    shape = (*x.shape[:-1], -1, attn.head_dim)

    def per_head(stacked_output):  # q, k, v [B, heads, T, D] from the stacked projection's rows
        return tuple(stacked_output[..., s.start : s.stop].view(shape).transpose(1, 2)
                     for s in (getattr(attn, name) for name in names))

    stacked = _stacked_quantized(attn, names)
    sums = None if stacked is None else stacked.accumulate(x)
    if sums is None:  # the module calls, in the forward's order
        q, k, v = (getattr(attn, name)(x).view(shape).transpose(1, 2) for name in names)
    else:
        q, k, v = per_head(sums)
    cos, sin = position_embeddings
    consume = sums is not None
    if (decode_attention.supported(q, keys, values, consume=consume)
            and decode_attention.new_kv_fits((k, v), keys, consume) and decode_attention.rope_fits((cos, sin), q)):
        out = decode_attention.decode(q, keys, values, step.position, attn.scaling, step.head_counters,
                                      new_kv=(k, v), rope=(cos, sin), consume=consume)
    else:  # the forward's own steps; the attention function writes the key and value (pending) or runs SDPA
        if consume:
            q, k, v = per_head(QuantLinear.finish(sums, x.dtype))
        q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        step.pending[attn.layer_idx] = (k, v)
        out, _ = decode_attention.attention_forward(attn, q, keys, values, attention_mask, dropout=0.0,
                                                    scaling=attn.scaling, **kwargs)
    out = out.reshape(*x.shape[:-1], -1).contiguous()
    o_proj = attn.o_proj
    o_sums = o_proj.accumulate(out) if isinstance(o_proj, QuantLinear) and not _hooked((o_proj,)) else None
    return (o_proj(out), False) if o_sums is None else (o_sums, True)


def _stacked_quantized(parent, names):
    """The QuantLinear whose output the modules `names` of `parent` are consecutive slices of, in order and
    covering all of it (fuse_projections), when none of them has forward hooks (an accumulation bypasses
    the modules' calls); else None."""
    slices = [getattr(parent, name, None) for name in names]
    if not all(isinstance(s, _Slice) for s in slices):
        return None
    stacked = slices[0].stacked
    bounds = [0] + [s.stop for s in slices]
    if not (isinstance(stacked, QuantLinear) and all(s.stacked is stacked for s in slices)
            and [s.start for s in slices] == bounds[:-1] and bounds[-1] == stacked.out_features):
        return None
    return None if _hooked((*slices, stacked)) else stacked


def _accumulating_projections(mlp):
    """(stacked gate/up, down) QuantLinears of a fused MLP that `_mlp_output` may run as accumulations,
    else None: gate and up must be the two halves of one stacked module (fuse_projections), and no
    forward hooks anywhere on the way (the accumulations bypass the modules' calls)."""
    stacked = _stacked_quantized(mlp, ("gate_proj", "up_proj"))
    down = getattr(mlp, "down_proj", None)
    if not (_is_fused(mlp, _fused_mlp_forward) and stacked is not None and isinstance(down, QuantLinear)
            and mlp.up_proj.out_features == mlp.gate_proj.out_features):
        return None
    return None if _hooked((mlp, down)) else (stacked, down)


def _mlp_output(mlp, x):
    """(mlp(x), whether it is the down projection's fp32 accumulator, for the caller to consume). Where
    the LUT kernels serve both matvecs of the MLP (`_accumulating_projections`), gate/up and down stop at
    their split-K sums: silu_mul finishes gate/up's (rounded as the matvec would, then cleared), and the
    caller's add + norm finishes down's. Else the MLP's own forward."""
    projections = _accumulating_projections(mlp)
    sums = None if projections is None else projections[0].accumulate(x)
    if sums is None:
        return mlp(x), False
    if silu_mul.supported(sums, x.dtype):
        activated = silu_mul.silu_mul_consuming(sums, x.dtype)
    else:
        activated = silu_mul.silu_mul_consuming_torch(sums, x.dtype)
    down_sums = projections[1].accumulate(activated)
    return (projections[1](activated), False) if down_sums is None else (down_sums, True)


# LlamaDecoderLayer.forward's statements (comments and layout aside), which _fused_layer_forward restates;
# {args} are the forward's own keyword parameters passed on by name (transformers releases rename them)
_LAYER_STATEMENTS = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    "hidden_states, _ = self.self_attn(hidden_states=hidden_states, {args}**kwargs)",
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
)


def _fused_layer_forward(self, hidden_states, *args, **kwargs):
    params, renames = _restated_layer(type(self).forward)
    if args or self.training:  # the class's forward (transformers' wrapper around it checkpoints in training)
        return type(self).forward(self, hidden_states, *args, **kwargs)
    for old, new in renames:  # what the forward's deprecate_kwarg decorators do
        if old in kwargs:
            warnings.warn(f"{old} is deprecated, use {new}", FutureWarning, stacklevel=2)
            kwargs.setdefault(new, kwargs.pop(old))
    passed = {name: kwargs.pop(name, default) for name, default in params}
    attn, consume = _attention_output(self.self_attn, self.input_layernorm(hidden_states), {**passed, **kwargs})
    hidden_states, normed = _add_then_norm(hidden_states, attn, self.post_attention_layernorm, consume)
    following = self.__dict__.get("_quantkit_next_norm")  # the next layer's input norm, or the final norm
    if following is None:
        return hidden_states + self.mlp(normed)
    mlp_out, consume = _mlp_output(self.mlp, normed)
    hidden_states, normed = _add_then_norm(hidden_states, mlp_out, following, consume)
    following._quantkit_pending = (hidden_states, normed, _version(hidden_states))  # see _fused_rms_forward
    return hidden_states


def _fused_mlp_forward(self, x):
    # after fuse_projections gate and up are _Slices: two views of one stacked output
    return self.down_proj(_compiled(_silu_mul)(self.gate_proj(x), self.up_proj(x)))


@functools.cache
def _llama_sources():
    from transformers.models.llama import modeling_llama as llama

    rotary = inspect.unwrap(llama.apply_rotary_pos_emb)
    return {"norm": inspect.getsource(llama.LlamaRMSNorm.forward), "mlp": inspect.getsource(llama.LlamaMLP.forward),
            "rotary": inspect.getsource(rotary), "rotate_half": inspect.getsource(llama.rotate_half), "model": inspect.getsource(inspect.unwrap(llama.LlamaModel.forward))}


@functools.cache
def _deprecate_kwarg_code():
    """The code of the wrapper transformers' deprecate_kwarg returns (None without that helper)."""
    try:
        from transformers.utils.deprecation import deprecate_kwarg
    except ImportError:
        return None
    return deprecate_kwarg("old", "99.0", new_name="new")(lambda **kwargs: None).__code__


def _rename_wrappers(fn):
    """How many wrappers `fn` has, when each is transformers' deprecate_kwarg rename; else None."""
    depth = 0
    while hasattr(fn, "__wrapped__"):
        if getattr(fn, "__code__", None) is not _deprecate_kwarg_code():
            return None
        fn, depth = fn.__wrapped__, depth + 1
    return depth


@functools.cache  # per class forward: fuse_pointwise asks for every module of a model
def _restated_layer(forward):
    """((name, default) of the keyword parameters, (old, new) keyword renames) when `forward` is the decoder
    layer _fused_layer_forward restates (transformers' Llama one, and the architectures that copy it), else
    None: self, hidden_states, keyword parameters with defaults
    and **kwargs; the statements of _LAYER_STATEMENTS (parsed, so comments and line breaks do not matter)
    with exactly those parameters passed on to the attention; no decorator but transformers'
    deprecate_kwarg renames (restated too) and its gradient-checkpointing wrapper (see above)."""
    import ast
    import textwrap

    wrapped = getattr(forward, "__wrapped__", None)
    if wrapped is not None and forward.__code__.co_name == "forward_with_checkpointing":
        forward = wrapped
    depth = _rename_wrappers(forward)
    if depth is None:
        return None  # a wrapper whose effect would be lost with the body
    try:
        parameters = list(inspect.signature(forward).parameters.values())
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    named = parameters[2:-1]
    if ([p.name for p in parameters[:2]] != ["self", "hidden_states"] or len(parameters) < 3
            or parameters[-1].kind is not inspect.Parameter.VAR_KEYWORD or parameters[-1].name != "kwargs"
            or any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or p.default is inspect.Parameter.empty
                   for p in named)):
        return None
    renames = _renames_and_body(tree, depth)
    if renames is None:
        return None
    renames, body = renames
    args = "".join(f"{p.name}={p.name}, " for p in named)
    expected = tuple(statement.format(args=args) for statement in _LAYER_STATEMENTS)
    if body != expected:
        return None
    return tuple((p.name, p.default) for p in named), renames


def _renames_and_body(tree, depth):
    """((old, new) keyword renames of its deprecate_kwarg decorators, its statements unparsed, docstring
    aside) of the function a parsed source holds, when every decorator is such a rename and there are
    `depth` of them (the wrappers found on the function); else None."""
    import ast

    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    renames = []
    for decorator in tree.body[0].decorator_list:
        new = [k.value for k in getattr(decorator, "keywords", ()) if k.arg == "new_name"]
        if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "deprecate_kwarg"
                and decorator.args and isinstance(decorator.args[0], ast.Constant)
                and len(new) == 1 == len(decorator.keywords) and isinstance(new[0], ast.Constant)):
            return None  # a decorator whose effect would be lost with the body
        renames.append((decorator.args[0].value, new[0].value))
    if depth != len(renames):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # a docstring
    return tuple(renames), tuple(ast.unparse(statement) for statement in body)


def _same_source(fn, source):
    try:
        return inspect.getsource(inspect.unwrap(fn)) == source
    except (OSError, TypeError):
        return False


# LlamaRotaryEmbedding.forward's statements (transformers 5.17-5.23's matmul form and 5.24's product
# form: with one position per column both compute each angle as one fp32 product), which
# _fused_rotary_forward restates in one compiled kernel instead of eight
_ROTARY_FORWARDS = (
    """
inv_freq_expanded = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(dtype=torch.float, device=x.device)
position_ids_expanded = position_ids[:, None, :].float()
device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != 'mps' else 'cpu'
with maybe_autocast(device_type=device_type, enabled=False):
    freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling
return (cos.to(dtype=x.dtype), sin.to(dtype=x.dtype))
""",
    """
freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
emb = torch.cat((freqs, freqs), dim=-1)
cos = emb.cos() * self.attention_scaling
sin = emb.sin() * self.attention_scaling
return (cos.to(dtype=x.dtype), sin.to(dtype=x.dtype))
""")


def _rotary_angles(inv_freq, position_ids, scaling, dtype):
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _fused_rotary_forward(self, x, position_ids):
    with torch.no_grad():
        return _compiled(_rotary_angles)(self.inv_freq.to(x.device), position_ids, self.attention_scaling, x.dtype)


@functools.cache  # per class forward
def _restates_rotary(forward):
    """Whether a rotary embedding's forward is one of _ROTARY_FORWARDS, decorated by nothing but
    torch.no_grad and transformers' dynamic_rope_update (which changes nothing for static rope types)."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return False
    function = tree.body[0]
    if any(ast.unparse(d) not in ("torch.no_grad()", "dynamic_rope_update") for d in function.decorator_list):
        return False
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # a docstring
    found = tuple(ast.unparse(statement) for statement in body)
    return any(found == tuple(ast.unparse(st) for st in ast.parse(known).body) for known in _ROTARY_FORWARDS)


def _static_rotary(module):
    """Whether a rotary embedding module computes its angles the restated way: a known forward, and a
    rope type whose frequencies never change (not dynamic, not longrope: dynamic_rope_update updates those)."""
    rope_type = getattr(module, "rope_type", None)
    return (isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
            and isinstance(getattr(module, "inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, "attention_scaling", None), (int, float))
            and _restates_rotary(type(module).forward))


def fuse_pointwise(model):
    """Compile the RMSNorms, SiLU·mul MLP activations, rotary embedding (its angles, and its application
    to q/k) and residual adds (with the norm after each) of `model` in place (see the module docstring);
    returns {"rms_norm": n, "mlp": n, "rotary": n, "rotary_angles": n, "residual_norm": n}
    modules/functions replaced (rotary: apply_rotary_pos_emb functions; rotary_angles: rotary embedding
    modules; residual_norm: decoder layers).
    Idempotent; unfuse_pointwise undoes it. Raises torch._dynamo's process-wide recompile limit to at least
    RECOMPILE_LIMIT. Raises QuantkitError when torch.compile is unusable here (probed on a tiny input)."""
    sources = _llama_sources()
    norm_src, mlp_src, rotary_src = sources["norm"], sources["mlp"], sources["rotary"]
    device = next(model.parameters()).device
    dynamo_config = torch._dynamo.config  # process-wide: raised, never lowered
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    try:  # fail here, clearly, rather than on the first decode step
        probe = torch.ones(2, 8, device=device)
        _compiled(_silu_mul)(probe, probe)
    except Exception as exc:
        raise QuantkitError(f"torch.compile is not usable on {device}: {type(exc).__name__}: {exc}") from exc
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0, "rotary_angles": 0, "residual_norm": 0}
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
        elif cls.__name__.endswith("RotaryEmbedding") and _static_rotary(module):
            module.forward = types.MethodType(_fused_rotary_forward, module)
            counts["rotary_angles"] += 1
        elif hasattr(module, "q_proj"):
            modeling_modules.add(sys.modules[cls.__module__])
    for module in model.modules():  # after the norms: a layer is fused only when its norms are
        if _restated_layer(type(module).forward) is not None and _fused_norms(module):
            module.forward = types.MethodType(_fused_layer_forward, module)
            counts["residual_norm"] += 1
    _link_following_norms(model, sources["model"])
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


def _is_fused(module, fused_forward):
    return getattr(getattr(module, "forward", None), "__func__", None) is fused_forward


def _fused_norms(layer):
    return all(_is_fused(getattr(layer, name, None), _fused_rms_forward)
               for name in ("input_layernorm", "post_attention_layernorm"))


def _link_following_norms(model, model_src):
    # A fused layer adds its MLP output and applies the norm that comes next, where the code in between
    # is known: the next layer's input norm when that layer is fused too, the final norm after the last
    # layer the model's loop runs when the model's forward is Llama's.
    for parent in model.modules():
        layers = getattr(parent, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        known_model = _same_source(type(parent).forward, model_src)
        ran = layers[: getattr(getattr(parent, "config", None), "num_hidden_layers", len(layers))]
        following = [layer.input_layernorm if _is_fused(layer, _fused_layer_forward) else None for layer in ran][1:]
        following.append(getattr(parent, "norm", None) if known_model else None)
        for layer, norm in zip(ran, following):
            if _is_fused(layer, _fused_layer_forward) and _is_fused(norm, _fused_rms_forward):
                object.__setattr__(layer, "_quantkit_next_norm", norm)  # not a submodule: no second registration


def unfuse_pointwise(model):
    """Undo fuse_pointwise: the classes' own forwards and the original rotary function again."""
    for module in model.modules():
        if getattr(module.forward, "__func__", None) in (_fused_rms_forward, _fused_mlp_forward, _fused_layer_forward,
                                                          _fused_rotary_forward):
            del module.forward
        for name in ("_quantkit_next_norm", "_quantkit_pending", "_quantkit_accumulating"):
            module.__dict__.pop(name, None)
        if hasattr(module, "q_proj"):
            modeling = sys.modules[type(module).__module__]
            rotary = getattr(modeling, "apply_rotary_pos_emb", None)
            if getattr(rotary, "_quantkit_fused", False):
                modeling.apply_rotary_pos_emb = rotary._quantkit_original


# --- one matvec for projections that share their input ------------------------------------------------
#
# q/k/v (and gate/up) read the same activation: one launch over the stacked rows streams the same bytes
# with fewer, larger kernels (at batch 1 a 4096x4096 matvec is mostly launch and ramp-up). transformers'
# attention and MLP call the projections one by one, so each becomes a _Slice of the stacked module: the
# first computes the stacked output, the others return their rows of it when given the same input tensor.

_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Slice(torch.nn.Module):
    """Rows [start, stop) of `stacked`'s output; the slices of one stack share `state` (the last input
    and its stacked output)."""

    def __init__(self, stacked, start, stop, state):
        super().__init__()
        object.__setattr__(self, "stacked", stacked)  # registered once, on the parent (not per slice)
        self.start, self.stop, self.state = start, stop, state
        self.in_features, self.out_features = stacked.in_features, stop - start

    def forward(self, x):
        if self.start == 0 or self.state.get("input") is not x:  # the first slice always computes
            self.state.update(input=x, output=self.stacked(x))
        out = self.state["output"][..., self.start : self.stop]
        if self.stop == self.stacked.out_features:
            self.state.clear()  # the last slice: nothing kept alive between steps
        return out


def _stack_quantized(mods):
    if len({m.meta["format"] for m in mods}) != 1:
        return None
    tensors = [m.qtensor() for m in mods]
    first = tensors[0]
    if isinstance(first, AnyPrecisionTensor):
        if any((t.seed_bits, t.parent_bits) != (first.seed_bits, first.parent_bits) for t in tensors):
            return None
        return AnyPrecisionTensor(planes=torch.cat([t.planes for t in tensors], dim=1),
                                  luts={b: torch.cat([t.luts[b] for t in tensors]) for b in first.luts},
                                  seed_bits=first.seed_bits, parent_bits=first.parent_bits,
                                  in_features=first.in_features)
    if mods[0].meta["format"] == "uniform":
        if any(m.meta.get("has_g_idx") for m in mods):
            return None
        tensors = [bcq_from_uniform(t) for t in tensors]  # what the kernels run anyway
        first = tensors[0]
    if not all(isinstance(t, BCQQuantizedTensor) for t in tensors):
        return None
    if any((t.bits, t.group_size, t.offset is None) != (first.bits, first.group_size, first.offset is None)
           for t in tensors):
        return None
    return BCQQuantizedTensor(qweight=torch.cat([t.qweight for t in tensors], dim=2),
                              alpha=torch.cat([t.alpha for t in tensors], dim=2),
                              offset=None if first.offset is None else torch.cat([t.offset for t in tensors], dim=1),
                              bits=first.bits, group_size=first.group_size, in_features=first.in_features)


def _stack(mods):
    """One module computing the concatenated outputs of `mods`, or None when they cannot be stacked."""
    if len({m.in_features for m in mods}) != 1:
        return None
    with_bias = [m.bias is not None for m in mods]
    if any(with_bias) and not all(with_bias):
        return None
    bias = torch.cat([m.bias for m in mods]) if all(with_bias) else None
    if all(type(m) is torch.nn.Linear for m in mods):
        w = mods[0].weight
        # built on the meta device (no init of weights about to be replaced), then given the stacked tensors
        stacked = torch.nn.Linear(w.shape[1], sum(m.out_features for m in mods), bias=bias is not None, device="meta")
        stacked.weight = torch.nn.Parameter(torch.cat([m.weight for m in mods]), requires_grad=False)
        if bias is not None:
            stacked.bias = torch.nn.Parameter(bias, requires_grad=False)
        return stacked
    if all(isinstance(m, QuantLinear) for m in mods) and len({m.bits for m in mods}) == 1:
        qt = _stack_quantized(mods)
        if qt is None:
            return None
        return QuantLinear(qt, bias, compute_dtype=mods[0].compute_dtype, cache_weight=mods[0].cache_weight,
                           bits=mods[0].bits)
    return None


class ProjectionFusion:
    """Undo handle of fuse_projections: `undo()` puts the original modules back."""

    def __init__(self):
        self.replaced = []  # (parent, attribute, original module)
        self.added = []  # (parent, attribute of the stacked module)

    @property
    def count(self):
        return len(self.added)

    def undo(self):
        for parent, name, original in self.replaced:
            setattr(parent, name, original)
        for parent, name in self.added:
            delattr(parent, name)
        self.replaced, self.added = [], []


def fuse_projections(model):
    """Stack q/k/v and gate/up of every layer into one linear each (float nn.Linear, or QuantLinear of BCQ,
    uniform via its BCQ form, or any-precision at the same served bit-width); returns a
    ProjectionFusion handle. Groups whose modules differ (format, bits, groups, bias) stay as they are.
    The originals are kept by the handle until undo(), so memory holds both meanwhile; for any-precision,
    call set_bits on the stacked modules (or fuse after choosing the bit-width)."""
    handle = ProjectionFusion()
    for parent in list(model.modules()):
        for names in _GROUPS:
            mods = [getattr(parent, n, None) for n in names]
            if any(m is None or isinstance(m, _Slice) for m in mods):
                continue
            stacked = _stack(mods)
            if stacked is None:
                continue
            attr = "fused_" + "_".join(n.split("_")[0] for n in names)
            setattr(parent, attr, stacked)
            handle.added.append((parent, attr))
            state, start = {}, 0
            for name, module in zip(names, mods):
                stop = start + module.out_features
                setattr(parent, name, _Slice(stacked, start, stop, state))
                handle.replaced.append((parent, name, module))
                start = stop
    return handle
