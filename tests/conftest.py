"""Shared fixtures: tiny llama/OPT checkpoints (tests/factories.py), a tiny BPE tokenizer trained on
WikiText-2 test text, the shared data directory, the real SmolLM2 model, and `requires`: the one place
that checks, builds or loads what a test needs of the machine (a GPU, Triton, a compiled extension, a
toolchain) and skips naming what is missing."""

import json
import os
from pathlib import Path

import pytest

from factories import save_tiny, tiny_causal_lm
from machine import GPU_REQUIREMENTS, REQUIREMENTS, require

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()

if "QUANTKIT_DATA" not in os.environ and SHARED_DATA.is_dir():
    os.environ["QUANTKIT_DATA"] = str(SHARED_DATA)
# Tests never reach the Hub: where `datasets` is installed (lm-eval brings it), a missing local text must
# fail at once, not after network time-outs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    model = tiny_causal_lm("llama", vocab=len(tiny_tokenizer), max_positions=256, tie_word_embeddings=True,
                           rope_theta=100000.0, seed=0)
    return save_tiny(model, tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory, tiny_tokenizer):
    model = tiny_causal_lm("opt", vocab=len(tiny_tokenizer), max_positions=256, seed=1)
    return save_tiny(model, tiny_tokenizer, tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture(scope="session")
def smollm2_path():
    from quantkit import settings

    path = settings.default_model_path()
    if not path.is_file():
        pytest.skip("SmolLM2 not fetched (run `quantkit fetch-model`; `make test` does)")
    return path


@pytest.fixture
def run_interpreted(requires):
    """run_interpreted(code) -> the JSON its last printed line holds: `code` runs in a fresh process under
    Triton's interpreter (Triton picks interpreted or compiled kernels when it is imported, and another
    test may have imported it already), with tests/ and the repository first on sys.path as `{paths}`."""
    requires("triton")
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


# ---- what a test needs of the machine ------------------------------------------------------------------
# One vocabulary for every test (tests/machine.py): the `requires` fixture, requires(what) -> the thing, and
# the marker @pytest.mark.requires(what, ...), which checks before any fixture is set up. Either skips,
# naming what is missing and why. A marker that names a GPU requirement also marks the test `gpu`.

@pytest.fixture(scope="session")
def requires():
    """requires(what) -> the thing, built or loaded once, or the test (or the fixture asking) is skipped.
    `what` is one of machine.REQUIREMENTS: "cuda", "no_cuda", "sm90", "triton", "nvcc", "g++", "cuda_headers",
    or an extension's name ("lutgemm", "gptq", "anyprec" on CUDA; "anyprec_cpu" on the CPU)."""
    return require


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(*what): skip unless the machine has each of `what` "
                                       "(the names of tests/machine.py REQUIREMENTS)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        named = {what for mark in item.iter_markers("requires") for what in mark.args}
        unknown = named - set(REQUIREMENTS)
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: unknown requirement(s) {sorted(unknown)}")
        if named & GPU_REQUIREMENTS and not item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("requires"):
        for what in mark.args:
            require(what)


@pytest.fixture
def loader_never_called(monkeypatch):
    """The tokenizer and weight loaders of the quantize job fail the test if they are reached."""
    import quantkit.pipeline as pipeline

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(pipeline, "load_tokenizer", never)
    monkeypatch.setattr(pipeline, "load_model", never)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny
    matrices run far faster so on a shared CPU, and subprocesses started with OMP_NUM_THREADS=1 then do
    their arithmetic the same way as the test process."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
