"""training/task/evaluate.py: accuracy, the majority baseline and the confusion table of a checkpoint's task
head on a JSONL file, checked against Task.predict; and its one-line errors."""

from __future__ import annotations

import json

import pytest

from model.checkpoint import load_checkpoint, save_checkpoint
from model.task_head import load_task
from tests.helpers import tiny_model
from tests.task_fixtures import write_jsonl, write_task_checkpoint
from training.task.evaluate import evaluate_task, format_report, main

LINES = [{"text": t, "label": lab} for t, lab in [("the", "b"), ("theme", "a"), ("other", "b"), ("x y z", "c"),
                                                     ("then", "b"), ("hello", "a")]]


@pytest.fixture
def ck_dir(tmp_path):
    return write_task_checkpoint(tmp_path / "ck", "classification", ["a", "b", "c"], seed=4)


def test_accuracy_and_confusion_match_predict(tmp_path, ck_dir, capsys):
    data = write_jsonl(tmp_path / "v.jsonl", LINES)
    ck = load_checkpoint(ck_dir)
    probs = load_task(ck_dir, ck.model).predict(ck.model, ck.tokenizer, [x["text"] for x in LINES])
    pred = [max(p, key=p.get) for p in probs]
    res = evaluate_task(ck_dir, data)
    correct = sum(p == x["label"] for p, x in zip(pred, LINES))
    assert res["examples"] == 6 and res["correct"] == correct and res["accuracy"] == correct / 6
    assert res["labels"] == ["a", "b", "c"]
    for i, true in enumerate("abc"):
        for j, guess in enumerate("abc"):
            assert res["confusion"][i][j] == sum(x["label"] == true and p == guess for p, x in zip(pred, LINES))
    # the fixture's task.json has no training label counts: the majority is the input file's own ('b', 3 of 6)
    assert res["majority_label"] == "b" and res["majority_acc"] == 0.5 and res["majority_source"] == "input file"

    assert main(["--checkpoint", str(ck_dir), "--input", str(data)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == format_report(res)
    assert f"accuracy           {correct / 6:.4f} ({correct}/6)" in out
    assert "majority baseline  0.5000 (always 'b'" in out and "confusion (rows: true, columns: predicted)" in out
    rows = out.strip().splitlines()[-3:]
    assert [r.split()[0] for r in rows] == ["a", "b", "c"]
    assert [int(v) for v in rows[1].split()[1:4]] == res["confusion"][1]
    assert main(["--checkpoint", str(ck_dir), "--input", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(res))


def test_majority_comes_from_the_training_counts_when_recorded(tmp_path, ck_dir):
    meta = json.loads((ck_dir / "task.json").read_text())
    (ck_dir / "task.json").write_text(json.dumps({**meta, "train_label_counts": {"c": 10, "a": 2, "b": 1}}))
    res = evaluate_task(ck_dir, write_jsonl(tmp_path / "v.jsonl", LINES))
    assert res["majority_label"] == "c" and res["majority_acc"] == pytest.approx(1 / 6)
    assert res["majority_source"] == "training file"


def test_multiple_choice_confusion_is_over_answer_indices(tmp_path):
    ck_dir = write_task_checkpoint(tmp_path / "mc", "multiple_choice")
    lines = [{"context": "the", "answers": ["a", "b", "c"], "label": 2}, {"context": "x", "answers": ["y", "z"],
                                                                           "label": 0}]
    res = evaluate_task(ck_dir, write_jsonl(tmp_path / "v.jsonl", lines))
    assert res["labels"] == ["0", "1", "2"] and sum(map(sum, res["confusion"])) == 2
    assert sum(res["confusion"][2]) == 1 and sum(res["confusion"][0]) == 1


def test_errors_are_one_line(tmp_path, ck_dir, capsys, byte_tokenizer):
    def err(*args) -> str:
        capsys.readouterr()
        assert main(list(args)) == 2
        e = capsys.readouterr().err.strip()
        assert e.startswith("python -m training.task.evaluate: error: ") and "\n" not in e
        return e

    good = write_jsonl(tmp_path / "v.jsonl", LINES)
    plain = save_checkpoint(tmp_path / "plain", tiny_model(vocab_size=byte_tokenizer.vocab_size), byte_tokenizer,
                            tokenizer_file=tmp_path / "bytes.tiktoken")
    assert "has no task head" in err("--checkpoint", str(plain), "--input", str(good))
    assert "checkpoint directory not found" in err("--checkpoint", str(tmp_path / "nope"), "--input", str(good))
    bad = write_jsonl(tmp_path / "bad.jsonl", [*LINES, {"text": "a", "label": "d"}])
    assert f"{bad}:7: label 'd' is not one of the task's labels ['a', 'b', 'c']" in err(
        "--checkpoint", str(ck_dir), "--input", str(bad))
    assert "--device" in err("--checkpoint", str(ck_dir), "--input", str(good), "--device", "tpu")
