"""bf16 activations on the GPU: what serves a bf16 model returns bf16 and stays within bf16's own rounding.

1. QuantLinear of every stored format (uniform RTN/GPTQ, symmetric and asymmetric with groups, act-order with
   g_idx, BCQ with and without offset, any-precision at 3..8 bits, OOC) on bf16 input with the kernels on, at
   one token (the matvec kernels) and a prefill-sized batch (dequantize kernel + cuBLAS): bf16 out, and within
   BF16_TOL of the fp64 product of the same inputs and the dequantized weight, as is the plain bf16 matmul of
   the dequantized weight (the reference path). The LUT kernels read activations as fp16 (exact for bf16
   values inside fp16's range) and write fp16, rounded once more to bf16 (docs/decode-runtime.md).
2. Gemma 3, Qwen3-MoE and Phi-3 from a bf16 checkpoint, quantized on the GPU with --dtype auto: the artifact
   says bfloat16 and was computed in it, quantkit.load serves bf16 logits as close to the fp32 oracle (the float
   model with the dequantized weights, tests/arch_oracle.py) as the same oracle run in bf16 is, and
   `quantkit eval ppl` gives a finite perplexity near the oracle's.

Environment: QUANTKIT_DATA=<texts dir> (the tiny tokenizer and the calibration text come from it).
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import quantkit
from arch_oracle import dequantized_reference, window_ppl
from factories import save_tiny, tiny_causal_lm
from machine import require
from quantkit.kernels.dispatch import kernel_forward
from quantkit.runtime import QuantLinear

pytestmark = pytest.mark.requires("cuda")

# ‖y − y_exact‖ / ‖y_exact‖ against the fp64 product: rounding the output to bf16 alone gives ~1.1e-3 (half an
# ulp, 2^-9, uniformly spread), the bf16 weight of the reference path about as much again; a wrong group,
# plane, scale or offset gives errors of order 1
BF16_TOL = 4e-3
KERNEL_VS_REFERENCE = 2  # the kernels may round twice (fp16, then bf16): at most twice the reference's error
TOKENS = {"decode": 1, "prefill": 80}  # 80 rows: past every matvec threshold (8 LUT, 24 any-precision)
SHAPES = [(512, 1024), (260, 1000)]  # whole groups and words; a partial last group (1000 = 7·128 + 104)
FORMAT_EXTENSIONS = {"uniform": "lutgemm", "bcq": "lutgemm", "anyprec": "anyprec"}  # kernels/dispatch.py

# name -> (method, settings); the stored format follows from them (checked below)
METHODS = {
    "rtn-sym": ("rtn", {"bits": 4, "group_size": 128, "sym": True}),
    "rtn-asym": ("rtn", {"bits": 3, "group_size": 128}),
    "gptq-sym": ("gptq", {"bits": 4, "group_size": 128, "sym": True, "act_order": False}),
    "gptq-asym": ("gptq", {"bits": 3, "group_size": 128, "act_order": True}),  # static groups: no g_idx
    "gptq-act-order-g_idx": ("gptq", {"bits": 4, "group_size": 128, "act_order": True, "static_groups": False}),
    "bcq": ("bcq", {"bits": 3, "group_size": 128, "solver": "weight"}),
    "bcq-offset": ("bcq", {"bits": 3, "group_size": 128, "offset": True, "solver": "weight"}),
    "ooc": ("ooc", {"group_size": 128, "act_order": False, "static_groups": False, "clip_search": False}),
}
STORED = {"rtn-sym": "uniform", "rtn-asym": "uniform", "gptq-sym": "uniform", "gptq-asym": "uniform",
          "gptq-act-order-g_idx": "uniform", "bcq": "bcq", "bcq-offset": "bcq", "ooc": "ooc"}
NO_KERNEL = {"gptq-act-order-g_idx", "ooc"}  # no CUDA kernel stores these: the reference path serves them
ANYPREC_BITS = range(3, 9)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 yardsticks must be fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def layers():
    """layers(name, shape) -> (QuantizedTensor on the CPU, fp32 bias), made once: the method run on a random
    weight and the Σ xᵀx of random inputs; "anyprec" is a seed-3 parent-8 tensor of random codes and tables."""
    made = {}

    def get(name, shape):
        if (name, shape) not in made:
            out_features, in_features = shape
            g = torch.Generator().manual_seed(out_features + in_features)
            bias = torch.randn(out_features, generator=g) * 0.1
            if name == "anyprec":
                from quantkit.formats.anyprec import AnyPrecisionTensor

                codes = torch.randint(0, 256, shape, generator=g)
                luts = {b: torch.randn(out_features, 2**b, generator=g).sort(dim=1).values * 0.05 for b in range(3, 9)}
                qtensor = AnyPrecisionTensor.from_codes(codes, luts, 3, 8)
            else:
                from quantkit.methods import make_method

                method, settings = METHODS[name]
                weight = torch.randn(shape, generator=g) * 0.05
                x = torch.randn(256, in_features, generator=g)
                stats = {"xtx": x.T @ x, "nsamples": 256, "ntokens": 256}
                qtensor, _ = make_method(method, **settings).quantize(weight, stats)
                assert qtensor.meta()["format"] == STORED[name]
                assert qtensor.meta().get("has_g_idx", False) == (name == "gptq-act-order-g_idx")
            made[name, shape] = (qtensor, bias)
        return made[name, shape]

    return get


def _rel(y, exact):
    return ((y.double() - exact).norm() / exact.norm()).item()


def _check_bf16_forward(qtensor, bias, bits, tokens, kernel_expected):
    layer = QuantLinear(qtensor, bias, compute_dtype=torch.bfloat16, bits=bits).cuda()
    fmt = layer.meta["format"]
    if kernel_expected and fmt in FORMAT_EXTENSIONS:
        require(FORMAT_EXTENSIONS[fmt])
    g = torch.Generator(device="cuda").manual_seed(tokens)
    rows = (1, 1) if tokens == 1 else (2, tokens // 2)
    x = torch.randn(*rows, layer.in_features, device="cuda", generator=g).to(torch.bfloat16)
    served = kernel_forward(layer, x)
    assert (served is not None) == kernel_expected, f"{fmt}: served by a kernel: {served is not None}"
    with torch.inference_mode():
        y = layer(x)
    weight = layer.qtensor().dequantize(torch.float32, **({} if bits is None else {"bits": bits}))
    exact = x.double() @ weight.double().t() + layer.bias.double()  # the bias as the layer holds it, in bf16
    reference = F.linear(x, weight.to(torch.bfloat16), layer.bias)  # the dequantized weight's bf16 matmul
    assert y.dtype == torch.bfloat16 and y.shape == (*x.shape[:-1], layer.out_features)
    assert torch.isfinite(y).all()
    err, ref_err = _rel(y, exact), _rel(reference, exact)
    assert ref_err < BF16_TOL, f"the bf16 reference itself is {ref_err:.2e} from fp64"
    assert err < BF16_TOL and err <= KERNEL_VS_REFERENCE * ref_err, (
        f"{fmt} bits={bits} tokens={tokens}: {err:.2e} from fp64, the bf16 reference {ref_err:.2e}")


@pytest.mark.parametrize("tokens", TOKENS.values(), ids=TOKENS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", METHODS)
def test_quant_linear_serves_bf16_within_bf16_rounding(name, shape, tokens, layers):
    qtensor, bias = layers(name, shape)
    _check_bf16_forward(qtensor, bias, None, tokens, kernel_expected=name not in NO_KERNEL)


@pytest.mark.parametrize("tokens", TOKENS.values(), ids=TOKENS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bits", ANYPREC_BITS)
def test_any_precision_serves_bf16_at_every_width(bits, shape, tokens, layers):
    qtensor, bias = layers("anyprec", shape)
    _check_bf16_forward(qtensor, bias, bits, tokens, kernel_expected=True)


# --- architectures from a bf16 checkpoint ---------------------------------------------------------------

ARCHITECTURES = ("gemma3_text", "qwen3_moe", "phi3")
NOISE_FACTOR = 4  # quantized model's error vs the fp32 oracle / the bf16 oracle's own error vs it
BF16_NOISE_MAX = 5e-2  # above this the bf16 noise floor itself is suspect and excuses nothing
MIN_TOP1 = 0.9  # top-1 agreement with the fp32 oracle (a mixture of experts may route a near tie otherwise)


@pytest.fixture(scope="module")
def bf16_artifact(tiny_tokenizer, small_data, tmp_path_factory):
    """bf16_artifact(arch) -> (bf16 float checkpoint, artifact) quantized on the GPU with --dtype auto."""
    from quantkit.cli import main

    made = {}

    def get(arch):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            model = tiny_causal_lm(arch, vocab=len(tiny_tokenizer), max_positions=256, seed=3).to(torch.bfloat16)
            src = save_tiny(model, tiny_tokenizer, root / "float")
            out = root / "art"
            result = CliRunner().invoke(main, ["quantize", "--model", str(src), "--out", str(out), "--method", "gptq",
                                               "--bits", "4", "--group-size", "32", "--calib", "ptb", "--nsamples",
                                               "4", "--seqlen", "32", "--data-dir", str(small_data), "--device", "cuda",
                                               "--dtype", "auto", "--no-checkpoint"])
            assert result.exit_code == 0, result.output
            made[arch] = (src, out)
        return made[arch]

    return get


def _position_errors(logits, exact):
    """Relative L2 error of each position's logits [..., V] against `exact`, flattened."""
    return ((logits.float() - exact).norm(dim=-1) / exact.norm(dim=-1)).flatten()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_checkpoint_quantized_on_cuda_serves_bf16(arch, bf16_artifact, data_dir, tmp_path):
    from safetensors import safe_open

    from quantkit.artifact import read_config
    from quantkit.cli import main

    src, art = bf16_artifact(arch)
    assert read_config(art)["dtype"] == "bfloat16"
    assert json.loads((art / "quant_log.json").read_text())["dtype"] == "bfloat16"  # computed in bf16 on the GPU
    with safe_open(str(art / "model.safetensors"), "pt") as fh:
        assert fh.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16

    model = quantkit.load(art, device="cuda")  # dtype auto: the checkpoint's bf16
    qlinears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qlinears and all(m.compute_dtype == torch.bfloat16 for m in qlinears)
    require("lutgemm")  # uniform layers decode through the LUT kernels
    oracle = dequantized_reference(src, art, torch.bfloat16, "cuda")
    exact = dequantized_reference(src, art, torch.float32, "cuda")
    g = torch.Generator().manual_seed(0)
    for shape in ((2, 24), (1, 6)):  # prefill (dequantize + cuBLAS) and a matvec-sized batch (LUT kernels)
        ids = torch.randint(0, model.config.vocab_size, shape, generator=g).cuda()
        with torch.inference_mode():
            got, bf16, fp32 = model(ids).logits, oracle(ids).logits, exact(ids).logits.float()
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        err, noise = _position_errors(got, fp32), _position_errors(bf16, fp32)
        assert noise.median() < BF16_NOISE_MAX, f"bf16 oracle {noise.median():.2e} from fp32"
        assert err.median() <= NOISE_FACTOR * noise.median(), (
            f"{arch} {shape}: median {err.median():.2e} from fp32, the bf16 oracle {noise.median():.2e}")
        top1 = (got.argmax(-1) == fp32.argmax(-1)).float().mean().item()
        assert top1 >= MIN_TOP1, f"{arch} {shape}: top-1 agreement {top1:.3f}"

    out = tmp_path / "ppl.json"
    result = CliRunner().invoke(main, ["eval", "ppl", "--model", str(art), "--dataset", "wikitext2", "--seqlen", "64",
                                       "--max-windows", "2", "--device", "cuda", "--data-dir", str(data_dir), "--json",
                                       str(out)])
    assert result.exit_code == 0, result.output
    (scores,) = json.loads(out.read_text())["results"]
    assert scores["dtype"] == "bfloat16" and math.isfinite(scores["ppl"])
    from quantkit.data import eval_tokens
    from quantkit.models import load_tokenizer, resolve_source

    ids, _ = eval_tokens("wikitext2", load_tokenizer(resolve_source(str(art))), 64, data_dir)
    want = window_ppl(exact, ids, 64, 2)
    assert abs(math.log(scores["ppl"] / want)) < 0.02, (scores["ppl"], want)  # mean NLL within 0.02 nats
