"""The GPTQ evaluation and calibration protocol (IST-DASLab/gptq datautils), reproduced exactly.

Evaluation strings:
  wikitext2  test rows joined with "\\n\\n"
  c4         "c4-new": the first 1100 validation documents joined with " ", cut to 256*seqlen tokens
  ptb        "ptb-new": test sentences joined with " "
Calibration: `nsamples` windows of `seqlen` tokens drawn with random.seed(seed): for C4 a random
document long enough, then a random offset inside it; for PTB random offsets into the joined
train text. Every returned protocol dict says what was measured so results stay comparable.
"""

import random

import torch

from quantkit.data.calib_file import file_token_stream, is_calibration_file
from quantkit.data.texts import load_documents
from quantkit.errors import QuantkitError

C4_EVAL_DOCS = 1100
C4_EVAL_WINDOWS = 256


def _encode(tokenizer, text):
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]


def eval_tokens(name, tokenizer, seqlen, data_dir=None):
    """Token ids of the evaluation text of `name` and the protocol that produced them."""
    if name == "wikitext2":
        docs, source = load_documents("wikitext2", "test", data_dir)
        ids = _encode(tokenizer, "\n\n".join(docs))
        protocol = {"protocol": "gptq-wikitext2", "split": "test", "join": "\\n\\n", "documents": len(docs)}
    elif name == "c4":
        docs, source = load_documents("c4", "validation", data_dir)
        used = docs[:C4_EVAL_DOCS]
        ids = _encode(tokenizer, " ".join(used))[: C4_EVAL_WINDOWS * seqlen]
        protocol = {"protocol": "gptq-c4-new", "split": "validation", "join": " ", "documents": len(used),
                    "documents_expected": C4_EVAL_DOCS, "token_cap": C4_EVAL_WINDOWS * seqlen}
    elif name == "ptb":
        docs, source = load_documents("ptb", "test", data_dir)
        ids = _encode(tokenizer, " ".join(docs))
        protocol = {"protocol": "gptq-ptb-new", "split": "test", "join": " ", "documents": len(docs)}
    else:
        raise QuantkitError(f"unknown dataset {name!r}; choose wikitext2, c4 or ptb")
    protocol.update(dataset=name, source=source, tokens=int(ids.numel()), seqlen=seqlen)
    return ids, protocol


def _random_windows(ids, nsamples, seqlen, rng, what):
    """The reference's PTB rule: `nsamples` windows of `seqlen` tokens at random offsets of one stream."""
    if ids.numel() <= seqlen + 1:
        raise QuantkitError(f"{what} has {ids.numel()} tokens; a window of --seqlen {seqlen} needs more than "
                            f"{seqlen + 1}")
    starts = [rng.randint(0, ids.numel() - seqlen - 1) for _ in range(nsamples)]
    return [ids[start : start + seqlen] for start in starts]


def calibration_windows(name, tokenizer, nsamples, seqlen, seed=0, data_dir=None, field="text", chat=False):
    """[nsamples, seqlen] calibration token windows from the train split of `name`, or from the local
    file `name` (.txt / .jsonl / .json; data/calib_file.py), whose records' text is in `field`."""
    if nsamples < 1 or seqlen < 2:
        raise QuantkitError(f"calibration needs nsamples >= 1 and seqlen >= 2 (got {nsamples}, {seqlen})")
    rng = random.Random(seed)
    if is_calibration_file(name):
        ids, protocol = file_token_stream(name, tokenizer, field, chat)
        windows = _random_windows(ids, nsamples, seqlen, rng, f"--calib {name}")
        protocol.update(dataset="file", split=None, nsamples=nsamples, seqlen=seqlen, seed=seed,
                        protocol="file-windows")
        return torch.stack(windows), protocol
    if chat:
        raise QuantkitError("--calib-chat formats records of a local --calib file (.txt/.jsonl/.json)")
    if name == "c4":
        docs, source = load_documents("c4", "train", data_dir)
        encoded = [None] * len(docs)
        long_enough = 0
        for k, doc in enumerate(docs):
            encoded[k] = _encode(tokenizer, doc)
            long_enough += encoded[k].numel() > seqlen
        if long_enough == 0:
            raise QuantkitError(f"calibration data too short: no C4 train document ({source}) "
                                f"has more than {seqlen} tokens")
        windows, picked = [], set()
        for _ in range(nsamples):
            while True:  # same random stream as the reference: draw documents until one is long enough
                k = rng.randint(0, len(docs) - 1)
                if encoded[k].numel() > seqlen:
                    break
            start = rng.randint(0, encoded[k].numel() - seqlen - 1)
            windows.append(encoded[k][start : start + seqlen])
            picked.add(k)
        protocol = {"documents": len(docs), "documents_long_enough": long_enough,
                    "distinct_documents_used": len(picked)}
    elif name in ("ptb", "wikitext2"):
        docs, source = load_documents(name, "train", data_dir)
        ids = _encode(tokenizer, (" " if name == "ptb" else "\n\n").join(docs))
        windows = _random_windows(ids, nsamples, seqlen, rng, f"calibration data too short: {name} train")
        protocol = {"tokens": int(ids.numel())}
    else:
        raise QuantkitError(f"unknown calibration dataset {name!r}; choose c4, ptb or wikitext2")
    protocol.update(dataset=name, split="train", source=source, nsamples=nsamples, seqlen=seqlen, seed=seed,
                    protocol=f"gptq-{name}-train-windows")
    return torch.stack(windows), protocol
