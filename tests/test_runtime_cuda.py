"""Runtime on the GPU: the transformers model with QuantLinear modules generates through the CUDA kernels as
through the reference path (the dequantized weights with cuBLAS), and SmolLM2 perplexity through the
kernels equals the reference path's. The fast decoder's GPU tests are in tests/test_fast_model.py.

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

pytestmark = pytest.mark.requires("cuda")

KERNEL_NOISE_FACTOR = 4  # kernel error vs fp32 / the fp16 reference's error vs fp32
FP16_NOISE_MAX = 5e-2  # above this the fp16 noise floor itself is suspect and excuses nothing
MIN_TOKEN_AGREEMENT = 0.9
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

