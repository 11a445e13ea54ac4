"""WikiText-2, C4 and PTB texts, read from a local data directory or (optionally) the Hub.

The local layout is the one of shared/data (see its README): every loader returns the raw
documents/rows exactly as the Hugging Face `datasets` versions would, so the GPTQ protocol
joins them the same way whichever source was used.
"""

import json
from pathlib import Path

from quantkit import settings
from quantkit.errors import QuantkitError

DATASETS = ("wikitext2", "c4", "ptb")

_LOCAL_FILES = {
    ("wikitext2", "test"): "wikitext2/wikitext-2-raw-v1.test.rows.jsonl",
    ("c4", "validation"): "c4/c4-validation.00000-of-00008.head1025.jsonl",
    ("c4", "train"): "c4/c4-train.00000-of-01024.head1041.jsonl",
    ("ptb", "test"): "ptb/ptb.test.txt",
    ("ptb", "validation"): "ptb/ptb.valid.txt",
    ("ptb", "train"): "ptb/ptb.train.txt",
}


def _read_jsonl_texts(path: Path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def _read_ptb_sentences(path: Path):
    # HF ptb_text_only yields line.strip() for every line of the original file.
    with open(path, encoding="utf-8") as fh:
        return [line.strip() for line in fh]


def _read_local(name, split, path: Path):
    return _read_ptb_sentences(path) if name == "ptb" else _read_jsonl_texts(path)


def _read_hub(name, split):
    try:
        from datasets import load_dataset
    except ImportError:
        return None
    if name == "wikitext2":
        return list(load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"])
    if name == "c4":
        shard = {"train": "en/c4-train.00000-of-01024.json.gz", "validation": "en/c4-validation.00000-of-00008.json.gz"}
        return list(load_dataset("allenai/c4", data_files={split: shard[split]}, split=split)["text"])
    return list(load_dataset("ptb_text_only", "penn_treebank", split=split)["sentence"])


def check_available(name, split, data_dir=None, field="text"):
    """Refuse, before any expensive work, a dataset split that is neither local nor loadable from the Hub,
    or a calibration file that cannot be read (missing, empty, not UTF-8, malformed records)."""
    from quantkit.data.calib_file import is_calibration_file, read_documents

    if is_calibration_file(name):
        read_documents(name, field)
        return
    if name not in DATASETS:
        raise QuantkitError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    root = settings.data_dir(data_dir)
    rel = _LOCAL_FILES.get((name, split))
    if root is not None and rel is not None and (root / rel).is_file():
        return
    import importlib.util

    if (name, split) == ("wikitext2", "train") and root is not None:
        raise QuantkitError("WikiText-2 train is not available offline (the shared data has only the test split); "
                            "use --calib c4 or ptb")
    if importlib.util.find_spec("datasets") is None:
        where = f"no {root / rel}" if root is not None and rel else "no data directory is set"
        raise QuantkitError(f"{name} {split}: not found locally ({where}) and `datasets` is not installed; set "
                            f"--data-dir/QUANTKIT_DATA to a directory with {rel or name + ' ' + split}")


def load_documents(name, split, data_dir=None):
    """Return (documents, source description) for one split of one dataset."""
    if name not in DATASETS:
        raise QuantkitError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    root = settings.data_dir(data_dir)
    rel = _LOCAL_FILES.get((name, split))
    if root is not None and rel is not None and (root / rel).is_file():
        return _read_local(name, split, root / rel), f"local:{rel}"
    if (name, split) == ("wikitext2", "train") and root is not None:
        hint = ("WikiText-2 train is not available offline (the shared data has only the test split); "
                "use --calib c4 or ptb")
    else:
        hint = f"set --data-dir/QUANTKIT_DATA to a directory with {rel or name + ' ' + split}"
    try:
        docs = _read_hub(name, split)
    except Exception as exc:  # network or Hub failures: report them as one line
        raise QuantkitError(f"{name} {split}: not found locally and the Hub load failed ({exc}); {hint}") from exc
    if docs is None:
        raise QuantkitError(f"{name} {split}: not found locally and `datasets` is not installed; {hint}")
    return docs, "hub"
