"""training/shakespeare/chat.py: dialogues from consecutive speeches of different speakers, split by position,
the play before the user's speech as system context within a character budget."""

from __future__ import annotations

import json

from model.chat_template import end_of_turn, load_chat_template, template_special_tokens
from model.tokenizer import EOT, Tokenizer
from tests.helpers import write_byte_ranks
from training.chat.encoding import ChatEncoder, Message
from training.shakespeare.chat import PLAY_TEMPLATE, build, context, main
from training.shakespeare.chat import dialogues as make_dialogues

SPEECHES = [("ROMEO", "But soft!\nWhat light?"), ("JULIET", "Ay me!"), ("JULIET", "O Romeo."),
            ("ROMEO", "Shall I hear more?"), ("NURSE", "x" * 50)]


def test_consecutive_speeches_of_different_speakers_become_conversations():
    out = make_dialogues(SPEECHES, max_chars=40, budget=1000)
    # (JULIET, JULIET) is one speaker; the NURSE's speech is too long; the first speech is only context
    assert [[m["content"] for m in c["messages"][1:]] for c in out] == [["O Romeo.", "Shall I hear more?"]]
    # the system names who answers whom, then the play before the user's speech in its own form
    assert out[0]["messages"][0] == {"role": "system", "content": "You are ROMEO, answering JULIET.\n\n"
                                                                  "ROMEO:\nBut soft!\nWhat light?\n\nJULIET:\nAy me!"}


def test_context_fits_the_budget_whole_speeches_then_last_lines():
    rows = [("A", "one\ntwo\nthree"), ("B", "four"), ("C", "now")]
    assert context(rows, 2, 100) == "A:\none\ntwo\nthree\n\nB:\nfour"
    assert context(rows, 2, len("B:\nfour")) == "B:\nfour"
    # A's speech does not fit whole: its last lines that do, never a part of a line
    assert context(rows, 2, len("A:\ntwo\nthree\n\nB:\nfour")) == "A:\ntwo\nthree\n\nB:\nfour"
    assert context(rows, 2, len("A:\ntwo\nthree\n\nB:\nfour") - 1) == "A:\nthree\n\nB:\nfour"
    assert context(rows, 2, 5) == "" and context(rows, 0, 100) == ""
    for budget in range(0, 40):
        assert len(context(rows, 2, budget)) <= budget


def test_system_user_and_reply_stay_within_the_budget():
    rows = [(f"P{i % 3}", f"speech {i}\n" + "y" * (i % 7 * 9)) for i in range(60)]
    for budget in (60, 200, 480):
        out = make_dialogues(rows, max_chars=400, budget=budget)
        assert len(out) == 58  # the budget shortens the context, never drops a turn
        for c in out:
            sys_, user, reply = (m["content"] for m in c["messages"])
            head = sys_.split("\n\n")[0]
            assert head.startswith("You are ")
            if sys_ != head:  # with any context, the three texts fit the budget
                assert len(sys_) + len(user) + len(reply) <= budget
        # the speech right before the user's closes the context whenever any of it fits
        c = out[-1]["messages"]
        if budget >= 200:
            assert c[0]["content"].endswith(rows[-3][1])


def test_split_by_position_and_cli(tmp_path):
    text = "\n\n".join(f"{'AB'[i % 2]}:\nline {i}" for i in range(40)) + "\n"
    built = build(text)
    assert len(built["train"]) > len(built["val"]) > 0
    # the held-out dialogues' context comes from the held-out text only
    first = built["val"][0]["messages"]
    assert first[0]["content"].split("\n\n")[1:] == [f"{'AB'[k % 2]}:\nline {k}" for k in range(36, 37)]
    src = tmp_path / "t.txt"
    src.write_text(text)
    assert main(["--input", str(src), "--out", str(tmp_path / "o")]) == 0
    lines = (tmp_path / "o" / "val.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == built["val"]
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["conversations"]["val"] == len(lines)


def test_train_max_chars_adds_training_turns_only(tmp_path):
    text = "\n\n".join(f"{'AB'[i % 2]}:\n" + ("long " * 12 if i % 5 == 0 else f"line {i}") for i in range(80)) + "\n"
    short, more = build(text, max_chars=40), build(text, max_chars=40, train_max_chars=100)
    assert more["val"] == short["val"]
    assert len(more["train"]) > len(short["train"])
    assert any(len(c["messages"][2]["content"]) > 40 for c in more["train"])
    src = tmp_path / "t.txt"
    src.write_text(text)
    assert main(["--input", str(src), "--out", str(tmp_path / "o"), "--max-chars", "40",
                 "--train-max-chars", "100"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["conversations"] == {"train": len(more["train"]), "val": len(more["val"])}
    assert summary["train_max_chars"] == 100 and summary["max_chars"] == 40


def test_play_template_keeps_the_plays_layout_and_splits_at_the_reply(tmp_path):
    text = "\n\n".join(f"{'AB'[i % 2]}:\nline {i}" for i in range(40)) + "\n"
    src = tmp_path / "t.txt"
    src.write_text(text)
    assert main(["--input", str(src), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "play.jinja").read_text() == PLAY_TEMPLATE
    template = load_chat_template(tmp_path, EOT, tmp_path / "o" / "play.jinja")
    msgs = [Message("system", "You are B, answering A.\n\nB:\nline 1"), Message("user", " line 2\n"),
            Message("assistant", "line 3")]
    tok = Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "b.tiktoken", [b"li", b"ne"]))
    tok = tok.with_special_tokens(template_special_tokens(template))
    assert template_special_tokens(template) == ["<|user|>", "<|assistant|>", EOT]
    assert end_of_turn(template, list(tok.special_tokens)) == EOT  # the reply's stop token
    assert ChatEncoder(template, tok).segments(msgs) == [
        ("You are B, answering A.\n\nB:\nline 1\n\n<|user|>:\nline 2\n\n<|assistant|>:\n", False),
        ("line 3" + EOT, True)]
    ids, learn = ChatEncoder(template, tok).encode(msgs)
    assert ids == tok.encode_chat("".join(t for t, _ in ChatEncoder(template, tok).segments(msgs)))
    assert tok.decode([i for i, f in zip(ids, learn) if f]) == "line 3" + EOT
