"""Perplexity with the GPTQ protocol, and how far a model's predictions are from a reference's.

Non-overlapping windows of `seqlen` tokens, remainder dropped, each window scored on its own,
PPL = exp(mean over windows of the window's mean token NLL). The standard error is taken over
windows, the unit the protocol averages: se(NLL) = std(window NLLs) / sqrt(n), and by the delta
method se(PPL) = PPL · se(NLL).

With a reference model (usually the float checkpoint) the same windows also give, per scored token,
KL(P_ref ‖ P_model) of the two next-token distributions: its mean and 99th percentile, and the share
of tokens whose most likely next token is the same (llama.cpp's perplexity tool reports these; they
separate quantizers that perplexity alone ranks as ties).
"""

import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quantkit.errors import QuantkitError

KL_POSITIONS = 256  # positions per slice when comparing distributions (memory: a few vocab-sized rows each)


def _check_windows(model, ids, seqlen, max_windows):
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and seqlen > max_positions:
        raise QuantkitError(f"--seqlen {seqlen} exceeds the model's context of {max_positions} tokens")
    available = ids.numel() // seqlen
    if available == 0:
        raise QuantkitError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    windows = available if max_windows is None else min(available, max_windows)
    return ids[: windows * seqlen].view(windows, seqlen), available


def _window_nll(logits, batch):
    """Mean next-token NLL of each window: [batch]."""
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none")
    return losses.view(batch.shape[0], -1).mean(dim=1)


def _ppl_stats(window_nll: torch.Tensor, prefix=""):
    n = window_nll.numel()
    mean = window_nll.double().mean().item()
    ppl = math.exp(mean)
    se_nll = window_nll.double().std().item() / math.sqrt(n) if n > 1 else float("nan")
    return {f"{prefix}ppl": ppl, f"{prefix}nll": mean,
            f"{prefix}ppl_stderr": None if math.isnan(se_nll) else ppl * se_nll}


@torch.no_grad()
def perplexity(model, ids, seqlen=2048, max_windows=None, device="cpu", batch_size=1, progress=True, reference=None):
    """ids: 1-D token ids. Returns {"ppl", "nll", "ppl_stderr", "windows", "windows_available",
    "tokens_scored", "seconds"}; with `reference` (a model on the same device and tokenizer) also
    {"kld_mean", "kld_p99", "top1_agreement", "reference_ppl", "reference_ppl_stderr"}."""
    data, available = _check_windows(model, ids, seqlen, max_windows)
    windows = data.shape[0]
    nll, ref_nll, kld, agree = [], [], [], []
    start = time.perf_counter()
    for lo in tqdm(range(0, windows, batch_size), desc="ppl", unit="batch", disable=not progress):
        batch = data[lo : lo + batch_size].to(device)
        logits = model(batch, use_cache=False).logits.float()
        nll.append(_window_nll(logits, batch).cpu())
        if reference is not None:
            ref_logits = reference(batch, use_cache=False).logits.float()
            ref_nll.append(_window_nll(ref_logits, batch).cpu())
            for p0 in range(0, seqlen - 1, KL_POSITIONS):  # full-vocabulary temporaries a slice at a time
                end = min(p0 + KL_POSITIONS, seqlen - 1)
                ours, theirs = logits[:, p0:end], ref_logits[:, p0:end]
                logp, ref_logp = F.log_softmax(ours, -1), F.log_softmax(theirs, -1)
                kld.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).reshape(-1).cpu())
                agree.append((ours.argmax(-1) == theirs.argmax(-1)).reshape(-1).cpu())
    out = {**_ppl_stats(torch.cat(nll)), "windows": windows, "windows_available": available,
           "tokens_scored": windows * (seqlen - 1)}
    if reference is not None:
        per_token = torch.cat(kld).double()
        out.update({"kld_mean": per_token.mean().item(), "kld_p99": torch.quantile(per_token, 0.99).item(),
                    "top1_agreement": torch.cat(agree).double().mean().item(),
                    **_ppl_stats(torch.cat(ref_nll), prefix="reference_")})
        out.pop("reference_nll")
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out
