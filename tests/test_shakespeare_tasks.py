"""training/shakespeare/tasks.py: speeches split by byte position, and the three tasks built from them."""

from __future__ import annotations

import json
import math

from model.task_items import item_error
from training.shakespeare.tasks import build_tasks, main, speeches

SPEAKERS = ["ANNE", "BEN", "CARL"]


def play(n: int = 60) -> str:
    return "\n\n".join(f"{SPEAKERS[i % 3]}:\nLine number {i} of the play.\nAnd more." for i in range(n)) + "\n"


def test_split_by_position():
    text = play()
    sp = speeches(text)
    cut = math.floor(len(text.encode()) * 0.9)
    assert len(sp["train"]) + len(sp["val"]) in (59, 60)  # the speech across the cut is dropped
    last_train = text.index(f"Line number {len(sp['train']) - 1} ")
    assert last_train < cut and text.index(sp["val"][0][1]) >= cut
    assert sp["train"][0] == ("ANNE", "Line number 0 of the play.\nAnd more.")


def test_tasks_are_well_formed_and_balanced(tmp_path):
    built = build_tasks(play(), n_speakers=2, min_speeches=1, seed=3)
    tasks = built["tasks"]
    assert built["speakers"] == ["ANNE", "BEN"]  # ties by name
    assert {x["label"] for x in tasks["speakers"]["train"]} == {"ANNE", "BEN"}
    assert all("ANNE:" not in x["text"] for x in tasks["speakers"]["train"])  # the text without its NAME line
    pairs = tasks["next_speech"]["train"]
    assert abs(sum(x["label"] == "next" for x in pairs) - len(pairs) / 2) <= 1
    for x in pairs:
        i = int(x["premise"].split("number ")[1].split()[0])
        j = int(x["hypothesis"].split("number ")[1].split()[0])
        assert (j == i + 1) == (x["label"] == "next") and (x["label"] == "next" or abs(j - i) >= 2)
    for x in tasks["next_of_four"]["val"]:
        assert item_error("multiple_choice", {k: x[k] for k in ("context", "answers")}) is None
        i = int(x["context"].split("number ")[1].split()[0])
        nums = [int(a.split("number ")[1].split()[0]) for a in x["answers"]]
        assert len(set(nums)) == 4 and nums[x["label"]] == i + 1
    assert build_tasks(play(), 2, 1, seed=3) == built  # deterministic

    src = tmp_path / "play.txt"
    src.write_text(play())
    assert main(["--input", str(src), "--out", str(tmp_path / "out"), "--speakers", "3", "--min-speeches", "1"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    n = summary["examples"]["next_of_four"]["train"]
    assert len((tmp_path / "out" / "next_of_four" / "train.jsonl").read_text().splitlines()) == n
    assert main(["--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
