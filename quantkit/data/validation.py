"""Held-out validation windows for choosing between quantized models (the OOC two-flow ensemble).

They must share no text with the calibration windows or the evaluation sets:
  c4         train documents of at most `seqlen` tokens, in file order, joined with " " and cut into
             windows. GPTQ-protocol calibration only draws documents *longer* than seqlen, and
             evaluation reads the validation split, so these texts are seen by neither.
  ptb        the valid split (calibration uses train, evaluation test).
  wikitext2  the validation split (Hub only; the shared data has none).
"""

import torch

from quantkit.data.protocol import _encode
from quantkit.data.texts import load_documents
from quantkit.errors import QuantkitError


def validation_windows(name, tokenizer, nwindows, seqlen, data_dir=None):
    """([nwindows, seqlen] token ids, protocol dict)."""
    if nwindows < 1:
        raise QuantkitError(f"validation needs at least one window, got {nwindows}")
    if name == "c4":
        docs, source = load_documents("c4", "train", data_dir)
        chunks, total, used = [], 0, 0
        for doc in docs:
            ids = _encode(tokenizer, doc)
            if ids.numel() > seqlen:  # calibration territory
                continue
            chunks.append(ids)
            total += ids.numel()
            used += 1
            if total >= nwindows * seqlen:
                break
        ids = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.long)
        rule = f"c4 train documents of <= {seqlen} tokens (never drawn by calibration), joined"
    elif name in ("ptb", "wikitext2"):
        docs, source = load_documents(name, "validation", data_dir)
        used = len(docs)
        ids = _encode(tokenizer, (" " if name == "ptb" else "\n\n").join(docs))
        rule = f"{name} validation split"
    else:
        raise QuantkitError(f"unknown validation dataset {name!r}; choose c4, ptb or wikitext2")
    available = ids.numel() // seqlen
    if available < nwindows:
        raise QuantkitError(f"validation data too short: {name} gives {available} windows of {seqlen} tokens, "
                            f"{nwindows} requested")
    windows = ids[: nwindows * seqlen].view(nwindows, seqlen)
    return windows, {"dataset": name, "source": source, "rule": rule, "documents": used, "windows": nwindows,
                     "seqlen": seqlen}
