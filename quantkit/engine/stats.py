"""Forward hooks that gather per-linear input statistics during calibration."""

import torch


class InputGramCollector:
    """Accumulates Σ xᵀx over every token that reaches a linear (fp32), plus sample/token counts.

    GPTQ's Hessian is H = 2·Σ xᵀx / nsamples (nsamples = calibration windows, as in the reference).
    The same sum gives each module's output reconstruction error tr(ΔW·Σxᵀx·ΔWᵀ) without storing X.
    """

    def __init__(self, module: torch.nn.Linear):
        d = module.in_features
        self.xtx = torch.zeros(d, d, dtype=torch.float32, device=module.weight.device)
        self.nsamples = 0
        self.ntokens = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        x = inputs[0].detach()
        batch = x.shape[0] if x.dim() > 2 else 1
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.xtx.addmm_(x.t(), x)
        self.nsamples += batch
        self.ntokens += x.shape[0]

    def remove(self):
        self.handle.remove()

    def stats(self) -> dict:
        return {"xtx": self.xtx, "nsamples": self.nsamples, "ntokens": self.ntokens}


def output_error(delta_w: torch.Tensor, stats: dict) -> float:
    """Mean squared output error per output element: ‖XΔWᵀ‖² / (tokens · out_features)."""
    dw = delta_w.to(torch.float32)
    total = torch.einsum("ij,jk,ik->", dw, stats["xtx"], dw).item()
    return total / (stats["ntokens"] * dw.shape[0])
