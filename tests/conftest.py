"""Shared fixtures: tiny llama/OPT models built from configs (no download), a tiny BPE tokenizer
trained on WikiText-2 test text, the shared data directory, and the real SmolLM2 model."""

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()

if "QUANTKIT_DATA" not in os.environ and SHARED_DATA.is_dir():
    os.environ["QUANTKIT_DATA"] = str(SHARED_DATA)


@pytest.fixture(scope="session")
def data_dir():
    path = Path(os.environ.get("QUANTKIT_DATA", SHARED_DATA))
    if not (path / "wikitext2").is_dir():
        pytest.skip(f"evaluation texts not found at {path} (set QUANTKIT_DATA)")
    return path


@pytest.fixture(scope="module")
def small_data(data_dir, tmp_path_factory):
    """The first 3000 PTB train sentences: calibration windows without tokenizing all of PTB each run."""
    root = tmp_path_factory.mktemp("data")
    (root / "ptb").mkdir()
    lines = (data_dir / "ptb" / "ptb.train.txt").read_text().splitlines(keepends=True)[:3000]
    (root / "ptb" / "ptb.train.txt").write_text("".join(lines))
    return root


@pytest.fixture(scope="session")
def tiny_tokenizer(data_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = [json.loads(line)["text"] for line in open(data_dir / "wikitext2" / "wikitext-2-raw-v1.test.rows.jsonl")]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(rows[:400], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, rope_theta=100000.0)
    return _save(LlamaForCausalLM(config).eval(), tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(1)
    config = OPTConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, ffn_dim=160, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64)
    return _save(OPTForCausalLM(config).eval(), tiny_tokenizer, tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture(scope="session")
def smollm2_path():
    from quantkit import settings

    path = settings.default_model_path()
    if not path.is_file():
        pytest.skip("SmolLM2 not fetched (run `quantkit fetch-model`; `make test` does)")
    return path


@pytest.fixture
def run_interpreted():
    """run_interpreted(code) -> the JSON its last printed line holds: `code` runs in a fresh process under
    Triton's interpreter (Triton picks interpreted or compiled kernels when it is imported, and another
    test may have imported it already), with tests/ and the repository first on sys.path as `{paths}`."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    here = Path(__file__).parent

    def run(code):
        done = subprocess.run([sys.executable, "-c", code.format(paths=[str(here), str(here.parent)])],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
