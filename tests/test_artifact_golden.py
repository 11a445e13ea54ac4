"""Artifacts are frozen: rtn, gptq, bcq, anyprec and ooc on a tiny llama with seeded weights write the
same tensors, settings and log as the digests in golden_artifacts.json, recorded from a reference
build. A refactor that changes a single stored bit, a recorded setting or a logged error fails here.

Regenerate (only for an intended format or numerics change, stated in the commit):
    QUANTKIT_WRITE_GOLDEN=1 python -m pytest tests/test_artifact_golden.py
"""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from quant_logs import strip_volatile
from quantkit.pipeline import quantize_checkpoint

GOLDEN = Path(__file__).with_name("golden_artifacts.json")

# besides what quant_logs.VOLATILE drops: the torch version the log records (the digests were taken with
# torch 2.13 on the CPU; another torch may sum a reconstruction error, or break a rounding tie, differently)
ENVIRONMENT = {"torch"}

CASES = {
    "rtn": ("rtn", {"bits": 3, "group_size": 32}, 0),
    "gptq": ("gptq", {"bits": 3, "group_size": 32}, 4),
    "bcq": ("bcq", {"bits": 3, "group_size": 32, "offset": True}, 4),
    "anyprec": ("anyprec", {"seed_bits": 3, "parent_bits": 5}, 4),
    "ooc": ("ooc", {"low_bits": 2, "high_bits": 2, "group_size": 32, "clear_fraction": 0.25, "scan": 0.5}, 4),
}


def _digest(payload) -> str:
    data = payload if isinstance(payload, bytes) else json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def _tensor_file_digest(path: Path) -> str:
    """Every tensor's name, dtype, shape and bytes, and the header metadata but for the checksum of
    config.json (which transformers writes, with its own version in it)."""
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(path, "pt") as f:
        metadata = {k: v for k, v in (f.metadata() or {}).items() if k != "quantkit_config_sha256"}
        h.update(json.dumps(metadata, sort_keys=True).encode())
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name).contiguous()
            h.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
            h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def artifact_digests(out: Path) -> dict:
    """Digests of every tensor file, of the quantization_config (less the per-file checksums, which
    cover transformers' part of the directory) and of quant_log.json without its volatile keys."""
    digests = {p.name: _tensor_file_digest(p) for p in sorted(out.glob("*.safetensors"))}
    quant_config = json.loads((out / "config.json").read_text())["quantization_config"]
    quant_config.pop("files", None)
    digests["quantization_config"] = _digest(quant_config)
    digests["quant_log"] = _digest(strip_volatile(json.loads((out / "quant_log.json").read_text()), ENVIRONMENT))
    return digests


@pytest.fixture(scope="module")
def seeded_llama_dir(tmp_path_factory, tiny_tokenizer):
    """A 2-layer llama whose weights come from torch's seeded generator, not from transformers'
    initialisers (which may change between releases)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, rope_theta=100000.0)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp("seeded-llama")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one thread


@pytest.mark.parametrize("case", sorted(CASES))
def test_artifact_bytes_are_frozen(case, seeded_llama_dir, small_data, tmp_path, monkeypatch):
    method, params, nsamples = CASES[case]
    out = tmp_path / case
    monkeypatch.chdir(seeded_llama_dir.parent)  # the model's path is recorded: keep it the same in every run
    quantize_checkpoint(seeded_llama_dir.name, out, method, params, nsamples=nsamples, seqlen=32, calib="ptb",
                        device="cpu", data_dir=small_data, progress=False, checkpoint=False)
    got = artifact_digests(out)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    if os.environ.get("QUANTKIT_WRITE_GOLDEN") == "1":
        golden[case] = got
        GOLDEN.write_text(json.dumps(golden, indent=2, sort_keys=True) + "\n")
        pytest.skip("golden digests written")
    assert case in golden, f"no golden digests for {case}; see the module docstring"
    assert got == golden[case]
