"""Runtime on the GPU: quantized models generate through the CUDA kernels as through the reference path
(the dequantized weights with cuBLAS), a decode step captured in a CUDA graph decodes as the eager one,
and SmolLM2 perplexity through the kernels equals the reference path's.

Why agreement rates and not exact tokens: the kernels accumulate in a different order than cuBLAS
(LUT sums, split-K), so logits differ by fp16 rounding. Greedy decoding then flips a token only where
the reference's top two logits are that close. The logit bound is relative to fp16's own noise, not
a fixed number: on these random 2-layer models (std-0.15 weights, large activations) the reference
path in fp16 is already ~1e-2 (max over positions) away from the same path in fp32 (measured on the
CPU: 8.7e-3 rtn, 9.3e-3 bcq), and two fp16 paths that round differently were seen 1.4-1.8e-2 apart
on an H100, i.e. about twice that. So the kernels' logits, compared with the fp32 reference, must be
within KERNEL_NOISE_FACTOR times the fp16 reference's own error (a wrong scale, plane or bit-width
gives errors of order 1, a hundred times more), and at least 90 % of teacher-forced argmax tokens
must equal the fp16 reference's (a real bug flips most of them).

Environment: QUANTKIT_SMOLLM2=/path/SmolLM2-135M-Instruct.Q4_1.gguf (else the quantkit cache),
QUANTKIT_DATA=<texts dir>, QUANTKIT_PPL_WINDOWS (default 4 windows of 2048 tokens).
"""

import os
from pathlib import Path

import pytest
import torch

import quantkit
from factories import tiny_causal_lm
from machine import require
from quantkit.kernels.dispatch import kernel_forward
from quantkit.runtime import QuantLinear
from quantkit.runtime.generate import StaticGreedyDecoder, generate_static

pytestmark = pytest.mark.requires("cuda")

KERNEL_NOISE_FACTOR = 4  # kernel error vs fp32 / the fp16 reference's error vs fp32
FP16_NOISE_MAX = 5e-2  # above this the fp16 noise floor itself is suspect and excuses nothing
MIN_TOKEN_AGREEMENT = 0.9
NEAR_TIE = 1e-2  # logit gap, relative to the largest logit, that fp16 rounding may flip
STEPS = 48
PROMPT = 16
FORMAT_EXTENSIONS = {"uniform": "lutgemm", "bcq": "lutgemm", "anyprec": "anyprec"}  # kernels/dispatch.py

# name -> (method, settings, stored format option); kernel-friendly shapes: g = 128 divides every row
SPECS = {
    "rtn": ("rtn", {"bits": 4, "group_size": 128}, None),
    "rtn-bcq": ("rtn", {"bits": 3, "group_size": 128}, "bcq"),
    "gptq": ("gptq", {"bits": 4, "group_size": 128}, None),
    "bcq": ("bcq", {"bits": 3, "group_size": 128}, None),
    "ooc": ("ooc", {"group_size": 128}, None),
    "anyprec": ("anyprec", {"seed_bits": 3, "parent_bits": 5}, None),
}


def _float_llama():
    # std 0.15 (not the default 0.02) so greedy continuations vary instead of repeating one token
    return tiny_causal_lm("llama", vocab=512, hidden=256, intermediate=768, max_positions=256, initializer_range=0.15,
                          attn_implementation="sdpa", seed=0)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """artifact(name) -> directory, quantized on the CPU from random calibration ids, once."""
    from quantkit.artifact import float_tensors, write_artifact
    from quantkit.engine import quantize_model
    from quantkit.methods import make_method
    from quantkit.models import adapter_for
    from quantkit.pipeline import convert_qtensors

    made = {}

    def get(name):
        if name not in made:
            method_name, params, fmt = SPECS[name]
            model = _float_llama()
            method = make_method(method_name, **params)
            adapter = adapter_for(model)
            calib = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
            qtensors, entries = quantize_model(model, adapter, method, calib if method.stats else None, progress=False)
            if fmt:
                qtensors = convert_qtensors(qtensors, fmt)
            out = tmp_path_factory.mktemp("art") / name
            write_artifact(out, model_config=model.config.to_dict(), tokenizer=None, qtensors=qtensors,
                           float_tensors=float_tensors(model, qtensors),
                           quantization_config={"method": method_name, **method.config(), "architecture": adapter.name},
                           quant_log={"modules": entries})
            made[name] = out
        return made[name]

    return get


def _qlinears(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def _use_kernels(model, on):
    for module in _qlinears(model):
        module.use_kernels = on
        # drop the cached dense weight: the kernels' dequantize path fills the same cache slot, and the
        # reference must compute its own weight for the comparison to mean anything
        module.set_bits(module.bits)


def _require_kernel(model, tokens=1):
    """Skip unless a kernel serves every QuantLinear for `tokens` input rows (else both paths would be
    the reference and the comparison would prove nothing): first the extension its format needs, named."""
    for module in _qlinears(model):
        if module.meta["format"] in FORMAT_EXTENSIONS:
            require(FORMAT_EXTENSIONS[module.meta["format"]])
        x = torch.randn(1, tokens, module.in_features, device="cuda", dtype=torch.float16)
        if kernel_forward(module, x) is None:
            pytest.skip(f"no CUDA kernel serves format {module.meta['format']} at {tokens} token(s)")


def _prompts(vocab, batch=2):
    return torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(2)).cuda()


@torch.inference_mode()
def _teacher_forced_logits(model, ids, steps):
    """Logits [B, steps, V] of each decode step fed the given tokens, one token per forward (the
    matvec path), with transformers' dynamic KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(ids[:, :PROMPT], past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for i in range(PROMPT, PROMPT + steps - 1):
        logits.append(model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits, dim=1).float()


def _assert_same_until_near_tie(model, prompt, a, b, what):
    """Greedy continuations a, b [1, STEPS] must be equal up to their first difference, and there the
    two tokens must be a near-tie of that step's logits: rounding can flip a near-tie, after which
    the contexts differ and later tokens say nothing. A wrong kernel differs early, by a wide gap."""
    diff = (a != b).nonzero()
    if len(diff) == 0:
        return
    step = diff[0, 1].item()
    with torch.inference_mode():
        logits = model(torch.cat([prompt, a[:, :step]], dim=1)).logits[0, -1].float()
    gap = (logits[a[0, step]] - logits[b[0, step]]).abs().item()
    scale = logits.abs().max().item()
    assert gap <= NEAR_TIE * scale, (f"{what}: first different token at step {step} of {a.shape[1]} with a logit "
                                     f"gap of {gap:.3e} (largest logit {scale:.3e}): not a rounding tie")


def _max_rel_error(logits, exact):
    """Largest relative L2 error over (prompt, step) of logits [B, steps, V] against `exact`."""
    return ((logits - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()


def _agreement(a, b):
    return (a == b).float().mean().item()


@pytest.mark.parametrize("name,bits", [("rtn", None), ("rtn-bcq", None), ("gptq", None), ("bcq", None), ("ooc", None),
                                       ("anyprec", 3), ("anyprec", 5)])
def test_kernels_generate_like_the_reference(name, bits, artifact):
    model = quantkit.load(artifact(name), device="cuda", bits=bits)
    if name != "ooc":  # no kernel stores OOC: it runs the reference path on CUDA as well
        _require_kernel(model, tokens=1)
        _require_kernel(model, tokens=2)
    prompts = _prompts(model.config.vocab_size)

    _use_kernels(model, False)
    with torch.inference_mode():
        ref_seq = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=STEPS,
                                 do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    ref_logits = _teacher_forced_logits(model, ref_seq, STEPS)
    assert len(set(ref_seq[0, PROMPT:].tolist())) > STEPS // 4  # a varied continuation, not one repeated token
    # the same reference path in fp32 on the same GPU: the yardstick for fp16 rounding
    exact_model = quantkit.load(artifact(name), device="cuda", dtype=torch.float32, bits=bits)
    _use_kernels(exact_model, False)
    exact = _teacher_forced_logits(exact_model, ref_seq, STEPS)
    del exact_model

    _use_kernels(model, True)
    logits = _teacher_forced_logits(model, ref_seq, STEPS)
    noise = _max_rel_error(ref_logits, exact)
    err = _max_rel_error(logits, exact)
    agree = _agreement(logits.argmax(-1), ref_logits.argmax(-1))
    assert noise < FP16_NOISE_MAX, f"{name}: fp16 reference path {noise:.2e} away from fp32"
    assert err <= KERNEL_NOISE_FACTOR * noise, (
        f"{name}: kernel logits {err:.2e} from fp32, fp16 reference path {noise:.2e} "
        f"(kernel vs fp16 reference {_max_rel_error(logits, ref_logits):.2e})")
    assert agree >= MIN_TOKEN_AGREEMENT, f"{name}: teacher-forced token agreement {agree:.3f}"


@pytest.mark.parametrize("name,bits", [("rtn-bcq", None), ("rtn", None), ("anyprec", 3), ("anyprec", 5)])
def test_graph_captured_decode_equals_eager(name, bits, artifact):
    model = quantkit.load(artifact(name), device="cuda", bits=bits)
    _require_kernel(model, tokens=1)
    prompt = _prompts(model.config.vocab_size, batch=1)
    decoder = StaticGreedyDecoder(model, max_len=PROMPT + STEPS)
    eager = decoder.generate(prompt, STEPS)
    decoder.capture()
    graphed = decoder.generate(prompt, STEPS)
    again = decoder.generate(prompt, STEPS)  # prefill resets the cache the graph writes to
    with torch.inference_mode():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=STEPS, do_sample=False,
                              use_cache=True, pad_token_id=0, eos_token_id=None)[:, PROMPT:]
    # same kernels in all three: equal except where a near-tie flips (the LUT kernel's stream-K adds
    # fp32 partial sums with atomics, so its rounding can differ between two runs of one graph)
    _assert_same_until_near_tie(model, prompt, eager, graphed, "graph vs eager")
    _assert_same_until_near_tie(model, prompt, graphed, again, "graph replayed twice")
    _assert_same_until_near_tie(model, prompt, want, eager, "static decoder vs model.generate")


@pytest.mark.requires("triton")
def test_split_attention_decodes_like_sdpa(artifact, monkeypatch):
    # the decoder's default on CUDA: split-cache attention whose kernel also writes the step's key and
    # value, in captured graphs, against SDPA
    other = "sdpa"
    from quantkit.runtime import decode_attention

    model = quantkit.load(artifact("rtn-bcq"), device="cuda")
    _require_kernel(model, tokens=1)
    prompt = _prompts(model.config.vocab_size, batch=1)
    split = StaticGreedyDecoder(model, max_len=PROMPT + STEPS)
    assert split.split_attention  # an sdpa model on CUDA, with Triton
    launches = []  # every layer of the captured step must launch the kernel, taking its key and value
    kernel = decode_attention.decode
    monkeypatch.setattr(decode_attention, "decode",
                        lambda *a, **kw: (launches.append(a[6] is not None), kernel(*a, **kw))[1])
    split.capture()
    layers = model.config.num_hidden_layers
    assert split.split_attention and launches[-layers:] == [True] * layers
    monkeypatch.setattr(decode_attention, "decode", kernel)
    reference = StaticGreedyDecoder(model, max_len=PROMPT + STEPS, attention=other)
    assert not reference.split_attention
    reference.capture()
    _assert_same_until_near_tie(model, prompt, reference.generate(prompt, STEPS), split.generate(prompt, STEPS),
                                f"split vs {other}")


class _IdTokenizer:
    """Prompts given as space-separated token ids; what generate_static needs of a tokenizer."""

    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [int(t) for t in text.split()]}

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def test_generate_static_decodes_through_a_cuda_graph(artifact):
    # `quantkit generate --static-cache` on CUDA: captured decode steps, the tokens of eager steps
    model = quantkit.load(artifact("rtn-bcq"), device="cuda")
    _require_kernel(model, tokens=1)
    prompt = _prompts(model.config.vocab_size, batch=1)
    out = generate_static(model, _IdTokenizer(), [" ".join(map(str, prompt[0].tolist()))], max_new_tokens=STEPS)
    assert out["cuda_graph"] and out["tokens_per_s"] > 0
    eager = StaticGreedyDecoder(model, max_len=PROMPT + STEPS).generate(prompt, STEPS)
    _assert_same_until_near_tie(model, prompt, eager, torch.tensor(out["token_ids"], device="cuda"),
                                "generate_static vs eager steps")


@pytest.mark.parametrize("name,bits", [("rtn-bcq", None), ("rtn", None), ("anyprec", 3)])
@pytest.mark.parametrize("stack", [False, True], ids=["pointwise", "full"])
def test_fusion_decodes_like_unfused(name, bits, stack, artifact, monkeypatch):
    """runtime.fusion around the kernels (compiled pointwise parts; with stack, q/k/v and gate/up as one
    kernel launch each; for the LUT kernels, matvecs leaving their sums to the next kernel: o_proj, and when
    stacked q/k/v, gate/up and down), in a captured graph: the unfused decode's tokens up to a near-tie."""
    from quantkit.runtime.fusion import fuse_pointwise, fuse_projections, unfuse_pointwise

    accumulated = []
    accumulate = QuantLinear.accumulate
    monkeypatch.setattr(QuantLinear, "accumulate",
                        lambda module, x: accumulated.append((module, accumulate(module, x))) or accumulated[-1][1])
    model = quantkit.load(artifact(name), device="cuda", bits=bits)
    _require_kernel(model, tokens=1)
    prompt = _prompts(model.config.vocab_size, batch=1)
    decoder = StaticGreedyDecoder(model, max_len=PROMPT + STEPS)
    decoder.capture()
    plain = decoder.generate(prompt, STEPS)
    stacking = None
    try:
        assert fuse_pointwise(model) == {"rms_norm": 5, "mlp": 2, "rotary": 1, "rotary_angles": 1, "residual_norm": 2}
        if stack:
            stacking = fuse_projections(model)
            assert stacking.count == 4
            for module in _qlinears(model):  # the unfused modules had kernels: the stacked ones must too
                x = torch.randn(1, 1, module.in_features, device="cuda", dtype=torch.float16)
                assert kernel_forward(module, x) is not None, module.meta["format"]
        decoder.capture()
        fused = decoder.generate(prompt, STEPS)
    finally:
        unfuse_pointwise(model)
        if stacking is not None:
            stacking.undo()
    _assert_same_until_near_tie(model, prompt, plain, fused, "fused vs unfused")
    # the accumulations ran where the LUT kernels serve the matvecs (BCQ / uniform layers): o_proj always,
    # the stacked q/k/v (finished by the attention kernel) and gate/up and down when stacked
    served = {module.out_features for module, sums in accumulated if sums is not None}
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    # o_proj, down | gate/up, q/k/v
    want = {config.hidden_size} | ({2 * config.intermediate_size, qkv} if stack else set())
    assert served == (set() if name == "anyprec" else want), served


@pytest.mark.requires("sm90")
@pytest.mark.parametrize("name,bits", [("rtn-bcq", None), ("anyprec", 3)])
def test_overlapped_launches_decode_like_plain_ones(name, bits, artifact, monkeypatch):
    """The fused decode step captured with overlap (kernels/overlap.py: the matvec and Triton kernels
    scheduled before the kernel they depend on ends) decodes as the one captured without, and its
    capture did launch matvecs and Triton kernels with overlap."""
    from quantkit.kernels import overlap
    from quantkit.runtime.fusion import fuse_pointwise, fuse_projections, unfuse_pointwise

    monkeypatch.setitem(overlap._state, "on", True)  # whatever QUANTKIT_OVERLAP says
    launches = []  # (what, overlapped) of each matvec / Triton launch decided while capturing
    settled, triton_launch = overlap.settled, overlap.triton_launch
    monkeypatch.setattr(overlap, "settled", lambda *a: launches.append(("matvec", settled(*a))) or launches[-1][1])
    monkeypatch.setattr(overlap, "triton_launch",
                        lambda device: (launches.append(("triton", triton_launch(device)["GDC"]))
                                        or triton_launch(device)))
    model = quantkit.load(artifact(name), device="cuda", bits=bits)
    _require_kernel(model, tokens=1)
    assert overlap.for_device("cuda")
    prompt = _prompts(model.config.vocab_size, batch=1)
    decoder = StaticGreedyDecoder(model, max_len=PROMPT + STEPS)
    fuse_pointwise(model)
    stacking = fuse_projections(model)
    try:
        with overlap.disabled():
            decoder.capture()
        plain = decoder.generate(prompt, STEPS)
        launches.clear()
        decoder.capture()
        captured = set(launches)
        overlapped = decoder.generate(prompt, STEPS)
        again = decoder.generate(prompt, STEPS)
    finally:
        unfuse_pointwise(model)
        stacking.undo()
    _assert_same_until_near_tie(model, prompt, plain, overlapped, "overlapped vs plain launches")
    _assert_same_until_near_tie(model, prompt, overlapped, again, "overlapped graph replayed twice")
    assert {("matvec", True), ("triton", True)} <= captured, captured


def test_the_compiled_greedy_pick_is_argmax():
    from quantkit.runtime.generate import _compiled_pick

    logits = torch.randn(3, 32000, device="cuda").half()
    logits[1, [5, 17, 31000]] = 30.0  # equal maxima: the first one, as torch.argmax
    logits[2] = -1.0
    picked = _compiled_pick()(logits)
    assert picked.shape == (3, 1) and torch.equal(picked, logits.argmax(dim=-1, keepdim=True))
    assert picked[1, 0] == 5 and picked[2, 0] == 0


def test_graph_recaptured_after_set_bits(artifact):
    path = artifact("anyprec")
    model = quantkit.load(path, device="cuda", bits=5)
    _require_kernel(model, tokens=1)
    prompt = _prompts(model.config.vocab_size, batch=1)
    decoder = StaticGreedyDecoder(model, max_len=PROMPT + STEPS)
    decoder.capture()
    at5 = decoder.generate(prompt, STEPS)
    for module in _qlinears(model):
        module.set_bits(3)
    decoder.capture()
    at3 = decoder.generate(prompt, STEPS)
    fresh = StaticGreedyDecoder(quantkit.load(path, device="cuda", bits=3), max_len=PROMPT + STEPS)
    fresh.capture()
    assert _agreement(at3, fresh.generate(prompt, STEPS)) >= MIN_TOKEN_AGREEMENT
    assert not torch.equal(at3, at5)


# --- SmolLM2 perplexity through the kernels ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from quantkit import settings

    path = Path(os.environ.get("QUANTKIT_SMOLLM2") or settings.default_model_path())
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {path} (set QUANTKIT_SMOLLM2)")
    return path


@pytest.fixture(scope="module")
def smol_artifacts(smollm2, tmp_path_factory):
    """RTN w4 g64 (uniform, served through the BCQ conversion), RTN w3 g64 stored as BCQ, and RTN
    w4 per-channel; g = 64 divides SmolLM2's 576- and 1536-wide rows, so every layer can take a kernel."""
    from quantkit.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("smol")
    made = {}
    for name, params, fmt in [("rtn-w4g64", {"bits": 4, "group_size": 64}, None),
                              ("rtn-w3g64-bcq", {"bits": 3, "group_size": 64}, "bcq"),
                              ("rtn-w4pc", {"bits": 4, "group_size": -1}, None)]:
        quantize_checkpoint(str(smollm2), root / name, "rtn", params, device="cuda", progress=False, fmt=fmt)
        made[name] = root / name
    return made


def _anyprec_from_uniform(model):
    """Replace every per-channel uniform QuantLinear by an any-precision one with the same 4-bit codes
    (a uniform grid is nested: the 3-bit table holds the means of each pair of 4-bit levels). Builds a
    real SmolLM2 anyprec model in seconds instead of minutes of k-means; serves 3 and 4 bits."""
    from quantkit.formats.anyprec import AnyPrecisionTensor

    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]:
        ut = module.qtensor()
        scale, zero = ut.scales.float()[:, :1], ut.zeros()[:, :1]
        luts = {4: (torch.arange(16, device=scale.device) - zero) * scale,
                3: (2 * torch.arange(8, device=scale.device) + 0.5 - zero) * scale}
        qt = AnyPrecisionTensor.from_codes(ut.codes(), luts, seed_bits=3, parent_bits=4)
        model.set_submodule(name, QuantLinear(qt, module.bias, compute_dtype=module.compute_dtype))
    return model


def _ppl_setup(smollm2, data_dir):
    from quantkit.data import eval_tokens
    from quantkit.models import load_tokenizer, resolve_source

    ids, _ = eval_tokens("wikitext2", load_tokenizer(resolve_source(str(smollm2))), 2048, data_dir)
    return ids, int(os.environ.get("QUANTKIT_PPL_WINDOWS", "4"))


def _model(smol_artifacts, case, device):
    name, bits = case
    if name == "anyprec":
        model = _anyprec_from_uniform(quantkit.load(smol_artifacts["rtn-w4pc"], device=device))
        if bits is not None:
            for module in _qlinears(model):
                module.set_bits(bits)
        return model
    return quantkit.load(smol_artifacts[name], device=device)


PPL_CASES = [("rtn-w4g64", None), ("rtn-w3g64-bcq", None), ("anyprec", 3), ("anyprec", 4)]


@pytest.mark.integration
@pytest.mark.parametrize("case", PPL_CASES, ids=lambda c: f"{c[0]}@{c[1]}" if c[1] else c[0])
def test_smollm2_ppl_kernels_match_reference_path(case, smol_artifacts, smollm2, data_dir):
    from quantkit.eval import perplexity

    ids, windows = _ppl_setup(smollm2, data_dir)
    model = _model(smol_artifacts, case, "cuda")
    _require_kernel(model, tokens=2048)
    kernel = perplexity(model, ids, 2048, windows, "cuda", progress=False)["ppl"]
    _use_kernels(model, False)  # the reference path on the same GPU, same dtype: isolates the kernels
    reference = perplexity(model, ids, 2048, windows, "cuda", progress=False)["ppl"]
    assert abs(kernel / reference - 1) < 0.005, (kernel, reference)


@pytest.mark.integration
@pytest.mark.parametrize("case", PPL_CASES, ids=lambda c: f"{c[0]}@{c[1]}" if c[1] else c[0])
def test_smollm2_ppl_cuda_matches_cpu_reference(case, smol_artifacts, smollm2, data_dir):
    """fp16 through the kernels on the GPU vs the fp32 reference path on the CPU (the CI path)."""
    from quantkit.eval import perplexity

    ids, windows = _ppl_setup(smollm2, data_dir)
    model = _model(smol_artifacts, case, "cuda")
    _require_kernel(model, tokens=2048)
    cuda_ppl = perplexity(model, ids, 2048, windows, "cuda", progress=False)["ppl"]
    del model
    cpu_ppl = perplexity(_model(smol_artifacts, case, "cpu"), ids, 2048, windows, "cpu", progress=False)["ppl"]
    assert abs(cuda_ppl / cpu_ppl - 1) < 0.005, (cuda_ppl, cpu_ppl)

