"""Calibration text from a local file: .txt, .jsonl or .json, optionally through the chat template.

Documents:
  .txt    one document per block of lines separated by a blank line
  .jsonl  one JSON object per line, the document in field `field` (default "text"); a record with a
          "messages" list is a conversation
  .json   a JSON array of such objects (or of plain strings)
With chat=True every document goes through the tokenizer's chat template (a conversation as it is, a
plain text as one user turn). The documents are joined with "\\n\\n" into one token stream and the
windows are drawn from it with the seeded rule of the PTB protocol (random offsets), so short
documents are concatenated rather than dropped.
"""

import hashlib
import json
from pathlib import Path

from quantkit.errors import QuantkitError

SUFFIXES = (".txt", ".jsonl", ".json")


def is_calibration_file(name) -> bool:
    """Whether --calib names a local file (any path with a suffix quantkit reads) rather than a dataset."""
    return str(name).endswith(SUFFIXES)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuantkitError(f"--calib {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise QuantkitError(f"--calib {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise QuantkitError(f"--calib {path}: unreadable ({exc.strerror or exc})") from None


def _record(value, where, field):
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if isinstance(value.get("messages"), list):
            return value["messages"]
        if isinstance(value.get(field), str):
            return value[field]
        raise QuantkitError(f"{where}: no string field {field!r} (set --calib-field) and no \"messages\" list")
    raise QuantkitError(f"{where}: expected a JSON object or string, got {type(value).__name__}")


def read_documents(path, field="text") -> list:
    """The documents of a calibration file: strings, or message lists (conversations)."""
    path = Path(path)
    text = _text(path)
    if path.suffix == ".txt":
        docs = [block.strip() for block in text.split("\n\n")]
    elif path.suffix == ".jsonl":
        docs = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuantkitError(f"--calib {path}:{lineno}: not valid JSON ({exc.msg})") from None
            docs.append(_record(value, f"--calib {path}:{lineno}", field))
    elif path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise QuantkitError(f"--calib {path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(values, list):
            raise QuantkitError(f"--calib {path}: expected a JSON array of records")
        docs = [_record(v, f"--calib {path}[{i}]", field) for i, v in enumerate(values)]
    else:
        raise QuantkitError(f"--calib {path}: read are {', '.join(SUFFIXES)} files")
    docs = [d for d in docs if d]
    if not docs:
        raise QuantkitError(f"--calib {path}: no documents in it")
    return docs


def file_token_stream(path, tokenizer, field="text", chat=False):
    """(token ids [N], protocol) of the joined documents of a calibration file."""
    from quantkit.data.protocol import _encode

    path = Path(path)
    docs = read_documents(path, field)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise QuantkitError(f"--calib-chat: the tokenizer of this model has no chat template ({path})")
        docs = [tokenizer.apply_chat_template(d if isinstance(d, list) else [{"role": "user", "content": d}],
                                              tokenize=False) for d in docs]
    elif any(isinstance(d, list) for d in docs):
        raise QuantkitError(f"--calib {path}: holds conversations (\"messages\"); pass --calib-chat to format them")
    ids = _encode(tokenizer, "\n\n".join(docs))
    protocol = {"source": f"file:{path.name}", "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "documents": len(docs), "join": "\\n\\n", "field": field if path.suffix != ".txt" else None,
                "chat_template": bool(chat), "tokens": int(ids.numel()),
                "rule": "documents joined into one stream; windows at seeded random offsets (PTB rule)"}
    return ids, protocol
