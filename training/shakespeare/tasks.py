"""Labelled tasks derived from tinyshakespeare, for the fine-tuning demonstration in docs/training.md.

Usage::

    python -m training.shakespeare.tasks --input ../shared/data/tinyshakespeare.txt --out /tmp/shakespeare_tasks

The text is a sequence of speeches, `NAME:\\n<lines>` separated by blank lines. The split is by position, as
for checkpoints/shakespeare (whose tokenizer and weights saw only the first 90% of the bytes): a speech that
ends before byte floor(0.9 · size) is training data, one that starts at or after it is validation data (the
one speech across the cut is dropped); pairs never cross the cut. Writes OUT/<task>/{train,val}.jsonl
(training/task/data.py's formats) and OUT/summary.json:

    speakers      classification: who says this speech (the text without its NAME line), among the
                  --speakers speakers with the most training speeches of those that have at least
                  --min-speeches speeches in each split (the cut falls inside The Taming of the Shrew, so
                  these are its characters)
    next_speech   entailment: premise = a speech, hypothesis = the speech right after it ("next") or a random
                  other speech of the same split at least 2 speeches away ("random"), half and half; speeches
                  with their NAME line
    next_of_four  multiple_choice: context = a speech, answers = the speech right after it and 3 random other
                  speeches of the same split (as above), in random order; label = the index of the true one
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PROG = "python -m training.shakespeare.tasks"
SPEECH = re.compile(r"(?:^|\n\n)([^\n:]+):\n(.*?)(?=\n\n|\Z)", re.S)


def speeches(text: str, val_fraction: float = 0.1) -> dict[str, list[tuple[str, str]]]:
    """{"train": [(speaker, speech), ...], "val": [...]} in text order, split by byte position."""
    data = text.encode("utf-8")
    cut = math.floor(len(data) * (1 - val_fraction))
    out: dict[str, list[tuple[str, str]]] = {"train": [], "val": []}
    for m in SPEECH.finditer(text):
        start = len(text[: m.start(1)].encode("utf-8"))
        end = start + len(m.group(0).lstrip("\n").encode("utf-8"))
        if end <= cut:
            out["train"].append((m.group(1), m.group(2)))
        elif start >= cut:
            out["val"].append((m.group(1), m.group(2)))
    return out


def others(rng: random.Random, n: int, i: int, k: int) -> list[int]:
    """k distinct indices of [0, n) at least 2 away from i (neither i nor its successor nor its predecessor)."""
    picked: set[int] = set()
    while len(picked) < k:
        j = rng.randrange(n)
        if abs(j - i) >= 2:
            picked.add(j)
    return sorted(picked)


def build_tasks(text: str, n_speakers: int = 5, min_speeches: int = 20, seed: int = 0) -> dict[str, Any]:
    sp = speeches(text)
    counts = {s: Counter(name for name, _ in sp[s]) for s in sp}
    eligible = [n for n in counts["train"] if counts["train"][n] >= min_speeches and counts["val"][n] >= min_speeches]
    speakers = sorted(eligible, key=lambda n: (-counts["train"][n], n))[:n_speakers]
    if len(speakers) < 2:
        raise ValueError(f"fewer than 2 speakers have {min_speeches} speeches in each split")
    tasks: dict[str, dict[str, list[dict]]] = {"speakers": {}, "next_speech": {}, "next_of_four": {}}
    for split, rows in sp.items():
        rng = random.Random(f"{seed}-{split}")
        tasks["speakers"][split] = [{"text": body, "label": name} for name, body in rows if name in speakers]
        full = [f"{name}:\n{body}" for name, body in rows]
        pairs, choices = [], []
        for i in range(len(full) - 1):
            if i % 2 == 0:  # alternate: exactly half "next" (up to one)
                pairs.append({"premise": full[i], "hypothesis": full[i + 1], "label": "next"})
            else:
                pairs.append({"premise": full[i], "hypothesis": full[others(rng, len(full), i, 1)[0]],
                              "label": "random"})
            answers = [full[i + 1]] + [full[j] for j in others(rng, len(full), i, 3)]
            order = list(range(4))
            rng.shuffle(order)
            choices.append({"context": full[i], "answers": [answers[o] for o in order], "label": order.index(0)})
        rng.shuffle(pairs)
        tasks["next_speech"][split] = pairs
        tasks["next_of_four"][split] = choices
    return {"tasks": tasks, "speakers": speakers,
            "speaker_counts": {s: {n: counts[s][n] for n in speakers} for s in sp},
            "speeches": {s: len(sp[s]) for s in sp}}


def builder_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The demonstration builders' command line (tasks, chat, tools): --input tinyshakespeare.txt, --out DIR."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--input", required=True, help="tinyshakespeare.txt")
    p.add_argument("--out", required=True, help="output directory")
    return p


def main(argv: list[str] | None = None) -> int:
    p = builder_parser(PROG, "Build the speaker, next-speech and next-of-four tasks "
                             "from tinyshakespeare (split by position: 90% / 10%).")
    p.add_argument("--speakers", type=int, default=5, help="number of speakers to attribute (default 5)")
    p.add_argument("--min-speeches", type=int, default=20, help="speeches a speaker needs in each split (20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the negatives and answer orders (default 0)")
    args = p.parse_args(argv)
    try:
        text = Path(args.input).read_text(encoding="utf-8")
        built = build_tasks(text, args.speakers, args.min_speeches, args.seed)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    summary: dict[str, Any] = {k: v for k, v in built.items() if k != "tasks"}
    for task, splits in built["tasks"].items():
        (out / task).mkdir(parents=True, exist_ok=True)
        for split, lines in splits.items():
            (out / task / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines),
                                                       encoding="utf-8")
            summary.setdefault("examples", {}).setdefault(task, {})[split] = len(lines)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
