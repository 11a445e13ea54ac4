"""Generation, timed: the fast decoder (runtime/model.py) or a transformers model, text in and text out.

`generate(model, tokenizer, prompts, ...)` is what `quantkit generate` runs. For a fast Decoder it uses
`FastGenerator`; for a transformers model, `model.generate` with the KV cache on (the reference path, for
architectures the fast decoder does not serve and for the CPU). Both: greedy or sampled (temperature,
top-k, top-p, seeded), each prompt stopped at an end-of-sequence token or a stop string, the tokenizer's
chat template on request, batches of prompts of different lengths.

FastGenerator runs B prompts at once, each row at its own cache position: the prompts are prefilled
right-padded (causal attention: a real token never sees the padding), then every decode step feeds each
row's last token at its own position. A row thus computes what it would alone (up to the rounding of
batched matmuls). On CUDA one decode step (the model's step, the pick of the next token, the bookkeeping)
is captured in a CUDA graph once per (batch, cache length, sampling settings) and replayed token after
token, no Python between kernels and no host synchronisation; the host looks at the tokens only every
`check_every` steps, when end-of-sequence tokens or stop strings could end the generation early.
Sampling draws from the default generator (seeded per call), which CUDA graphs replay safely.
"""

import functools
import time
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import overlap
from quantkit.runtime import dense_matvec
from quantkit.runtime.model import Decoder

CHECK_EVERY = 16  # decode steps between looks at the tokens (one host synchronisation each)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: argmax (greedy), or drawn from softmax(logits / temperature) restricted
    to the top_k most likely tokens (0: all) and the smallest set holding top_p of the probability."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.greedy:
            if not self.temperature > 0:
                raise QuantkitError("--temperature must be positive (use --greedy for argmax decoding)")
            if not 0 < self.top_p <= 1:
                raise QuantkitError("--top-p must be in (0, 1]")
            if self.top_k < 0:
                raise QuantkitError("--top-k must be 0 (off) or positive")


def pick_greedy(logits):
    """The argmax token [B] of logits [B, vocab] (the first of equal maxima)."""
    return logits.argmax(dim=-1)


def pick_sampled(logits, temperature, top_k, top_p):
    """A token [B] drawn from each row of logits [B, vocab]: temperature, then top-k, then top-p (nucleus:
    the most likely tokens until their probability reaches top_p, the first always kept). Drawn as the
    argmax of p / E with E ~ Exp(1), which picks token i with probability p_i and reads nothing back to
    the host (a CUDA graph can hold it)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= top_p  # the mass before a token already reaches top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(beyond, float("-inf")))
    probs = logits.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


@functools.cache
def _compiled_greedy():
    # inductor's reduction: 7.5 µs against ATen's argmax 10.6-11 µs for 32000 logits on an H100
    return torch.compile(pick_greedy, dynamic=False)


def _picker(sampling: Sampling, device):
    if not sampling.greedy:
        return functools.partial(pick_sampled, temperature=sampling.temperature, top_k=sampling.top_k,
                                 top_p=sampling.top_p)
    from quantkit.runtime import decode_attention

    return _compiled_greedy() if device.type == "cuda" and decode_attention.available() else pick_greedy


@dataclass
class _StepState:
    """The decode step's inputs and outputs, at fixed addresses (a captured graph reads and writes them)."""

    ids: torch.Tensor  # [B] each row's last token
    positions: torch.Tensor  # [B] where it goes in the cache
    out: torch.Tensor  # [B, max_new_tokens] the generated tokens
    count: torch.Tensor  # [1] how many of them are written


class FastGenerator:
    """Generation with a fast Decoder: `run(prompt_ids, max_new_tokens, sampling, eos_ids, stop)`.
    use_graphs: capture the decode step in a CUDA graph (default: on CUDA). Graphs are kept per (batch,
    cache length, sampling settings, Decoder.set_bits calls) until the caches are reallocated; after any
    other change to the model (new weights) call `forget_graphs()`."""

    def __init__(self, model: Decoder, use_graphs=None):
        self.model = model
        self.device = model.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.graphs = {}  # key -> (CUDAGraph, _StepState) or (None, _StepState) after a failed capture
        self.graph_error = None
        self._caches = None

    def forget_graphs(self):
        self.graphs.clear()

    def _state(self, batch, max_new_tokens):
        zeros = functools.partial(torch.zeros, dtype=torch.long, device=self.device)
        return _StepState(zeros(batch), zeros(batch), zeros(batch, max_new_tokens), zeros(1))

    def _step(self, state, pick):
        logits = self.model.decode(state.ids, state.positions)
        token = pick(logits)
        state.ids.copy_(token)
        state.positions.add_(1)
        state.out.index_copy_(1, state.count, token[:, None])
        state.count.add_(1)

    def _capture(self, state, pick):
        """Two eager steps on a side stream (kernels build, workspaces and layouts are made, overlapped
        launches settle: none of it may happen inside a capture), then the step captured. The steps write
        junk into the cache, which the next prefill overwrites."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(state, pick)
        torch.cuda.current_stream(self.device).wait_stream(side)
        state.count.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(state, pick)
        return graph

    def _prepared(self, batch, max_len, max_new_tokens, sampling, pick):
        self.model.setup_caches(batch, max_len)
        if self._caches is not self.model.caches:  # new cache tensors: graphs captured on the old ones are stale
            self.graphs.clear()
            self._caches = self.model.caches
        # the kernels a capture records depend on the process switches and deterministic mode as they are now
        key = (batch, max_len, max_new_tokens, self.model.weights_version, sampling.greedy, sampling.temperature,
               sampling.top_k, sampling.top_p, overlap.enabled(), dense_matvec.enabled(),
               torch.are_deterministic_algorithms_enabled())
        if key not in self.graphs:
            state = self._state(batch, max_new_tokens)
            graph = None
            if self.use_graphs:
                try:
                    graph = self._capture(state, pick)
                except Exception as exc:  # an op that cannot be captured: decode with eager steps, and say why
                    self.graph_error = f"{type(exc).__name__}: {exc}"
            self.graphs[key] = (graph, state)
        return self.graphs[key]

    def prepare(self, batch, prompt_len, max_new_tokens, sampling=Sampling()):
        """Allocate the caches and capture the decode step for `batch` prompts of at most `prompt_len`
        tokens and `max_new_tokens`, ahead of `run` (which otherwise does it on first use)."""
        with torch.inference_mode():
            self._prepared(batch, prompt_len + max_new_tokens, max_new_tokens, sampling, _picker(sampling, self.device))

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, prompt_ids, max_new_tokens, sampling=Sampling(), eos_ids=(), stop=None, check_every=CHECK_EVERY):
        """Generate up to `max_new_tokens` after each prompt (a list of token-id lists, any lengths).
        A row ends at a token of `eos_ids` (kept) or where stop(tokens) returns a length (the row keeps
        that many); generation ends when every row has. Returns {"token_ids": per row, "steps": decode
        steps run, "prefill_ms", "decode_s", "ms_per_token" (decode time per step), "tokens_per_s" (rows x
        steps / decode time), "cuda_graph"}."""
        batch, lengths = len(prompt_ids), [len(p) for p in prompt_ids]
        if batch == 0 or min(lengths) == 0:
            raise QuantkitError("give at least one non-empty prompt")
        if max_new_tokens < 1:
            raise QuantkitError("--max-new-tokens must be at least 1")
        cfg = self.model.cfg
        max_len = max(lengths) + max_new_tokens
        if max_len > cfg.max_position_embeddings:
            raise QuantkitError(f"prompt ({max(lengths)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                                f"model's context of {cfg.max_position_embeddings} tokens")
        if cfg.sliding_window is not None and max_len > cfg.sliding_window:
            raise QuantkitError(f"prompt + --max-new-tokens ({max_len}) exceeds the attention window of "
                                f"{cfg.sliding_window} tokens, which the fast decoder does not apply")
        pick = _picker(sampling, self.device)
        graph, state = self._prepared(batch, max_len, max_new_tokens, sampling, pick)
        ids = torch.zeros(batch, max(lengths), dtype=torch.long)
        for row, prompt in enumerate(prompt_ids):
            ids[row, : len(prompt)] = torch.tensor(prompt)
        ids, lengths_t = ids.to(self.device), torch.tensor(lengths, device=self.device)
        if not sampling.greedy:
            torch.manual_seed(sampling.seed)  # the default generators, which the captured step draws from
        self._sync()
        start = time.perf_counter()
        first = pick(self.model.prefill(ids, lengths_t))
        state.ids.copy_(first)
        state.positions.copy_(lengths_t)
        state.out[:, 0] = first
        state.count.fill_(1)
        self._sync()
        prefilled = time.perf_counter()
        ended = {} if eos_ids or stop else None  # row -> tokens it keeps
        steps = 0
        while steps < max_new_tokens - 1:
            chunk = min(check_every if ended is not None else max_new_tokens, max_new_tokens - 1 - steps)
            for _ in range(chunk):
                if graph is not None:
                    graph.replay()
                else:
                    self._step(state, pick)
            steps += chunk
            if ended is not None and self._all_ended(state.out[:, : steps + 1].tolist(), ended, eos_ids, stop):
                break
        self._sync()
        decode_s = time.perf_counter() - prefilled
        rows = state.out[:, : steps + 1].tolist()
        if ended is not None:
            self._all_ended(rows, ended, eos_ids, stop)
            rows = [row[: ended.get(r, len(row))] for r, row in enumerate(rows)]
        return {"token_ids": rows,
                "steps": steps, "prefill_ms": 1000 * (prefilled - start), "decode_s": decode_s,
                "ms_per_token": 1000 * decode_s / steps if steps else None,
                "tokens_per_s": batch * steps / decode_s if steps else None, "cuda_graph": graph is not None}

    @staticmethod
    def _all_ended(rows, ended, eos_ids, stop):
        """Record in `ended` the rows that reached an eos token or a stop; whether all have."""
        for r, row in enumerate(rows):
            if r in ended:
                continue
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), None)
            if stop is not None:
                stopped = stop(row if cut is None else row[:cut])
                cut = stopped if stopped is not None else cut
            if cut is not None:
                ended[r] = cut
        return len(ended) == len(rows)


# --- text in, text out -----------------------------------------------------------------------------------


def encode_prompts(tokenizer, prompts, chat=False):
    """Token ids of each prompt; with chat, as the user turn of the tokenizer's chat template, followed by
    the assistant's turn opening."""
    prompts = list(prompts)
    if not prompts:
        raise QuantkitError("give at least one --prompt")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise QuantkitError("--chat: this tokenizer has no chat template")
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        rows = [tokenizer(p)["input_ids"] for p in prompts]
    if any(len(r) == 0 for r in rows):
        raise QuantkitError("a --prompt is empty after tokenization")
    return rows


def _stop_at_strings(tokenizer, stop_strings):
    """stop(tokens) -> the number of tokens up to the one that completes the first stop string, or None."""
    if not stop_strings:
        return None

    def stop(tokens):
        if not any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stop_strings):
            return None
        return next(n for n in range(1, len(tokens) + 1)
                    if any(s in tokenizer.decode(tokens[:n], skip_special_tokens=True) for s in stop_strings))

    return stop


def _completion_text(tokenizer, tokens, stop_strings):
    """The decoded completion, cut before the first stop string."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    cuts = [text.index(s) for s in stop_strings if s in text]
    return text[: min(cuts)] if cuts else text


def eos_token_ids(tokenizer, model):
    """End-of-sequence ids: the tokenizer's and the model config's (some chat models list several)."""
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if isinstance(model, Decoder):
        ids.update(model.cfg.eos_token_ids)
    else:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids


def generate(model, tokenizer, prompts, max_new_tokens=64, sampling=Sampling(), stop_strings=(), chat=False,
             generator=None):
    """Complete each prompt with a fast Decoder (a FastGenerator; pass `generator` to keep its graphs across
    calls) or a transformers model. Returns {"runtime": "fast" | "transformers", "completions", "token_ids"
    (new ids per prompt, up to and including an eos, or up to the stop string), "new_tokens", "prompt_tokens",
    "ms_per_token", "tokens_per_s", "seconds", ...}: see FastGenerator.run and generate_transformers."""
    rows = encode_prompts(tokenizer, prompts, chat)
    stop_strings = [s for s in stop_strings if s]
    eos = eos_token_ids(tokenizer, model)
    if isinstance(model, Decoder):
        generator = generator or FastGenerator(model)
        out = generator.run(rows, max_new_tokens, sampling, eos, _stop_at_strings(tokenizer, stop_strings))
        out.update(runtime="fast", seconds=out["prefill_ms"] / 1000 + out["decode_s"])
        if generator.graph_error and not out["cuda_graph"]:
            out["graph_error"] = generator.graph_error
    else:
        out = generate_transformers(model, tokenizer, rows, max_new_tokens, sampling, eos, stop_strings)
    out["completions"] = [_completion_text(tokenizer, ids, stop_strings) for ids in out["token_ids"]]
    out["new_tokens"] = [len(ids) for ids in out["token_ids"]]
    out["prompt_tokens"] = [len(r) for r in rows]
    return out


def _padding_id(tokenizer, model, eos_ids):
    """The id that left-pads a batch: the tokenizer's pad token where the model's embedding has a row for it,
    else an end-of-sequence id, else 0. The attention mask hides it, but the embedding still looks it up, and
    some tokenizers add a pad token the checkpoint never had (Qwen2's `<|endoftext|>` on a smaller vocabulary)."""
    rows = model.get_input_embeddings().num_embeddings
    for candidate in (tokenizer.pad_token_id, *sorted(eos_ids)):
        if candidate is not None and 0 <= candidate < rows:
            return candidate
    return 0


@torch.inference_mode()
def generate_transformers(model, tokenizer, rows, max_new_tokens, sampling=Sampling(), eos_ids=(), stop_strings=()):
    """The prompts' token ids `rows` completed with `model.generate` (KV cache on; loaded artifacts set
    config.use_cache = False for perplexity, which generation must not inherit), left-padded as a batch.
    The clock starts after one untimed forward, which pays one-time costs (weight caches, kernel builds).
    Returns {"runtime": "transformers", "token_ids", "seconds", "ms_per_token" (all time / positions
    generated), "tokens_per_s" (new tokens / all time)}."""
    device = next(model.parameters()).device
    width = max(map(len, rows))
    pad = _padding_id(tokenizer, model, eos_ids)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and width + max_new_tokens > limit:
        raise QuantkitError(f"prompt ({width} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
                            f"context of {limit} tokens")
    kwargs = {"max_new_tokens": max_new_tokens, "use_cache": True, "pad_token_id": pad,
              "do_sample": not sampling.greedy, "eos_token_id": sorted(eos_ids) or None}
    if stop_strings:
        kwargs.update(stop_strings=list(stop_strings), tokenizer=tokenizer)
    if sampling.greedy:
        kwargs.update(temperature=None, top_p=None, top_k=None)  # silence the model's own sampling defaults
    else:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    model(input_ids=ids[:, :1], use_cache=False)  # warm-up, see the docstring
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not sampling.greedy:
        torch.manual_seed(sampling.seed)
    start = time.perf_counter()
    new = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    stop = _stop_at_strings(tokenizer, stop_strings)
    token_ids = []
    for row in new.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        stopped = stop(row[:cut]) if stop is not None else None
        token_ids.append(row[: stopped or cut])
    return {"runtime": "transformers", "token_ids": token_ids, "seconds": seconds,
            "ms_per_token": 1000 * seconds / max(new.shape[1], 1),
            "tokens_per_s": sum(map(len, token_ids)) / seconds, "cuda_graph": False}


# --- which model generates ---------------------------------------------------------------------------------

RUNTIMES = ("auto", "fast", "transformers")


def load_for_generation(src, device, dtype=None, verify=True, bits=None, runtime="auto"):
    """(model, tokenizer, source, note) for `quantkit generate`: the fast Decoder where `runtime` is "fast",
    or "auto" on CUDA for an architecture it serves; the transformers model otherwise. `note` says which
    runs, and why when auto chose the transformers model."""
    from quantkit.models import load_tokenizer, resolve_source
    from quantkit.pipeline import load_for_eval, resolve_device, resolve_dtype
    from quantkit.runtime.loader import _model_config
    from quantkit.runtime.model import DecoderConfig, UnsupportedModel
    from quantkit.runtime.weights import decoder_from_transformers, load_decoder

    if runtime not in RUNTIMES:
        raise QuantkitError(f"--runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
    device = resolve_device(device)
    fast_note = "runtime: fast decoder (quantkit's Llama-family model, static KV cache" + (
        ", CUDA-graph decode steps)" if device.startswith("cuda") else ", eager steps)")
    if runtime == "auto" and not device.startswith("cuda"):
        runtime, why = "transformers", "the fast decoder runs on CUDA"
    else:
        why = None
    source = resolve_source(src)
    if runtime != "transformers" and source.kind == "artifact":
        from quantkit.artifact import read_config

        try:
            DecoderConfig.from_transformers(_model_config(read_config(source.path)))
        except UnsupportedModel as exc:
            if runtime == "fast":
                raise
            runtime, why = "transformers", str(exc)
        else:
            from quantkit.models.loading import checkpoint_dtype

            native = checkpoint_dtype(source)  # --dtype auto: the checkpoint's own bf16/fp16 on CUDA
            model = load_decoder(source.path, device, resolve_dtype(dtype, device, native), verify, bits)
            return model, load_tokenizer(source), source, fast_note
    model, tokenizer, source = load_for_eval(src, device, dtype, verify=verify, bits=bits)
    if runtime != "transformers":
        try:
            fast = decoder_from_transformers(model)
        except UnsupportedModel as exc:
            if runtime == "fast":
                raise
            why = str(exc)
        else:
            del model
            return fast, tokenizer, source, fast_note
    return model, tokenizer, source, "runtime: transformers model" + (f" ({why})" if why else "")
