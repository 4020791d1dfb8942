"""training/shakespeare/tools.py: the tool-calling demonstration's data, in OpenAI's fine-tuning format, split by
position, read back by the chat data reader and its template (tools.jinja) keeping conversations short."""

from __future__ import annotations

import json

from model.chat_template import ChatTemplate
from training.chat.data import parse_conversation, parse_tools
from training.shakespeare.tools import TOOLS_TEMPLATE, build, main

TEXT = "".join(f"{name}:\nGood morrow to you, my gentle friend.\nAnd more.\n\n"
               for name in ["ROMEO", "JULIET", "NURSE"] * 12 + ["PROSPERO", "ARIEL", "PROSPERO"])  # the last: held out


def test_conversations_call_the_right_tool_and_split_by_position():
    data = build(TEXT, n_train=30, n_val=9)
    assert len(data["train"]) == 30 and len(data["val"]) == 9
    kinds = []
    for row in data["train"] + data["val"]:
        msgs = parse_conversation(row)
        assert parse_tools(row) == row["tools"]
        first = next(m for m in msgs if m.role == "assistant")
        kinds.append(first.tool_calls[0]["function"]["name"] if first.tool_calls else "text")
        if first.tool_calls and first.tool_calls[0]["function"]["name"] == "find_character":
            assert first.tool_calls[0]["function"]["arguments"]["name"] in msgs[0].content
    assert kinds[:3] == ["find_character", "find_speaker", "text"]
    held_out = {m["content"] for row in data["val"] for m in row["messages"] if m["role"] == "user"}
    assert any("PROSPERO" in p or "ARIEL" in p for p in held_out)  # the last 10% of the text
    assert not any("PROSPERO" in m["content"] for row in data["train"] for m in row["messages"]
                   if m["role"] == "user")


def test_the_template_lists_tools_in_one_line_and_keeps_hermes_calls():
    row = build(TEXT, n_train=3, n_val=1)["train"][0]
    t = ChatTemplate(TOOLS_TEMPLATE, "tools", eos_token="<|endoftext|>")
    text = t.render([m.as_dict() for m in parse_conversation(row)], add_generation_prompt=False, tools=row["tools"])
    assert text.startswith("<|system|>\nTools: find_character(name), find_speaker(words)<|endoftext|><|user|>\n")
    assert '<tool_call>{"name": "find_character", "arguments": {"name": ' in text and t.renders_tools


def test_cli_writes_the_files_and_refuses_a_text_without_speeches(tmp_path, capsys):
    src = tmp_path / "play.txt"
    src.write_text(TEXT)
    assert main(["--input", str(src), "--out", str(tmp_path / "o"), "--train", "6", "--val", "3"]) == 0
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["train"] == {"conversations": 6, "calls": 4}
    assert (tmp_path / "o" / "tools.jinja").read_text() == TOOLS_TEMPLATE
    src.write_text("no speeches here\n")
    assert main(["--input", str(src), "--out", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.strip().endswith("has no speeches (expected tinyshakespeare's NAME: lines)")
