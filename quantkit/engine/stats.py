"""Forward hooks that gather per-linear input statistics during calibration."""

import torch

_HALF = (torch.float16, torch.bfloat16)
_half_gemm_fp32_out = {}  # dtype -> whether torch.mm(..., out_dtype=float32) exists for it on CUDA here


def half_gemm_fp32_out(dtype) -> bool:
    """Whether this torch multiplies CUDA fp16/bf16 matrices into an fp32 result (`out_dtype`), decided once
    per process on a 1×1 probe, so that the path, and so the artifact's bits, never depends on how the
    first real call went (an out-of-memory error there is raised, not taken for a missing feature)."""
    if dtype not in _half_gemm_fp32_out:
        probe = torch.ones(1, 1, dtype=dtype, device="cuda")
        try:
            supported = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except torch.OutOfMemoryError:
            raise
        except (TypeError, NotImplementedError, RuntimeError):  # no `out_dtype`, or no kernel for this dtype
            supported = False
        _half_gemm_fp32_out[dtype] = supported
    return _half_gemm_fp32_out[dtype]


def add_gram(total: torch.Tensor, x: torch.Tensor):
    """total (fp32, d×d) += xᵀx for x of shape (tokens, d).

    fp16/bf16 activations on CUDA are multiplied in their own dtype with an fp32 result: a product of two
    such numbers is exact in fp32, so this is the fp32 sum of exact products just as converting x to fp32
    first is (only the order of the additions differs), at tensor-core rather than fp32 speed, which made
    the Gram the largest cost of a 7B calibration pass. Elsewhere (CPU, fp32 models, a torch without
    `out_dtype`) x is converted to fp32."""
    if x.is_cuda and x.dtype in _HALF and half_gemm_fp32_out(x.dtype):
        total.add_(torch.mm(x.t(), x, out_dtype=torch.float32))
        return
    x = x.to(torch.float32)
    total.addmm_(x.t(), x)


class InputGramCollector:
    """Accumulates Σ xᵀx over every token that reaches a linear (fp32 sums, add_gram), plus sample/token counts.

    GPTQ's Hessian is H = 2·Σ xᵀx / nsamples (nsamples = calibration windows, as in the reference).
    The same sum gives each module's output reconstruction error tr(ΔW·Σxᵀx·ΔWᵀ) without storing X.

    The sum is taken in the canonical order of engine.distributed (so that any number of ranks gives
    the same bits): the windows this process sees form consecutive shards of `shard_sizes` windows;
    each shard is summed from zero, and shards are folded onto a zero total in order (`eager`, rank 0
    and single runs) or kept for the cross-rank chain (`eager=False`). The engine feeds one window
    per forward pass and calls end_window() after each (a routed expert's linear runs in a window only
    when a token of it was routed there, so hook calls do not count windows). Without `shard_sizes`
    every hook call is one window of an unbounded run (the plain running sum, for callers outside the
    engine).
    """

    def __init__(self, module: torch.nn.Linear, shard_sizes=None, eager=True):
        d = module.in_features
        device = module.weight.device
        self.shard_sizes = list(shard_sizes) if shard_sizes is not None else None
        self.eager = eager
        self.total = torch.zeros(d, d, dtype=torch.float32, device=device) if eager else None
        self.parts = []
        self.current = torch.zeros(d, d, dtype=torch.float32, device=device)
        self.shard = 0  # index into shard_sizes
        self.in_shard = 0  # windows already in `current`
        self.nsamples = 0
        self.ntokens = 0
        self.handle = module.register_forward_hook(self._hook)

    @property
    def xtx(self):
        """The local sum so far (single-process use: the folded shards plus the open one)."""
        if self.shard_sizes is None:
            return self.current
        return self.total if self.in_shard == 0 else self.total + self.current

    def _hook(self, module, inputs, output):
        x = inputs[0].detach()
        batch = x.shape[0] if x.dim() > 2 else 1
        x = x.reshape(-1, x.shape[-1])
        add_gram(self.current, x)
        self.ntokens += x.shape[0]
        if self.shard_sizes is None:
            self.nsamples += batch

    def end_window(self):
        """One window's forward is over (engine use, with `shard_sizes`)."""
        self.nsamples += 1
        self.in_shard += 1
        if self.in_shard == self.shard_sizes[self.shard]:
            self._close_shard()

    def _close_shard(self):
        if self.eager:
            self.total.add_(self.current)
            self.current.zero_()
        else:
            self.parts.append(self.current)
            self.current = torch.zeros_like(self.current)
        self.shard += 1
        self.in_shard = 0

    def remove(self):
        self.handle.remove()

    def stats(self, ranks=None) -> dict:
        """{"xtx", "nsamples", "ntokens"}; with `ranks`, the canonical total over all ranks."""
        if self.shard_sizes is None or ranks is None:
            return {"xtx": self.xtx, "nsamples": self.nsamples, "ntokens": self.ntokens}
        if self.shard != len(self.shard_sizes) or self.in_shard:
            raise RuntimeError(f"collector saw {self.shard} of {len(self.shard_sizes)} shards; a window is missing")
        self.current = None  # free the open-shard buffer before the cross-rank chain
        xtx = ranks.ordered_sum(self.total, self.parts)
        self.parts = []
        return {"xtx": xtx, "nsamples": ranks.sum_int(self.nsamples), "ntokens": ranks.sum_int(self.ntokens)}


def output_error(delta_w: torch.Tensor, stats: dict) -> float:
    """Mean squared output error per output element: ‖XΔWᵀ‖² / (tokens · out_features)."""
    dw = delta_w.to(torch.float32)
    total = torch.einsum("ij,jk,ik->", dw, stats["xtx"], dw).item()
    return total / (stats["ntokens"] * dw.shape[0])
