"""Helpers for tests that need task data or a checkpoint with a task head (model/task_head.py): a tiny
checkpoint with a random head for any task kind (the server's /classify tests use it), and a small generated
task whose label is learnable."""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from model.checkpoint import save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.task_head import Task, add_task_tokens
from model.tokenizer import Tokenizer
from tests.helpers import write_byte_ranks

DEFAULT_LABELS = ("negative", "positive")


def write_task_checkpoint(path: str | Path, kind: str = "classification", labels: Sequence[str] = DEFAULT_LABELS,
                          seed: int = 0, block_size: int = 64) -> Path:
    """Write a tiny checkpoint WITH a random task head of `kind` into `path` (a directory, created or replaced).

    A 2-layer GPT (n_embd 32) with a byte-level tokenizer plus [Start]/[Delim]/[Extract], loadable with
    model.checkpoint.load_checkpoint (it generates) and model.task_head.load_task (labels `labels`, or the
    answer indices for multiple_choice). Deterministic in `seed`. Returns `path`.
    """
    path = Path(path)
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = write_byte_ranks(Path(tmp) / "bytes.tiktoken", [b"th", b"he", b" t", b"the"])
        tok = Tokenizer.from_ranks_file(ranks)
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32))
        tok = add_task_tokens(model, tok)
        task = Task.create(kind, labels, model.config.n_embd)
        save_checkpoint(path, model.eval(), tok, {"note": "tests/task_fixtures.py"}, tokenizer_file=ranks,
                        extra_files=task.files())
    return path


WORDS = ("apple bread cloud dance eagle fable grape hotel input joker kite lemon mango noble olive piano radio "
         "sugar tiger umbra violet water yellow zebra").split()


def word_task_lines(n: int, seed: int, word: str = "quiet") -> list[dict]:
    """Classification lines {"text", "label"}: random words; label "yes" when `word` is among them (half the
    time), else "no". The only word with a "q" is `word`, so one byte tells the label."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 8))
        has = i % 2 == 0
        if has:
            words.insert(rng.randrange(len(words) + 1), word)
        lines.append({"text": " ".join(words), "label": "yes" if has else "no"})
    rng.shuffle(lines)
    return lines


def write_jsonl(path: str | Path, lines: Sequence[dict | str]) -> Path:
    """One line per item: a dict as JSON, a str as written (a malformed line on purpose)."""
    path = Path(path)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def one_line_error(capsys, run: Callable[[], int]) -> str:
    """`run()` (a CLI's main) exits 2 with a single-line message on stderr and no traceback; that message."""
    capsys.readouterr()
    assert run() == 2
    out = capsys.readouterr().err.strip()
    assert "\n" not in out and "Traceback" not in out
    return out
