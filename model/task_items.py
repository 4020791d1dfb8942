"""A fine-tuned task's input items (model/task_head.py): their kinds, shapes and text parts, checked without torch —
the HTTP front checks /classify's items before the engine core sees them.

Items (what Task.predict takes; a JSONL line of training/finetune.py is the same plus its "label"):
    classification   "text"  or  {"text": "..."}
    entailment       ["premise", "hypothesis"]  or  {"premise", "hypothesis"}  or  {"text_a", "text_b"}
    similarity       the same shapes as entailment
    multiple_choice  {"context": "...", "answers": ["...", "...", ...]} (at least 2 answers); the probabilities
                     are keyed by the answer's index as a string: {"0": p0, "1": p1, ...}
"""

from __future__ import annotations

from typing import Any

KINDS = ("classification", "entailment", "similarity", "multiple_choice")
PAIR_KEYS = (("premise", "hypothesis"), ("text_a", "text_b"))


class TaskError(ValueError):
    """A task file that cannot be used, or an item of the wrong shape; the message names the file or the item."""


# --------------------------------------------------------------------------- #
# items: shapes and parts
# --------------------------------------------------------------------------- #


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise TaskError(f"unknown task kind {kind!r}; expected one of {', '.join(KINDS)}")


def _text_error(value: Any, name: str) -> str | None:
    return None if isinstance(value, str) else f"{name} must be a string, got {type(value).__name__}"


def item_error(kind: str, item: Any) -> str | None:
    """One line saying why `item` is not an input of a `kind` task, or None when it is."""
    check_kind(kind)
    if kind == "classification":
        if isinstance(item, dict):
            extra = sorted(set(item) - {"text"})
            if extra or "text" not in item:
                return f'expected {{"text": ...}} or a string, got keys {sorted(item)}'
            return _text_error(item["text"], "text")
        return None if isinstance(item, str) else f"expected a string, got {type(item).__name__}"
    if kind in ("entailment", "similarity"):
        names = "premise/hypothesis" if kind == "entailment" else "text_a/text_b"
        if isinstance(item, list | tuple):
            if len(item) != 2:
                return f"expected a pair of strings, got a list of {len(item)}"
            return _text_error(item[0], "the first text") or _text_error(item[1], "the second text")
        if isinstance(item, dict):
            for keys in PAIR_KEYS:
                if set(item) == set(keys):
                    return _text_error(item[keys[0]], keys[0]) or _text_error(item[keys[1]], keys[1])
            return (f'expected {{"premise", "hypothesis"}} or {{"text_a", "text_b"}} ({names}), '
                    f"got keys {sorted(item)}")
        return f"expected a pair of strings or an object with {names}, got {type(item).__name__}"
    # multiple choice
    if not isinstance(item, dict):
        return f'expected {{"context": ..., "answers": [...]}}, got {type(item).__name__}'
    if set(item) != {"context", "answers"}:
        return f'expected {{"context": ..., "answers": [...]}}, got keys {sorted(item)}'
    if not isinstance(item["answers"], list) or len(item["answers"]) < 2:
        return "answers must be a list of at least 2 strings"
    for i, a in enumerate(item["answers"]):
        if not isinstance(a, str):
            return f"answers[{i}] must be a string, got {type(a).__name__}"
    return _text_error(item["context"], "context")


def item_parts(kind: str, item: Any) -> tuple[str, ...] | tuple[str, list[str]]:
    """The texts of a valid item: (text,), (first, second) or (context, answers)."""
    err = item_error(kind, item)
    if err is not None:
        raise TaskError(err)
    if kind == "classification":
        return (item["text"] if isinstance(item, dict) else item,)
    if kind in ("entailment", "similarity"):
        if isinstance(item, dict):
            keys = next(k for k in PAIR_KEYS if k[0] in item)
            return item[keys[0]], item[keys[1]]
        return item[0], item[1]
    return item["context"], list(item["answers"])
