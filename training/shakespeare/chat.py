"""Dialogues derived from tinyshakespeare, for the chat fine-tuning demonstration in docs/training.md.

Usage::

    python -m training.shakespeare.chat --input ../shared/data/tinyshakespeare.txt --out /tmp/shakespeare_chat

Two consecutive speeches by different speakers are one conversation in OpenAI's fine-tuning format: the first
speech is the user's turn, the reply the assistant's, and the system message gives the scene — who answers
whom, then the play before the user's speech in the play's own form (`NAME:` line, speech, blank line), the
form the base model was trained on:

    {"messages": [{"role": "system", "content": "You are GREMIO, answering BAPTISTA.\n\nTRANIO:\n...\n\n"
                                                "BAPTISTA:\n..."},
                  {"role": "user", "content": "<BAPTISTA's speech>"},
                  {"role": "assistant", "content": "<GREMIO's reply>"}]}

The context is as many whole speeches back from the user's as keep the system, user and assistant texts within
--budget characters (480; then the last whole lines of the speech that does not fit whole), so a conversation
stays inside the 256-token context: this text has ~2.8 characters per token, and at 480 one held-out
conversation of 823 (8 of 5,217 training ones) is still longer than 256 tokens, as its two speeches alone are.
The context never crosses the split: a held-out dialogue's context is held-out text.

The split is by position, as for checkpoints/shakespeare and training/shakespeare/tasks.py (whose speech parser
this shares): dialogues from the first 90% of the bytes are training data, those of the last 10% held out.
Speeches longer than --max-chars are left out as turns (they may still be context).
Writes OUT/train.jsonl, OUT/val.jsonl, OUT/summary.json and OUT/play.jinja (PLAY_TEMPLATE).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from training.shakespeare.tasks import builder_parser, speeches

PROG = "python -m training.shakespeare.chat"
# OUT/play.jinja, a chat template for `--chat-template` that keeps the base model's own layout: the system text
# (the play so far) and a blank line, then each turn as a speech whose speaker is a role token, `<|user|>:` or
# `<|assistant|>:` in place of `NAME:`; a user's speech ends in a blank line as in the play, an assistant's in
# <|endoftext|> (the stop token). The boundary before a reply is ":\n" then text, split by GPT-2's
# pre-tokenization, so the served prompt's tokens plus the reply's are the whole conversation's.
PLAY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role in ('system', 'developer') -%}{{ (m.content | trim) ~ '\\n\\n' }}"
    "{%- elif m.role == 'user' -%}{{ '<|user|>:\\n' ~ (m.content | trim) ~ '\\n\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|assistant|>:\\n' ~ (m.content | trim) ~ eos_token }}"
    "{%- else -%}{{ raise_exception('unknown role ' ~ m.role ~ ' (expected system, user or assistant)') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>:\\n' }}{%- endif -%}\n"
)
BUDGET = 480  # characters of system + user + assistant text (~2.8 characters per token): see the docstring


def context(rows: list[tuple[str, str]], i: int, budget: int) -> str:
    """The play before speech i in its own form (`NAME:\nspeech`, blank lines between), at most `budget`
    characters: whole speeches back from i - 1, then the last whole lines of the one that does not fit."""
    parts: list[str] = []
    used = 0
    for who, said in reversed(rows[:i]):
        block = f"{who}:\n{said}"
        sep = 2 if parts else 0
        if used + sep + len(block) <= budget:
            parts.append(block)
            used += sep + len(block)
            continue
        lines = said.splitlines()
        while lines and used + sep + len(who) + 2 + len("\n".join(lines)) > budget:
            lines.pop(0)
        if lines:
            parts.append(f"{who}:\n" + "\n".join(lines))
        break
    return "\n\n".join(reversed(parts))


def dialogues(rows: list[tuple[str, str]], max_chars: int, budget: int = BUDGET) -> list[dict[str, Any]]:
    """Conversations from consecutive speeches (speaker, text) of one split, in text order. The system message
    says who answers whom, then gives as much of the play before the user's speech as keeps the system, user
    and assistant texts within `budget` characters (the 256-token context; see the module docstring)."""
    out = []
    for i in range(1, len(rows) - 1):
        (who, said), (answerer, reply) = rows[i], rows[i + 1]
        if who == answerer or len(said) > max_chars or len(reply) > max_chars:
            continue
        system = f"You are {answerer}, answering {who}."
        before = context(rows, i, budget - len(system) - len(said) - len(reply) - 2)
        if before:
            system += "\n\n" + before
        out.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": said},
                                 {"role": "assistant", "content": reply}]})
    return out


def build(text: str, max_chars: int = 400, budget: int = BUDGET,
          train_max_chars: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """train_max_chars: the longest speech of a training turn (default max_chars); the held-out turns keep
    max_chars, so a larger value adds training dialogues without changing the held-out set."""
    limit = {"train": max_chars if train_max_chars is None else train_max_chars, "val": max_chars}
    return {split: dialogues(rows, limit[split], budget) for split, rows in speeches(text).items()}


def main(argv: list[str] | None = None) -> int:
    p = builder_parser(PROG, "Build chat fine-tuning dialogues from tinyshakespeare "
                             "(split by position: 90% / 10%).")
    p.add_argument("--max-chars", type=int, default=400, help="leave out speeches longer than this (400)")
    p.add_argument("--budget", type=int, default=BUDGET,
                   help=f"characters of system + user + assistant text; the system's play context fills it ({BUDGET})")
    p.add_argument("--train-max-chars", type=int, default=None,
                   help="the same for training turns only (default --max-chars); the held-out turns keep --max-chars")
    args = p.parse_args(argv)
    try:
        built = build(Path(args.input).read_text(encoding="utf-8"), args.max_chars, args.budget,
                      args.train_max_chars)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for split, lines in built.items():
            (out / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
        (out / "play.jinja").write_text(PLAY_TEMPLATE, encoding="utf-8")
        train_max = args.max_chars if args.train_max_chars is None else args.train_max_chars
        summary = {"conversations": {s: len(v) for s, v in built.items()}, "max_chars": args.max_chars,
                   "train_max_chars": train_max, "budget": args.budget}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    except (OSError, UnicodeDecodeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
