"""Text readers and the GPTQ protocol: evaluation strings, calibration windows, seeds."""

import pytest
import torch

from quantkit.data import calibration_windows, eval_tokens, load_documents
from quantkit.errors import QuantkitError


class RecordingTokenizer:
    """Byte-level stand-in that records the text it was given."""

    def __init__(self):
        self.texts = []

    def __call__(self, text, return_tensors=None, verbose=True):
        self.texts.append(text)
        ids = torch.tensor([list(text.encode("utf-8"))])
        return type("Enc", (), {"input_ids": ids})()


def test_wikitext2_joins_test_rows_with_blank_lines(data_dir):
    tok = RecordingTokenizer()
    rows, _ = load_documents("wikitext2", "test", data_dir)
    assert len(rows) == 4358
    ids, protocol = eval_tokens("wikitext2", tok, 2048, data_dir)
    assert tok.texts[0] == "\n\n".join(rows)
    assert len(tok.texts[0]) == 1294336  # the GPTQ test string length (shared/data/README.md)
    assert protocol["protocol"] == "gptq-wikitext2" and protocol["tokens"] == ids.numel()


def test_c4_eval_is_cut_to_256_windows(data_dir):
    tok = RecordingTokenizer()
    ids, protocol = eval_tokens("c4", tok, 128, data_dir)
    docs, _ = load_documents("c4", "validation", data_dir)
    assert tok.texts[0] == " ".join(docs[:1100])
    assert ids.numel() == 256 * 128
    assert protocol["protocol"] == "gptq-c4-new"


def test_ptb_joins_stripped_test_sentences_with_spaces(data_dir):
    tok = RecordingTokenizer()
    eval_tokens("ptb", tok, 2048, data_dir)
    assert tok.texts[0].startswith("no it was n't black monday but while")


def test_calibration_is_deterministic_per_seed(data_dir, tiny_tokenizer):
    a, proto = calibration_windows("c4", tiny_tokenizer, 6, 64, seed=0, data_dir=data_dir)
    b, _ = calibration_windows("c4", tiny_tokenizer, 6, 64, seed=0, data_dir=data_dir)
    c, _ = calibration_windows("c4", tiny_tokenizer, 6, 64, seed=1, data_dir=data_dir)
    assert a.shape == (6, 64) and torch.equal(a, b) and not torch.equal(a, c)
    assert proto["seed"] == 0 and proto["nsamples"] == 6 and proto["dataset"] == "c4"
    p, _ = calibration_windows("ptb", tiny_tokenizer, 3, 64, seed=0, data_dir=data_dir)
    assert p.shape == (3, 64)


def test_calibration_longer_than_any_document_is_refused(data_dir):
    with pytest.raises(QuantkitError, match="too short"):
        calibration_windows("c4", RecordingTokenizer(), 1, 10**7, data_dir=data_dir)


def test_wikitext2_train_is_not_available_offline(data_dir, monkeypatch):
    import quantkit.data.texts as texts

    monkeypatch.setattr(texts, "_read_hub", lambda name, split: None)
    with pytest.raises(QuantkitError, match="not available offline"):
        load_documents("wikitext2", "train", data_dir)
