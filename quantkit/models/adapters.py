"""Architecture adapters: where a model keeps its decoder layers and which linears each holds.

Each adapter is declared, not guessed: the engine and the runtime only quantize the linears
named here, in the order given (true-sequential: a group's inputs depend on the groups before
it, so the engine re-runs the layer between groups).
"""

from dataclasses import dataclass

import torch.nn as nn

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class ArchAdapter:
    name: str
    model_types: tuple
    layers_path: str  # attribute path from the CausalLM module to the ModuleList of decoder layers
    # tuple of tuples of linear names inside a layer, in quantization order; the linears of one
    # group must read the same input tensor (the engine gathers their statistics once)
    sequential_groups: tuple

    def layers(self, model) -> nn.ModuleList:
        module = model
        for part in self.layers_path.split("."):
            module = getattr(module, part)
        return module

    def linear_names(self):
        return [name for group in self.sequential_groups for name in group]

    def linears(self, layer) -> dict:
        found = {}
        for name in self.linear_names():
            module = layer.get_submodule(name)
            if not isinstance(module, nn.Linear):
                raise QuantkitError(f"{self.name} adapter expected nn.Linear at {name}, found {type(module).__name__}")
            found[name] = module
        return found


_LLAMA_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)

ADAPTERS = (
    ArchAdapter(
        name="llama",
        # SmolLM/SmolLM2 are llama model_type; Mistral, Qwen2 and Qwen3 share the llama layer shape.
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        layers_path="model.layers",
        sequential_groups=_LLAMA_GROUPS,
    ),
    ArchAdapter(
        name="opt",
        model_types=("opt",),
        layers_path="model.decoder.layers",
        sequential_groups=(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("self_attn.out_proj",),
            ("fc1",),
            ("fc2",),
        ),
    ),
)


def supported_model_types():
    return sorted(t for a in ADAPTERS for t in a.model_types)


def adapter_for(config) -> ArchAdapter:
    model_type = getattr(config, "model_type", None)
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise QuantkitError(
        f"unsupported architecture {model_type!r}; supported model types: {', '.join(supported_model_types())}"
    )
