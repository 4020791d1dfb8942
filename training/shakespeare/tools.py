"""Tool-calling conversations derived from tinyshakespeare, for the tool-calling fine-tune in docs/training.md.

Usage::

    python -m training.shakespeare.tools --input ../shared/data/tinyshakespeare.txt --out /tmp/shtools

Two functions, in OpenAI's fine-tuning format (`tools` on every line): `find_character(name)` ("Who is ROMEO?")
and `find_speaker(words)` ('Who says "the words"?'); and prompts that want text, not a call ("Speak as ROMEO."),
answered with the first line of one of the character's speeches. Half the character look-ups go on to the tool's
result (how many speeches the character has) and a reply that reads it. Names are the play's speaker names as
written (ROMEO, KING RICHARD III); words are the first 3-7 words of a line of a speech.

Split by position as checkpoints/shakespeare: conversations from the first 90% of the bytes are training data,
the last 10% held out (their names and words come from held-out text; some names appear in both parts).
Writes OUT/train.jsonl, OUT/val.jsonl (both with the calls), OUT/summary.json and OUT/tools.jinja
(TOOLS_TEMPLATE: the calls in the default template's Hermes form, the tools listed compactly).
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from model.chat_template import SFT_TEMPLATE
from training.shakespeare.tasks import builder_parser, speeches

PROG = "python -m training.shakespeare.tools"
# OUT/tools.jinja, for `--chat-template`: the default SFT template, but the tools listed as `name(arguments)` in one
# line: their JSON schemas alone are 287 tokens of the bundled model's 2,048-token vocabulary, its context 256
COMPACT_TOOLS = (
    "{%- if tools -%}{{ '<|system|>\\nTools: ' }}"
    "{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}"
    "{{ (', ' if not loop.first else '') ~ f.name ~ '(' ~ ((f.parameters or {}).properties or {}) | list | join(', ')"
    " ~ ')' }}{%- endfor -%}{{ eos_token }}{%- endif -%}"
)
TOOLS_TEMPLATE = COMPACT_TOOLS + SFT_TEMPLATE[SFT_TEMPLATE.index("{%- for m in messages -%}"):]
TOOLS = [
    {"type": "function", "function": {"name": "find_character", "description": "look up a character",
                                      "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                     "required": ["name"]}}},
    {"type": "function", "function": {"name": "find_speaker", "description": "who speaks these words",
                                      "parameters": {"type": "object", "properties": {"words": {"type": "string"}},
                                                     "required": ["words"]}}},
]
ASK_CHARACTER = ["Who is {}?", "Tell me about {}.", "Look up {}.", "What do we know of {}?"]
ASK_SPEAKER = ['Who says "{}"?', 'Find the speaker of "{}".', 'Whose words are "{}"?']
ASK_TEXT = ["Speak as {}.", "Give me a line of {}.", "Say something, {}."]


def call(name: str, arguments: dict, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def first_line(speech: str) -> str:
    return speech.strip().splitlines()[0].strip()


def conversations(rows: list[tuple[str, str]], n: int, seed: int) -> list[dict[str, Any]]:
    """n conversations from (speaker, speech) rows: a third each of character look-ups, speaker look-ups and
    text requests."""
    rng = random.Random(seed)
    counts = Counter(s for s, _ in rows)
    lines = [(s, first_line(t)) for s, t in rows if 3 <= len(first_line(t).split()) and len(first_line(t)) <= 80]
    out: list[dict[str, Any]] = []
    for i in range(n if lines else 0):
        speaker, line = rng.choice(lines)
        kind = i % 3
        if kind == 0:
            messages = [{"role": "user", "content": rng.choice(ASK_CHARACTER).format(speaker)},
                        call("find_character", {"name": speaker}, i)]
            if rng.random() < 0.5:
                messages += [{"role": "tool", "tool_call_id": f"call_{i}", "content": f"{speaker}: "
                                                                                     f"{counts[speaker]} speeches"},
                             {"role": "assistant", "content": f"{speaker} has {counts[speaker]} speeches."}]
        elif kind == 1:
            words = " ".join(line.strip(".,;:!?'\"-").split()[: rng.randint(3, 7)]).strip(".,;:!?'\"-")
            messages = [{"role": "user", "content": rng.choice(ASK_SPEAKER).format(words)},
                        call("find_speaker", {"words": words}, i)]
        else:
            messages = [{"role": "user", "content": rng.choice(ASK_TEXT).format(speaker)},
                        {"role": "assistant", "content": line}]
        out.append({"tools": TOOLS, "parallel_tool_calls": False, "messages": messages})
    return out


def build(text: str, n_train: int = 3000, n_val: int = 300, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    parts = speeches(text)
    return {"train": conversations(parts["train"], n_train, seed),
            "val": conversations(parts["val"], n_val, seed + 1)}


def main(argv: list[str] | None = None) -> int:
    p = builder_parser(PROG, "Build tool-calling fine-tuning conversations from "
                             "tinyshakespeare (OpenAI's format, with tools and tool_calls)")
    p.add_argument("--train", type=int, default=3000, help="training conversations (3000)")
    p.add_argument("--val", type=int, default=300, help="held-out conversations (300)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        text = Path(args.input).read_text(encoding="utf-8")
    except OSError as e:
        print(f"{PROG}: error: cannot read {args.input}: {e.strerror or e}", file=sys.stderr)
        return 2
    data = build(text, args.train, args.val, args.seed)
    if not data["train"] or not data["val"]:
        print(f"{PROG}: error: {args.input} has no speeches (expected tinyshakespeare's NAME: lines)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in data.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    summary = {split: {"conversations": len(rows), "calls": sum(1 for r in rows for m in r["messages"]
                                                                 if m.get("tool_calls"))}
               for split, rows in data.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "tools.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
