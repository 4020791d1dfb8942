"""training/task/bow_baseline.py: the bag-of-words logistic regression learns word-level tasks of each kind."""

from __future__ import annotations

import json

from tests.task_fixtures import word_task_lines, write_jsonl
from training.task.bow_baseline import main, run
from training.task.data import read_task_file


def test_classification_by_a_word(tmp_path):
    tr = write_jsonl(tmp_path / "tr.jsonl", word_task_lines(200, seed=1))
    va = write_jsonl(tmp_path / "va.jsonl", word_task_lines(60, seed=2))
    res = run("classification", read_task_file(tr, "classification"), read_task_file(va, "classification"),
              l2s=(1e-4, 1e-2), steps=60)
    assert res["val_acc"] == 1.0 and res["majority_acc"] == 0.5 and res["l2"] in (1e-4, 1e-3, 1e-2)


def test_pairs_and_choices_use_shared_words(tmp_path, capsys):
    words = "apple bread cloud dance eagle fable grape hotel".split()
    pairs, choices = [], []
    for i in range(40):
        a, b, c = words[i % 8], words[(i + 3) % 8], words[(i + 5) % 8]
        pairs.append({"premise": f"{a} {b}", "hypothesis": f"{a} x" if i % 2 else f"{c} y",
                      "label": "shared" if i % 2 else "none"})
        choices.append({"context": f"{a} {b}", "answers": [f"{c} z", f"{b} z", f"{c} w"], "label": 1})
    for kind, lines in (("entailment", pairs), ("similarity", [{"text_a": x["premise"], "text_b": x["hypothesis"],
                                                                  "label": x["label"]} for x in pairs]),
                        ("multiple_choice", choices)):
        f = write_jsonl(tmp_path / f"{kind}.jsonl", lines)
        args = ["--task", kind, "--train", str(f), "--val", str(f), "--steps", "60", "--l2", "1e-3", "--json"]
        assert main(args) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["val_acc"] >= 0.95, (kind, res)
