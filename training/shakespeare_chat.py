"""Dialogues derived from tinyshakespeare, for the chat fine-tuning demonstration in docs/training.md.

Usage::

    python -m training.shakespeare_chat --input ../shared/data/tinyshakespeare.txt --out /tmp/shakespeare_chat

Two consecutive speeches by different speakers are one conversation in OpenAI's fine-tuning format: the first
speech is the user's turn, the reply the assistant's, and the system message gives the scene — who answers
whom and the first line of the speech before (the play's context, kept short):

    {"messages": [{"role": "system", "content": "You are GREMIO, answering BAPTISTA. Before, TRANIO said: ..."},
                  {"role": "user", "content": "<BAPTISTA's speech>"},
                  {"role": "assistant", "content": "<GREMIO's reply>"}]}

The split is by position, as for checkpoints/shakespeare and training/shakespeare_tasks.py (whose speech parser
this shares): dialogues from the first 90% of the bytes are training data, those of the last 10% held out.
Speeches longer than --max-chars are left out (the conversations stay well inside the 256-token context).
Writes OUT/train.jsonl, OUT/val.jsonl and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from training.shakespeare_tasks import speeches

PROG = "python -m training.shakespeare_chat"


def dialogues(rows: list[tuple[str, str]], max_chars: int) -> list[dict[str, Any]]:
    """Conversations from consecutive speeches (speaker, text) of one split, in text order."""
    out = []
    for i in range(1, len(rows) - 1):
        (who, said), (answerer, reply) = rows[i], rows[i + 1]
        if who == answerer or len(said) > max_chars or len(reply) > max_chars:
            continue
        prev_who, prev = rows[i - 1]
        system = f"You are {answerer}, answering {who}. Before, {prev_who} said: {prev.splitlines()[0]}"
        out.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": said},
                                 {"role": "assistant", "content": reply}]})
    return out


def build(text: str, max_chars: int = 400) -> dict[str, list[dict[str, Any]]]:
    return {split: dialogues(rows, max_chars) for split, rows in speeches(text).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="Build chat fine-tuning dialogues from tinyshakespeare "
                                                       "(split by position: 90% / 10%).")
    p.add_argument("--input", required=True, help="tinyshakespeare.txt")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-chars", type=int, default=400, help="leave out speeches longer than this (400)")
    args = p.parse_args(argv)
    try:
        built = build(Path(args.input).read_text(encoding="utf-8"), args.max_chars)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for split, lines in built.items():
            (out / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
        summary = {"conversations": {s: len(v) for s, v in built.items()}, "max_chars": args.max_chars}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    except (OSError, UnicodeDecodeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
