"""Architecture discovery: where a causal LM keeps its decoder blocks, which linears a block holds, and
in which order (and in which groups) the engine quantizes them. Nothing here is a per-model table.

  * blocks: the outermost nn.ModuleList of same-class modules under the model's decoder that holds
    the most parameters (`model.layers`, `model.decoder.layers`, `gpt_neox.layers`, ...);
  * linears: every nn.Linear inside a block, in registration order, except a mixture-of-experts
    router (a linear beside an experts module whose outputs are one per expert, or one gate value),
    which stays in float unless `quantize_routers`;
  * sequential groups: learned from one forward of the block (`steps`): the linears run in some
    order, and those that read the very same input tensor form a group (one set of statistics
    serves them). Groups are quantized in the order they first run (true-sequential: a group's
    input depends only on the groups before it). The linears of a RoutedExperts module are not
    observed (an expert may receive no token in the observed window): its gate/up projections of
    every expert form one step and its down projections the next, since no expert reads another.
"""

from dataclasses import dataclass

import torch.nn as nn

from quantkit.errors import QuantkitError
from quantkit.runtime.experts import RoutedExperts, is_fused_experts


@dataclass(frozen=True)
class ArchAdapter:
    name: str  # the config's model_type
    layers_path: str  # attribute path from the CausalLM module to the ModuleList of decoder blocks
    quantize_routers: bool = False

    def layers(self, model) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linears(self, layer) -> dict:
        """{name inside the block: nn.Linear} of the linears to quantize, in registration order."""
        skip = set() if self.quantize_routers else _router_names(layer)
        return {name: module for name, module in layer.named_modules()
                if isinstance(module, nn.Linear) and name not in skip}

    def linear_names(self, layer) -> list:
        return list(self.linears(layer))

    def steps(self, layer, calls) -> tuple:
        """The quantization plan of `layer`: a tuple of steps, each a tuple of groups (tuples of linear
        names that read one input), from `calls` = [(linear name, its input tensor)] in the order one
        forward of the block ran them (gather with observe_calls). Every step needs one forward."""
        names = self.linears(layer)
        experts = {path: module for path, module in layer.named_modules() if isinstance(module, RoutedExperts)}

        def experts_of(name):
            return next((path for path in experts if name.startswith(path + ".")), None)

        steps, dense, seen = [], [], {}  # dense: [[names], input] per group; a step holds one of them
        for name, x in calls:
            if name not in names:
                continue
            owner = experts_of(name)
            if owner is not None:
                if owner not in seen:
                    seen[owner] = True
                    steps += _expert_steps(owner, experts[owner])
                continue
            if name in seen:
                raise QuantkitError(f"{self.name}: linear {name} runs more than once in one forward of a block; "
                                    "quantkit calibrates a linear on one input per forward")
            seen[name] = True
            group = next((g for g in dense if _same_input(g[1], x)), None)
            if group is None:
                group = [[name], x]
                dense.append(group)
                steps.append(group[0])  # the step's single group: this list grows as members join
            else:
                group[0].append(name)
        missing = [n for n in names if n not in seen and experts_of(n) is None]
        if missing:
            raise QuantkitError(f"{self.name}: linear(s) {', '.join(missing)} did not run in a forward of the block; "
                                "quantkit cannot calibrate them")
        return tuple(step if isinstance(step, tuple) else (tuple(step),) for step in steps)


def observe_calls(layer, names, run):
    """[(name, input)] of the linears `names` of `layer` in the order `run()` (one forward) calls them.
    The inputs are kept alive until the list is dropped, so their storage cannot be reused (and so
    two inputs share a data pointer only when they are views of one tensor)."""
    calls, handles = [], []
    try:
        for name in names:
            module = layer.get_submodule(name)
            handles.append(module.register_forward_pre_hook(
                lambda module, args, name=name: calls.append((name, args[0]))))
        run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _same_input(a, b) -> bool:
    if a is b:
        return True
    return (a.device == b.device and a.device.type != "meta" and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def _expert_steps(path, experts: RoutedExperts) -> list:
    return [tuple(tuple(f"{path}.{e}.{leaf}" for leaf in stage) for e in range(experts.num_experts))
            for stage in RoutedExperts.STAGES]


def _router_names(layer) -> set:
    """Linears that route tokens among experts: beside an experts module, one output per expert (or a
    single gate value, as a shared expert's gate)."""
    routers = set()
    for path, module in layer.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, RoutedExperts) or is_fused_experts(child):
                count = child.num_experts
            elif child_name == "experts" and isinstance(child, nn.ModuleList):
                count = len(child)
            else:
                continue
            inside = f"{path}.{child_name}" if path else child_name
            for name, sub in module.named_modules():
                full = f"{path}.{name}" if path else name
                if isinstance(sub, nn.Linear) and not full.startswith(inside + ".") and \
                        sub.out_features in (count, 1):
                    routers.add(full)
    return routers


def find_decoder_layers(model) -> str:
    """The attribute path of the decoder block list of `model` (see the module docstring)."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    root = decoder if isinstance(decoder, nn.Module) else getattr(model, "base_model", model)
    root_path = next((name for name, module in model.named_modules() if module is root), "")
    candidates = []
    inside = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue  # a list inside a block (e.g. experts) is not the block list
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            inside.append(name)
            size = sum(p.numel() for p in module.parameters())
            candidates.append((size, name))
    if not candidates:
        raise QuantkitError(f"{type(model).__name__}: no list of decoder blocks found (an nn.ModuleList of "
                            "same-class blocks under the decoder)")
    _, name = max(candidates, key=lambda c: c[0])  # max keeps the first of equals
    return ".".join(part for part in (root_path, name) if part)


def adapter_for(model, quantize_routers=False) -> ArchAdapter:
    """The adapter of a loaded (or meta-device) causal LM; refuses one whose blocks hold no nn.Linear."""
    path = find_decoder_layers(model)
    adapter = ArchAdapter(name=getattr(model.config, "model_type", type(model).__name__), layers_path=path,
                          quantize_routers=quantize_routers)
    first = adapter.layers(model)[0]
    if not adapter.linears(first) and not any(is_fused_experts(m) for m in first.modules()):
        kinds = sorted({type(m).__name__ for m in first.modules() if m is not first and not list(m.children())})
        raise QuantkitError(f"unsupported architecture {adapter.name!r}: its decoder blocks ({path}) hold no "
                            f"nn.Linear to quantize (found {', '.join(kinds[:6])})")
    return adapter
