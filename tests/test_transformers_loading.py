"""After `import quantkit`, transformers' own `AutoModelForCausalLM.from_pretrained(artifact)` returns the
model quantkit.load builds: QuantLinear modules and the same logits, for every method's artifact."""

import pytest
import torch

import quantkit
from quantkit.pipeline import quantize_checkpoint

METHODS = {
    "rtn": ("rtn", {"bits": 4, "group_size": 32}),
    "gptq": ("gptq", {"bits": 3, "group_size": 32}),
    "bcq": ("bcq", {"bits": 3, "group_size": 32, "offset": True}),
    "squeezellm": ("squeezellm", {"bits": 3}),
    "anyprec": ("anyprec", {"seed_bits": 3, "parent_bits": 4}),
    "ooc": ("ooc", {"low_bits": 2, "high_bits": 2, "group_size": 32}),
}


@pytest.fixture(scope="module")
def artifacts(tiny_llama_dir, tiny_opt_dir, small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-load")
    made = {}
    for key, (method, params) in METHODS.items():
        made[key] = root / key
        quantize_checkpoint(str(tiny_llama_dir), made[key], method, params, nsamples=2, seqlen=32, calib="ptb",
                            device="cpu", data_dir=small_data, progress=False, checkpoint=False)
    made["opt-rtn"] = root / "opt-rtn"  # linears with biases
    quantize_checkpoint(str(tiny_opt_dir), made["opt-rtn"], "rtn", {"bits": 4, "group_size": 32}, nsamples=0,
                        device="cpu", progress=False, checkpoint=False)
    return made


@pytest.mark.parametrize("key", [*METHODS, "opt-rtn"])
def test_from_pretrained_equals_quantkit_load(artifacts, key):
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.quant_linear import QuantLinear

    theirs = AutoModelForCausalLM.from_pretrained(artifacts[key], dtype=torch.float32, device_map="cpu").eval()
    ours = quantkit.load(artifacts[key], device="cpu", dtype=torch.float32)
    names = [name for name, module in ours.named_modules() if isinstance(module, QuantLinear)]
    assert names and all(isinstance(theirs.get_submodule(name), QuantLinear) for name in names)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)


def test_from_pretrained_honours_dtype(artifacts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(artifacts["rtn"], dtype=torch.bfloat16)
    ours = quantkit.load(artifacts["rtn"], device="cpu", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ours(ids).logits)


def test_save_pretrained_round_trips_through_transformers_and_quantkit(artifacts, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(artifacts["gptq"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "resaved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", dtype=torch.float32)
    unsealed = quantkit.load(tmp_path / "resaved", device="cpu", dtype=torch.float32)  # no checksums to verify
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(again(ids).logits, want) and torch.equal(unsealed(ids).logits, want)


@pytest.mark.requires("cuda")
@pytest.mark.parametrize("key", ["gptq", "bcq", "anyprec", "opt-rtn"])
def test_from_pretrained_with_device_map_on_cuda(artifacts, key):
    """device_map="cuda" and a half dtype: every QuantLinear lands on the GPU and the logits equal quantkit.load's
    on the same device (the same kernels run in both)."""
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.quant_linear import QuantLinear

    theirs = AutoModelForCausalLM.from_pretrained(artifacts[key], dtype=torch.float16, device_map="cuda").eval()
    ours = quantkit.load(artifacts[key], device="cuda", dtype=torch.float16)
    quantized = [m for m in theirs.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(t.device.type == "cuda" for m in quantized for t in m.buffers())
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)
