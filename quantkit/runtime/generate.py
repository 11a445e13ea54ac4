"""Generation with loaded models (quantized or float): transformers' generate, and a static-cache greedy decoder.

`generate_text` runs transformers' `generate` with the KV cache on (loaded artifacts set
config.use_cache = False for perplexity; generation must not inherit that), greedy or sampled,
and times it. It is what `quantkit generate` prints.

`StaticGreedyDecoder` decodes greedily from a transformers StaticCache with every decode-step
input in a fixed buffer: token ids, positions and a ready-made 4-D additive attention mask, which
transformers uses as given (so none of its mask-building code, some of which reads tensor values
on the host, runs per step). The next token is chosen on the device and written back into the
input buffer, so one decode step has fixed shapes and addresses and no host synchronisation: it
can be captured once in a CUDA graph (`capture()`) and replayed token after token with no Python
between kernels: without it Python overhead (tens of ms per token for 32 layers) hides what the
kernels save. Llama-style decoders (rotary positions from position_ids).

Decode steps write each layer's new key and value into the static cache at the decoder's own position
buffer, one compiled function per layer on CUDA (two small kernels). transformers' StaticCache does the
same write as five kernels (an arange and two adds for a device-side position counter, then two
index_copy_): 8.4 µs per layer on an H100 against 2.3 µs, 0.24 ms of every Llama-2-7B decode step
whatever the weight format. Prefill keeps transformers' own update (it allocates the cache on first use).

On CUDA with Triton, decode steps attend with `decode_attention` instead (the cache split over many
programs, positions past the current one not read, rather than SDPA over the whole masked cache), and
that kernel also writes the new key and value, so the compiled write above is not needed there.
"""

import functools
import inspect
import time
import warnings

import torch

from quantkit.errors import QuantkitError
from quantkit.runtime import decode_attention


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_device(model):
    return next(model.parameters()).device


def completion_lengths(new_ids, eos_token_id):
    """Tokens generated per row: up to and including the first eos (generate pads after it)."""
    lengths = []
    for row in new_ids.tolist():
        n = len(row)
        if eos_token_id is not None and eos_token_id in row:
            n = row.index(eos_token_id) + 1
        lengths.append(n)
    return lengths


def _check_request(prompts, max_new_tokens, min_new_tokens=1, why=""):
    if not prompts:
        raise QuantkitError("give at least one --prompt")
    if max_new_tokens < min_new_tokens:
        raise QuantkitError(f"{why}--max-new-tokens must be at least {min_new_tokens}")


def _check_context(model, prompt_len, max_new_tokens):
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise QuantkitError(f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
                            f"context of {limit} tokens")


def _completions(tokenizer, new_ids):
    """generate_text's per-prompt result keys from the new token ids [B, n], each row cut after its first eos."""
    lengths = completion_lengths(new_ids, tokenizer.eos_token_id)
    ids = [row[:n] for row, n in zip(new_ids.tolist(), lengths)]
    return {"completions": tokenizer.batch_decode(ids, skip_special_tokens=True), "token_ids": ids,
            "new_tokens": lengths}


@torch.inference_mode()
def generate_text(model, tokenizer, prompts, max_new_tokens=64, greedy=True, temperature=1.0, top_p=1.0, seed=0):
    """Complete each prompt with `model.generate` (KV cache on). Sampling is seeded with `seed`.

    Returns {"completions", "token_ids" (new ids per prompt), "new_tokens" (per prompt, up to eos),
    "prompt_tokens", "seconds", "tokens_per_s" (all new tokens / wall time), "ms_per_step"}. The clock
    starts after one untimed forward, which pays the one-time costs (dequantized-weight caches on the
    CPU path, kernel builds and workspaces on CUDA) that are not decoding speed.
    """
    prompts = list(prompts)
    _check_request(prompts, max_new_tokens)
    device = _model_device(model)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"  # decoder-only: new tokens must follow the prompt directly
    if tokenizer.pad_token is None and len(prompts) > 1:
        if tokenizer.eos_token is None:
            raise QuantkitError("several prompts need padding, but the tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=len(prompts) > 1).to(device)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad_token
    prompt_len = enc["input_ids"].shape[1]
    if (enc["attention_mask"].sum(dim=1) == 0).any():
        raise QuantkitError("a --prompt is empty after tokenization")
    _check_context(model, prompt_len, max_new_tokens)
    kwargs = {"max_new_tokens": max_new_tokens, "use_cache": True, "pad_token_id": pad, "do_sample": not greedy}
    if greedy:
        kwargs.update(temperature=None, top_p=None, top_k=None)  # silence the model's own sampling defaults
    else:
        if temperature <= 0:
            raise QuantkitError("--temperature must be positive (use --greedy for argmax decoding)")
        if not 0 < top_p <= 1:
            raise QuantkitError("--top-p must be in (0, 1]")
        kwargs.update(temperature=temperature, top_p=top_p, top_k=None)
        torch.manual_seed(seed)  # seeds the CUDA generators too
    model(input_ids=enc["input_ids"][:, :1], use_cache=False)  # warm-up, see the docstring
    _sync(device)
    start = time.perf_counter()
    out = model.generate(**enc, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - start
    new_ids = out[:, prompt_len:]
    result = _completions(tokenizer, new_ids)
    return {
        **result,
        "prompt_tokens": enc["attention_mask"].sum(dim=1).tolist(),
        "seconds": seconds,
        "tokens_per_s": sum(result["new_tokens"]) / seconds,
        "ms_per_step": 1000 * seconds / new_ids.shape[1],
    }


@functools.cache
def _compiled_write_kv():
    # one graph for both writes; not fullgraph: past dynamo's recompile limit it runs eagerly instead
    return torch.compile(decode_attention.write_kv, dynamic=False)


def _pick(logits):
    """The greedy token [B, 1] of each row of logits [B, vocab] (the first of equal maxima, as argmax)."""
    return logits.argmax(dim=-1, keepdim=True)


@functools.cache
def _compiled_pick():
    return torch.compile(_pick, dynamic=False)


def _static_layer_kv(cache, layer_idx):
    """The allocated key and value tensors [B, H, max_len, D] of one layer of a transformers StaticCache
    (one StaticLayer per decoder layer since transformers 4.56), or None before its first update
    allocates them (transformers' update then)."""
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    if layer is None or not getattr(layer, "is_initialized", False):
        return None
    return layer.keys, layer.values


@torch.inference_mode()
def generate_static(model, tokenizer, prompts, max_new_tokens=64):
    """Greedy completions from a static KV cache with StaticGreedyDecoder, each decode step one CUDA-graph
    replay on CUDA (eager steps elsewhere): the decoding speed the kernels allow, without transformers'
    per-token Python. The prompts must tokenize to the same length (no padding in a static batch).

    Returns generate_text's keys, with "seconds" / "tokens_per_s" / "ms_per_step" for the decode steps
    alone (all max_new_tokens - 1 of them: decoding does not stop at eos, completions are cut there),
    plus "prefill_ms", "cuda_graph" and, when a CUDA capture failed, "graph_error" (eager steps then). The
    clock starts after the capture and an untimed generation.
    """
    prompts = list(prompts)
    _check_request(prompts, max_new_tokens, 2, why="--static-cache times decode steps: ")
    device = _model_device(model)
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    if any(len(r) == 0 for r in rows):
        raise QuantkitError("a --prompt is empty after tokenization")
    if len({len(r) for r in rows}) != 1:
        lengths = ", ".join(str(len(r)) for r in rows)
        raise QuantkitError(f"--static-cache decodes prompts of one length together; these tokenize to {lengths} "
                            "tokens (give them one at a time, or drop --static-cache)")
    prompt_ids = torch.tensor(rows, device=device)
    _check_context(model, prompt_ids.shape[1], max_new_tokens)
    decoder = StaticGreedyDecoder(model, max_len=prompt_ids.shape[1] + max_new_tokens, batch_size=len(prompts))
    decoder.generate(prompt_ids, 2)  # one-time work (kernel builds, weight caches) before capture and clock
    graph_error = None
    if device.type == "cuda":
        try:
            decoder.capture()
        except Exception as exc:  # an op that cannot be captured: decode with eager steps, and say why
            decoder.graph, graph_error = None, f"{type(exc).__name__}: {exc}"
    decoder.generate(prompt_ids, 2)  # graph upload
    _sync(device)
    start = time.perf_counter()
    first = decoder.prefill(prompt_ids)
    _sync(device)
    prefilled = time.perf_counter()
    rest = decoder.steps(max_new_tokens - 1)
    _sync(device)
    seconds = time.perf_counter() - prefilled
    steps = max_new_tokens - 1
    return {
        **_completions(tokenizer, torch.cat([first, rest], dim=1)),
        "prompt_tokens": [len(r) for r in rows],
        "seconds": seconds,
        "tokens_per_s": len(prompts) * steps / seconds,
        "ms_per_step": 1000 * seconds / steps,
        "prefill_ms": 1000 * (prefilled - start),
        "cuda_graph": decoder.graph is not None,
        **({} if graph_error is None else {"graph_error": graph_error}),
    }


def _configs(config):
    """A model config and its sub-configs, nested ones included, outer first."""
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            found += _configs(sub)
    return found


class StaticGreedyDecoder:
    """Greedy decoding of a batch of equal-length prompts, one decode step capturable in a CUDA graph.

    Use: `dec = StaticGreedyDecoder(model, max_len)`; optionally `dec.capture()` (CUDA; also after
    earlier generation, as it rewinds the cache first); then `dec.generate(prompt_ids, n)`, or
    `dec.prefill(prompt_ids)` followed by `dec.steps(n)` to time the two apart. `max_len` bounds
    prompt + generated tokens (the static cache's length; note that attention then reads all max_len
    cached positions every step, masked, as with transformers' own static cache). A captured graph
    freezes whatever the model did while capturing: capture again after changing it
    (QuantLinear.set_bits, use_kernels, new weights).

    attention: "split" attends in decode steps with `decode_attention` where it can serve them (CUDA,
    Triton, an SDPA model), and that kernel writes each layer's new key and value into the cache;
    "sdpa" keeps transformers' SDPA over the masked cache.
    """

    ATTENTION_MODES = ("split", "sdpa")

    def __init__(self, model, max_len, batch_size=1, attention="split"):
        from transformers import StaticCache

        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len, self.batch_size = max_len, batch_size
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)  # next input token
        self.pos = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)  # its position
        self.kv_index = torch.arange(max_len, device=self.device)
        self._mask_values = (torch.zeros((), dtype=self.dtype, device=self.device),
                             torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device))
        # the greedy pick, compiled where Triton is (inductor's reduction: 7.5 µs against ATen's 10.6-11 for
        # a 32000-entry row on an H100)
        self._pick = _compiled_pick() if self.device.type == "cuda" and decode_attention.available() else _pick
        self.graph = None
        self.filled = 0  # cache positions written by prefill and steps (host-side bookkeeping only)
        self._in_step = False  # a decode step runs: the cache writes at self.pos (see the module docstring)
        self._cache_update = self.cache.update
        self.cache.update = self._update_cache
        # transformers releases differ: older ones index the static cache by an explicit cache_position,
        # newer ones keep a device-side counter in the cache; the logits-trimming argument was renamed
        params = inspect.signature(model.forward).parameters
        self._pass_cache_position = "cache_position" in params
        self._keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None)
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.24
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in ("sdpa", "eager"):
            raise QuantkitError(f"StaticGreedyDecoder needs sdpa or eager attention (its mask is additive), not {attn}")
        if attention not in self.ATTENTION_MODES:
            raise QuantkitError(f"attention must be one of {', '.join(self.ATTENTION_MODES)}, not {attention!r}")
        # the split kernel replaces SDPA only: an "eager" model keeps its own attention
        self.split_attention = (attention == "split" and attn == "sdpa" and self.device.type == "cuda"
                                and decode_attention.available())
        if self.split_attention:  # rows share one position
            self._attention_step = decode_attention.DecodeStep(
                self.pos, decode_attention.counters(batch_size, model.config.num_attention_heads, self.device),
                layer_cache=self._layer_cache)

    def _layer_cache(self, layer_idx):
        return _static_layer_kv(self.cache, layer_idx) if self._in_step else None

    def _update_cache(self, key_states, value_states, layer_idx, *args, **kwargs):
        kv = self._layer_cache(layer_idx)
        if kv is None:
            return self._cache_update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.split_attention:  # its attention call writes them (attention_forward)
            self._attention_step.pending[layer_idx] = (key_states, value_states)
            return kv
        write = _compiled_write_kv() if key_states.is_cuda else decode_attention.write_kv
        write(kv[0], kv[1], key_states, value_states, self.pos[0])  # rows share one position
        return kv

    def _mask(self, positions):
        """Additive mask [B, 1, q, max_len]: 0 where key index <= query position, dtype-min elsewhere."""
        keep = self.kv_index.view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)
        return torch.where(keep, *self._mask_values)  # two kernels a step (zeros + not + fill: four)

    def _next_token(self, ids, positions):
        kwargs = {"input_ids": ids, "position_ids": positions, "attention_mask": self._mask(positions),
                  self._cache_arg: self.cache, "use_cache": True}
        if self._pass_cache_position:
            kwargs["cache_position"] = positions[0]
        if self._keep_arg:
            kwargs[self._keep_arg] = 1
        if not (self._in_step and self.split_attention):
            return self._pick(self.model(**kwargs).logits[:, -1])
        # the step's attention calls go to decode_attention (which falls back to SDPA for anything it
        # does not serve); the model's own setting is restored at once, so nothing else sees the switch
        config = self.model.config
        kwargs[decode_attention.STEP_KWARG] = self._attention_step
        saved = [(c, c._attn_implementation) for c in _configs(config)]
        config._attn_implementation = decode_attention.register()  # transformers sets it on sub-configs too
        try:
            logits = self.model(**kwargs).logits[:, -1]
        finally:
            for c, value in saved:  # outer before inner: each sub-config ends with its own value
                c._attn_implementation = value
        if self._attention_step.pending:
            # some layer's attention never received the step (a model that does not pass its forward
            # kwargs down): its new key and value are not in the cache and it attended without them.
            # This decoder goes back to SDPA and the separate cache write, and the step runs again
            # (writing a position twice is harmless).
            self._attention_step.pending.clear()
            self.split_attention = False
            warnings.warn("split decode attention did not reach every layer of this model; using SDPA", stacklevel=2)
            return self._next_token(ids, positions)
        return self._pick(logits)

    def _step(self):
        self._in_step = True
        try:
            self.ids.copy_(self._next_token(self.ids, self.pos))
        finally:
            self._in_step = False
        self.pos.add_(1)

    @torch.inference_mode()
    def prefill(self, prompt_ids):
        """Reset the cache, run the prompt [B, P]; returns the first generated token [B, 1]."""
        batch, length = prompt_ids.shape
        if batch != self.batch_size:
            raise QuantkitError(f"decoder built for batch {self.batch_size}, got {batch} prompts")
        if length >= self.max_len:
            raise QuantkitError(f"prompt of {length} tokens leaves no room in a static cache of {self.max_len}")
        self.cache.reset()  # in place: a captured graph keeps pointing at the same cache tensors
        positions = torch.arange(length, device=self.device).expand(batch, length)
        self.ids.copy_(self._next_token(prompt_ids.to(self.device), positions))
        self.pos.fill_(length)
        self.filled = length
        return self.ids.clone()

    @torch.inference_mode()
    def steps(self, n):
        """n decode steps after prefill (graph replays when captured); returns their tokens [B, n]."""
        if self.filled + n > self.max_len:
            raise QuantkitError(f"{n} more tokens overflow the static cache ({self.filled} of {self.max_len} used)")
        out = torch.empty(self.batch_size, n, dtype=torch.long, device=self.device)
        for i in range(n):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            out[:, i : i + 1].copy_(self.ids)
        self.filled += n
        return out

    def generate(self, prompt_ids, new_tokens):
        """prompt [B, P] -> the `new_tokens` greedy tokens [B, new_tokens]."""
        first = self.prefill(prompt_ids)
        return torch.cat([first, self.steps(new_tokens - 1)], dim=1) if new_tokens > 1 else first

    @torch.inference_mode()
    def warm_up(self, n=2):
        """Run n >= 1 throwaway decode steps from position 0 of an emptied cache: kernels do their one-time
        work (lazy layout conversions) and the cache allocates its tensors here, not inside a capture.
        The cache then holds junk: the next prefill resets it."""
        if not 1 <= n < self.max_len:
            raise QuantkitError(f"{n} warm-up steps do not fit a static cache of {self.max_len}")
        # Steps write at self.pos, transformers' own update (a cache it has not allocated yet) at its
        # device-side counter: rewind both, or steps after an earlier generate() write past max_len
        # (index_copy_ out of bounds)
        self.cache.reset()
        self.pos.zero_()
        self.ids.zero_()
        for _ in range(n):
            self._step()
        self.filled = self.max_len  # no steps() before the next prefill

    @torch.inference_mode()
    def capture(self, warmup=2):
        """Capture one decode step in a CUDA graph, after `warm_up(warmup)` on a side stream (as CUDA
        graph capture wants). The captured step is recorded, not run; the next prefill resets the cache."""
        if self.device.type != "cuda":
            raise QuantkitError("CUDA graphs need the model on a CUDA device")
        self.graph = None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # with split attention the second step is the first whose layers hand their keys over (the
            # first allocates the cache), so a model that drops them is caught here, not while capturing
            self.warm_up(max(warmup, 2) if self.split_attention else warmup)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.graph = graph
        self.filled = self.max_len  # the cache holds warm-up junk until the next prefill
        return graph
