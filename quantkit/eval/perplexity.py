"""Perplexity with the GPTQ protocol: non-overlapping windows of `seqlen` tokens, remainder
dropped, each window scored on its own, PPL = exp(mean over windows of the mean token NLL)."""

import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quantkit.errors import QuantkitError


@torch.no_grad()
def perplexity(model, ids, seqlen=2048, max_windows=None, device="cpu", batch_size=1, progress=True):
    """ids: 1-D token ids. Returns {"ppl", "nll", "windows", "windows_available", "tokens_scored", "seconds"}."""
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and seqlen > max_positions:
        raise QuantkitError(f"--seqlen {seqlen} exceeds the model's context of {max_positions} tokens")
    available = ids.numel() // seqlen
    if available == 0:
        raise QuantkitError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    windows = available if max_windows is None else min(available, max_windows)
    data = ids[: windows * seqlen].view(windows, seqlen)
    nll_sum = 0.0
    start = time.perf_counter()
    for lo in tqdm(range(0, windows, batch_size), desc="ppl", unit="batch", disable=not progress):
        batch = data[lo : lo + batch_size].to(device)
        logits = model(batch, use_cache=False).logits.float()
        losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="none").view(batch.shape[0], -1)
        nll_sum += losses.mean(dim=1).sum().item()
    mean_nll = nll_sum / windows
    return {"ppl": math.exp(mean_nll), "nll": mean_nll, "windows": windows, "windows_available": available,
            "tokens_scored": windows * (seqlen - 1), "seconds": round(time.perf_counter() - start, 2)}
