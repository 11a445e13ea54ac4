"""lm-evaluation-harness on a quantkit artifact, offline: a local multiple-choice task over a local data
file, scored through `quantkit eval tasks`; its accuracy equals a direct computation with the model quantkit
loads (single-token answers: the answer whose token is likelier after the question)."""

import json

import pytest
import torch

pytest.importorskip("lm_eval")

QUESTIONS = ["the cat sat on the", "rain fell on the old", "a ship sailed to the", "he opened the door of the",
             "the river ran past the", "we walked along the", "the song was about a", "she wrote a letter to the",
             "in the morning the", "the city was built on the", "they found a map of the", "the king ruled the"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-task")
    docs = [{"question": q, "choices": ["A", "B"], "answer": i % 2} for i, q in enumerate(QUESTIONS)]
    (root / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "quantkit_local_mc.yaml").write_text(f"""task: quantkit_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "data.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return root, docs


@pytest.fixture(scope="module")
def artifact(tiny_llama_dir, tmp_path_factory):
    from quantkit.pipeline import quantize_checkpoint

    out = tmp_path_factory.mktemp("tasks") / "rtn"
    quantize_checkpoint(str(tiny_llama_dir), out, "rtn", {"bits": 4, "group_size": 32}, nsamples=0, device="cpu",
                        progress=False, checkpoint=False)
    return out


def _direct_accuracy(model, tokenizer, docs):
    """Sum log-likelihood of each single-token answer after the question, as lm-eval scores choices."""
    correct = 0
    for doc in docs:
        context = tokenizer(doc["question"], add_special_tokens=False).input_ids
        scores = []
        for choice in doc["choices"]:
            whole = tokenizer(doc["question"] + " " + choice, add_special_tokens=False).input_ids
            assert whole[: len(context)] == context and len(whole) == len(context) + 1  # one answer token
            with torch.no_grad():
                logits = model(torch.tensor([context])).logits[0, -1].float()
            scores.append(torch.log_softmax(logits, -1)[whole[-1]].item())
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    return correct / len(docs)


def test_eval_tasks_cli_matches_a_direct_computation(task_dir, artifact, tmp_path):
    from click.testing import CliRunner

    import quantkit
    from quantkit.cli import main
    from quantkit.models import load_tokenizer, resolve_source

    root, docs = task_dir
    out = tmp_path / "tasks.json"
    result = CliRunner().invoke(main, ["eval", "tasks", "--model", str(artifact), "--tasks", "quantkit_local_mc",
                                       "--include-path", str(root), "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    row = json.loads(out.read_text())["results"][0]
    acc = row["tasks"]["quantkit_local_mc"]["acc"]
    assert row["n_samples"]["quantkit_local_mc"] == len(docs) and "acc" in result.stdout
    model = quantkit.load(artifact, device="cpu", dtype=torch.float32)
    assert acc == pytest.approx(_direct_accuracy(model, load_tokenizer(resolve_source(str(artifact))), docs), abs=1e-12)


def test_unknown_task_is_one_line(task_dir, artifact):
    from click.testing import CliRunner

    from quantkit.cli import main

    result = CliRunner().invoke(main, ["eval", "tasks", "--model", str(artifact), "--tasks", "no_such_task",
                                       "--include-path", str(task_dir[0]), "--device", "cpu"])
    assert result.exit_code == 2 and "unknown lm-eval task 'no_such_task'" in result.output
