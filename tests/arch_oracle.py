"""The oracle of the architecture tests: the float checkpoint, run by transformers' own code, with every
quantized weight of an artifact put back as its dequantized value; and the config overrides under which the
tiny random models continue a prompt with varied tokens (token equality then says something).

    dequantized_reference(src, artifact, dtype=torch.float32, device="cpu") -> eval-mode transformers model
    window_ppl(model, ids, seqlen, windows) -> exp(mean next-token NLL) over the first non-overlapping windows
    LIVELY: {architecture: config overrides}, lively(arch) -> the overrides of `arch`
"""

import re

import torch
import torch.nn.functional as F

from quantkit.artifact import read_config, read_quantized_tensors
from quantkit.models.loading import Source, checkpoint_dtype
from quantkit.pipeline import storage_dtype
from quantkit.runtime.experts import is_fused_experts

# With the default init (std 0.02) most of these 2-layer models repeat one token forever, and with tied
# embeddings a wide init makes the last prompt token its own best continuation (Gemma's scaled embeddings);
# std 0.3 and an untied head give each architecture 5-8 distinct tokens in 8 (GPT-NeoX: std 0.1, at 0.3
# one prompt repeats a token).
_DEFAULT = {"initializer_range": 0.3, "tie_word_embeddings": False}
LIVELY = {"gpt_neox": {"initializer_range": 0.1, "tie_word_embeddings": False}}


def lively(arch):
    return LIVELY.get(arch, _DEFAULT)


def dequantized_reference(src, artifact, dtype=torch.float32, device="cpu"):
    """The float checkpoint `src` loaded by transformers (fused experts and all) in `dtype` on `device`, its
    unquantized tensors rounded as the artifact stores them (fp16, or bf16 for a bf16 checkpoint), each
    quantized weight replaced by its dequantized value in `dtype`."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).to(device).eval()
    stored = storage_dtype(checkpoint_dtype(Source("hf_dir", str(src))))
    for param in reference.parameters():
        param.data = param.data.to(stored).to(dtype)
    qtensors, _ = read_quantized_tensors(artifact, read_config(artifact)["quantization_config"]["modules"])
    with torch.no_grad():
        for name, qtensor in qtensors.items():
            weight = qtensor.dequantize(dtype).to(device)
            expert = re.fullmatch(r"(.+)\.(\d+)\.(gate_proj|up_proj|down_proj)", name)
            fused = reference.get_submodule(expert[1]) if expert else None
            if fused is not None and is_fused_experts(fused):
                e, leaf = int(expert[2]), expert[3]
                if leaf == "down_proj":
                    fused.down_proj[e].copy_(weight)
                else:  # gate_up_proj[e] is [gate; up]
                    half = fused.gate_up_proj.shape[1] // 2
                    rows = slice(0, half) if leaf == "gate_proj" else slice(half, None)
                    fused.gate_up_proj[e, rows].copy_(weight)
            else:
                reference.get_submodule(name).weight.copy_(weight)
    return reference


def window_ppl(model, ids, seqlen, windows):
    """exp(mean next-token NLL) of `model` over the first `windows` non-overlapping `seqlen` windows of the 1-D
    token ids, the NLL taken in float64 from the model's logits."""
    import math

    device = next(model.parameters()).device
    data = ids[: windows * seqlen].view(windows, seqlen).to(device)
    with torch.inference_mode():
        logits = model(data).logits.double()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    return math.exp(nll.item())
