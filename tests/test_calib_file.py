"""Calibration from a local .txt / .jsonl / .json file: documents as stated, windows drawn with the seeded
rule, short documents joined rather than dropped, the chat template on request, and one-line refusals
(empty, not UTF-8, too small, no such field, no chat template) before the model loads."""

import json

import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.data import calibration_windows
from quantkit.data.calib_file import read_documents
from quantkit.errors import QuantkitError


@pytest.fixture(scope="module")
def texts(data_dir):
    """Short WikiText-2 paragraphs: each far shorter than one calibration window."""
    path = data_dir / "wikitext2" / "wikitext-2-raw-v1.test.rows.jsonl"
    rows = [json.loads(line)["text"].strip() for line in open(path)]
    return [r for r in rows if 20 < len(r) < 100][:300]


def test_txt_and_jsonl_give_the_same_documents_and_windows(tmp_path, texts, tiny_tokenizer):
    txt, jsonl = tmp_path / "c.txt", tmp_path / "c.jsonl"
    txt.write_text("\n\n".join(t.replace("\n\n", "\n") for t in texts) + "\n")
    records = [{"body": t.replace("\n\n", "\n"), "id": i} for i, t in enumerate(texts)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_documents(txt) == read_documents(jsonl, "body")
    a, protocol = calibration_windows(str(txt), tiny_tokenizer, 6, 128, seed=3)
    b, _ = calibration_windows(str(jsonl), tiny_tokenizer, 6, 128, seed=3, field="body")
    assert a.shape == (6, 128) and torch.equal(a, b)
    assert torch.equal(a, calibration_windows(str(txt), tiny_tokenizer, 6, 128, seed=3)[0])  # seeded
    assert not torch.equal(a, calibration_windows(str(txt), tiny_tokenizer, 6, 128, seed=4)[0])
    longest = max(len(tiny_tokenizer(t).input_ids) for t in texts)
    assert longest < 128 < protocol["tokens"]  # every document is shorter than a window: they were joined
    assert protocol["dataset"] == "file" and protocol["documents"] == len(texts) and protocol["file_sha256"]


def test_chat_template_formats_each_record(tmp_path, tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "chat.json"
    records = [{"messages": [{"role": "user", "content": "how are the weights stored"},
                             {"role": "assistant", "content": "as packed integer codes"}]}, "a plain record"] * 60
    path.write_text(json.dumps(records))
    from quantkit.data.calib_file import file_token_stream

    stream, protocol = file_token_stream(path, tok, chat=True)
    assert protocol["chat_template"] and protocol["documents"] == 120
    text = tok.decode(stream)
    assert "<|assistant|> as packed integer codes" in text and "<|user|> a plain record" in text
    assert calibration_windows(str(path), tok, 2, 32, chat=True)[0].shape == (2, 32)
    with pytest.raises(QuantkitError, match="holds conversations"):
        calibration_windows(str(path), tok, 2, 32)


def _quantize(*args):
    return CliRunner().invoke(main, ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "32",
                                     "--nsamples", "2", "--seqlen", "32", "--device", "cpu", *map(str, args)])


@pytest.mark.parametrize("name,content,message", [
    ("empty.txt", b"\n\n\n", "no documents in it"),
    ("latin1.txt", "caf\xe9 au lait\n".encode("latin-1"), "not UTF-8 text (byte 3"),
    ("fields.jsonl", b'{"content": "x"}\n', "no string field 'text' (set --calib-field)"),
    ("broken.jsonl", b'{"text": "x"\n', "broken.jsonl:1: not valid JSON"),
    ("tiny.txt", b"two words\n", "tokens; a window of --seqlen 32 needs more than 33"),
])
def test_bad_files_are_refused_in_one_line_with_nothing_written(tmp_path, tiny_llama_dir, name, content, message,
                                                                monkeypatch):
    path = tmp_path / name
    path.write_bytes(content)
    if name != "tiny.txt":  # the others are refused before the model loads; a file's token count needs the tokenizer
        import quantkit.pipeline as pipeline

        monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("model loaded before the refusal"))
    out = tmp_path / "out"
    result = _quantize("--model", tiny_llama_dir, "--calib", path, "--out", out)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_chat_without_a_template_and_unknown_sources(tmp_path, tiny_llama_dir, texts):
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(texts))
    result = _quantize("--model", tiny_llama_dir, "--calib", path, "--calib-chat", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "has no chat template" in result.output
    result = _quantize("--model", tiny_llama_dir, "--calib", "wiki103", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "neither one of c4, ptb, wikitext2 nor a .txt/.jsonl/.json file" in result.output


def test_quantize_from_a_jsonl_file_records_the_file(tmp_path, tiny_llama_dir, texts):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "q"
    result = _quantize("--model", tiny_llama_dir, "--calib", path, "--out", out)
    assert result.exit_code == 0, result.output
    calibration = json.loads((out / "quant_log.json").read_text())["calibration"]
    assert calibration["dataset"] == "file" and calibration["source"] == "file:calib.jsonl"
    assert calibration["documents"] == len(texts) and calibration["nsamples"] == 2
