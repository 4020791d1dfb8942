"""training/shakespeare_chat.py: dialogues from consecutive speeches of different speakers, split by position."""

from __future__ import annotations

import json

from training.shakespeare_chat import build, main
from training.shakespeare_chat import dialogues as make_dialogues

SPEECHES = [("ROMEO", "But soft!\nWhat light?"), ("JULIET", "Ay me!"), ("JULIET", "O Romeo."),
            ("ROMEO", "Shall I hear more?"), ("NURSE", "x" * 50)]


def test_consecutive_speeches_of_different_speakers_become_conversations():
    out = make_dialogues(SPEECHES, max_chars=40)
    # (JULIET, JULIET) is one speaker; the NURSE's speech is too long; the first speech is only context
    assert [[m["content"] for m in c["messages"][1:]] for c in out] == [["O Romeo.", "Shall I hear more?"]]
    assert out[0]["messages"][0] == {"role": "system", "content": "You are ROMEO, answering JULIET. Before, "
                                                                  "JULIET said: Ay me!"}


def test_split_by_position_and_cli(tmp_path):
    text = "\n\n".join(f"{'AB'[i % 2]}:\nline {i}" for i in range(40)) + "\n"
    built = build(text)
    assert len(built["train"]) > len(built["val"]) > 0
    src = tmp_path / "t.txt"
    src.write_text(text)
    assert main(["--input", str(src), "--out", str(tmp_path / "o")]) == 0
    lines = (tmp_path / "o" / "val.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == built["val"]
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["conversations"]["val"] == len(lines)
