"""Mixture-of-experts layers with one 2-D linear per expert matrix.

transformers 5 stores the experts of a MoE block as fused 3-D parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I], or their transposes) in one `...Experts` module called as
experts(hidden [S, H], top_k_index [S, k], top_k_weights [S, k]). Quantizing each expert on its own
routed tokens needs each expert matrix as a module of its own, so RoutedExperts replaces such a module:
expert e (child `e`) holds `gate_proj`, `up_proj` (the two halves of gate_up_proj[e]) and `down_proj`, as nn.Linear
while the engine works (names `...experts.{e}.gate_proj`, as Hugging Face checkpoints store them) and as
QuantLinear once loaded from an artifact. Its forward is the eager loop transformers ships (same
one-hot routing, same index_add order); the router stays in the MoE block, in float.

Layouts handled: concatenated [gate; up] halves, optionally transposed storage, no biases, no norm after
the experts, the default gate act(gate) * up. Others (e.g. interleaved gate/up with biases) are refused
with one line naming what differs.
"""

import torch
import torch.nn as nn

from quantkit.errors import QuantkitError


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)); the three projections are nn.Linear or QuantLinear."""

    def __init__(self, gate_proj, up_proj, down_proj, act_fn):
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """Stands where transformers' fused experts module stood, with the same call.

    `calibrate_on_all_tokens` (a set of expert indices, empty outside calibration) makes those experts
    run on every token that reached the block instead of their routed ones, contributing nothing to the
    output: the engine's rule for an expert that was routed too few tokens to calibrate on (only in
    statistics passes, whose outputs are not used)."""

    # the order in which the engine quantizes an expert's linears: gate and up read the same input
    STAGES = (("gate_proj", "up_proj"), ("down_proj",))

    def __init__(self, experts):
        super().__init__()
        for e, expert in enumerate(experts):  # children "0", "1", ...: names as checkpoints store them
            self.add_module(str(e), expert)
        self.num_experts = len(experts)
        self.calibrate_on_all_tokens = frozenset()

    def expert(self, e) -> ExpertMLP:
        return self._modules[str(e)]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():  # [E, k, S]: which of its k choices sent each token to expert e
            routed = nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = routed.sum(dim=(-1, -2)).gt(0).nonzero().flatten().tolist()
        for e in range(self.num_experts):
            if e in self.calibrate_on_all_tokens:
                self.expert(e)(hidden_states)  # statistics only
                continue
            if e not in hit:
                continue
            position, token = torch.where(routed[e])
            y = self.expert(e)(hidden_states[token]) * top_k_weights[token, position, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def extra_repr(self):
        return f"num_experts={self.num_experts}"


def is_fused_experts(module) -> bool:
    """Whether `module` keeps its experts as 3-D parameters (transformers 5's `...Experts` modules)."""
    down = getattr(module, "down_proj", None)
    return (isinstance(down, nn.Parameter) and down.dim() == 3 and hasattr(module, "num_experts")
            and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter))


def _check_layout(path, fused):
    from transformers.integrations import moe

    default_gate = getattr(moe, "_default_apply_gate", None)
    differs = [what for what, bad in (
        ("interleaved gate/up", not getattr(fused, "is_concatenated", True)),
        ("no gate projection", not getattr(fused, "has_gate", True)),
        ("biases", getattr(fused, "has_bias", False) or hasattr(fused, "gate_up_proj_bias")),
        ("a norm after the experts", getattr(fused, "has_post_expert_norm", False)),
        # a private helper of transformers: where a release lacks it, the gate is not checked
        ("its own gate function", default_gate is not None
         and getattr(type(fused), "_apply_gate", default_gate) is not default_gate),
    ) if bad]
    if differs:
        raise QuantkitError(f"{path}: experts module {type(fused).__name__} has {', '.join(differs)}; quantkit "
                            "quantizes experts stored as concatenated [gate; up] and down matrices with the default "
                            "gate act(gate) * up")


def routed_from_fused(path, fused, copy_weights=True) -> RoutedExperts:
    """A RoutedExperts with nn.Linear experts equal to the fused module's matrices (on the fused module's
    device; meta stays meta). copy_weights=False leaves them uninitialised (to be replaced)."""
    _check_layout(path, fused)
    gate_up, down = fused.gate_up_proj, fused.down_proj
    transposed = getattr(fused, "is_transposed", False)
    experts = []
    for e in range(fused.num_experts):
        w_gate_up = gate_up[e].t() if transposed else gate_up[e]  # [2I, H]
        w_down = down[e].t() if transposed else down[e]  # [H, I]
        inter = w_gate_up.shape[0] // 2
        linears = []
        for weight in (w_gate_up[:inter], w_gate_up[inter:], w_down):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
            linear.weight = nn.Parameter(weight.detach().clone() if copy_weights else torch.empty_like(weight),
                                         requires_grad=False)
            linears.append(linear)
        experts.append(ExpertMLP(*linears, fused.act_fn))
    return RoutedExperts(experts)


def replace_fused_experts(model, copy_weights=True) -> list:
    """Replace every fused experts module of `model` by a RoutedExperts (see routed_from_fused), one module
    at a time so the host holds one extra copy of one module at most; returns the replaced paths."""
    paths = [name for name, module in model.named_modules() if is_fused_experts(module)]
    for path in paths:
        fused = model.get_submodule(path)
        model.set_submodule(path, routed_from_fused(path, fused, copy_weights))
        del fused
    return paths
