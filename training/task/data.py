"""Labelled task data for supervised fine-tuning (training/finetune.py, training/task/evaluate.py): JSONL files,
their checks, label names and the majority baseline.

One JSON object per line (blank lines are skipped); labels by name, except multiple choice:

    classification   {"text": "...", "label": "NAME"}
    entailment       {"premise": "...", "hypothesis": "...", "label": "NAME"}
    similarity       {"text_a": "...", "text_b": "...", "label": "NAME"}
    multiple_choice  {"context": "...", "answers": ["...", "...", ...], "label": INDEX}   (0-based)

Every problem is one line naming FILE:LINE (TaskDataError).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.task_head import encode_item
from model.task_items import item_error
from model.tokenizer import Tokenizer
from training.jsonl import parse_line

LABEL = "label"


class TaskDataError(ValueError):
    """A bad task file; the message names FILE:LINE and the problem (shown without a traceback)."""


@dataclass
class TaskFile:
    path: Path
    items: list[Any]  # the inputs (each line without its label)
    raw_labels: list[str | int]  # label names, or answer indices for multiple choice
    lines: list[int]  # 1-based line number of each example
    sha256: str

    def __len__(self) -> int:
        return len(self.items)


def read_task_file(path: str | Path, kind: str) -> TaskFile:
    """Read and check a JSONL task file of `kind`."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"{path}: no such file")
    raw = path.read_bytes()
    items, labels, lines = [], [], []
    for n, line_bytes in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{n}"
        obj = parse_line(line_bytes, where, TaskDataError)
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise TaskDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if LABEL not in obj:
            raise TaskDataError(f'{where}: missing "label"')
        label = obj.pop(LABEL)
        err = item_error(kind, obj)
        if err is not None:
            raise TaskDataError(f"{where}: {err} (a {kind} line)")
        if kind == "multiple_choice":
            if type(label) is not int or not 0 <= label < len(obj["answers"]):
                raise TaskDataError(f"{where}: label must be the index of the right answer, an integer in "
                                    f"[0, {len(obj['answers'])}), got {label!r}")
        elif not isinstance(label, str) or not label:
            raise TaskDataError(f"{where}: label must be a non-empty string (a label name), got {label!r}")
        items.append(obj)
        labels.append(label)
        lines.append(n)
    if not items:
        raise TaskDataError(f"{path}: no examples (expected one JSON object per line)")
    return TaskFile(path, items, labels, lines, hashlib.sha256(raw).hexdigest())


def label_names(kind: str, train: TaskFile) -> list[str]:
    """The task's label names (sorted), from its training file; [] for multiple choice."""
    if kind == "multiple_choice":
        return []
    names = sorted(set(train.raw_labels))
    if len(names) < 2:
        raise TaskDataError(f"{train.path}: needs at least 2 different labels, found {names}")
    return names


def label_indices(kind: str, f: TaskFile, names: list[str]) -> np.ndarray:
    """Each example's label as an output index (the answer index for multiple choice)."""
    if kind == "multiple_choice":
        return np.asarray(f.raw_labels, dtype=np.int64)
    pos = {name: i for i, name in enumerate(names)}
    for label, line in zip(f.raw_labels, f.lines):
        if label not in pos:
            raise TaskDataError(f"{f.path}:{line}: label {label!r} is not one of the task's labels {names}")
    return np.asarray([pos[x] for x in f.raw_labels], dtype=np.int64)


def label_counts(kind: str, f: TaskFile) -> dict[str, int]:
    """How often each label (or answer index) is the answer, most frequent first (ties by name)."""
    counts = Counter(str(x) for x in f.raw_labels)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def majority_output(names: list[str], train_counts: dict[str, int]) -> int:
    """The output index the majority baseline always predicts: the training file's most frequent label."""
    top = next(iter(train_counts))
    return names.index(top) if names else int(top)


@dataclass
class TaskSet:
    """A task file encoded for a model: token sequences (model.task_head.encode_item) and label indices."""

    file: TaskFile
    encoded: list[list[list[int]]]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for item in self.encoded for s in item)


def encode_task_file(kind: str, f: TaskFile, names: list[str], tokenizer: Tokenizer, block_size: int) -> TaskSet:
    return TaskSet(f, [encode_item(kind, tokenizer, it, block_size) for it in f.items],
                   label_indices(kind, f, names))
