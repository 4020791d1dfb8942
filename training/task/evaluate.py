"""Accuracy of a fine-tuned checkpoint (training/finetune.py) on a labelled JSONL file, against the majority
baseline, with a confusion table.

Usage::

    python -m training.task.evaluate --checkpoint runs/speakers/best --input val.jsonl [--json]

The majority baseline always answers the training file's most frequent label (recorded in the checkpoint's
task.json; for a head without that record, the input file's own most frequent label). The confusion table's
rows are the true labels, its columns the predicted ones (answer indices for multiple choice).
Exit status: 0 on success, 2 on a user error (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from model.checkpoint import CheckpointError, load_checkpoint
from model.device import resolve_device
from model.task_head import TaskError, load_task
from model.tokenizer import TokenizerError
from training.task.data import (
    TaskDataError,
    encode_task_file,
    label_counts,
    majority_output,
    read_task_file,
)
from training.task.measure import score_task_set

PROG = "python -m training.task.evaluate"


def evaluate_task(checkpoint: str | Path, input_file: str | Path, batch_size: int = 16,
                  device: str = "cpu") -> dict[str, Any]:
    """Accuracy, majority baseline and confusion matrix of the checkpoint's task head on input_file."""
    try:
        dev = resolve_device(device)
    except ValueError as e:
        raise TaskError(f"--device: {e}") from None
    ck = load_checkpoint(checkpoint, device=dev)
    task = load_task(checkpoint, ck.model, dev)
    if task is None:
        raise TaskError(f"{checkpoint}: the checkpoint has no task head (task.json); fine-tune it with "
                        "python -m training.finetune first")
    f = read_task_file(input_file, task.kind)
    tset = encode_task_file(task.kind, f, task.labels, ck.tokenizer, ck.config.block_size)
    r = score_task_set(ck.model, task.head, task.kind, tset, np.arange(len(tset)), ck.tokenizer, batch_size, dev)
    pred, true = r["pred"], tset.labels
    counts = task.info.get("train_label_counts")
    source = "training file"
    if not counts:
        counts, source = label_counts(task.kind, f), "input file"
    majority = majority_output(task.labels, counts)
    names = task.labels or [str(i) for i in range(max(len(it["answers"]) for it in f.items))]
    confusion = np.zeros((len(names), len(names)), dtype=np.int64)
    np.add.at(confusion, (true, pred), 1)
    correct = int((pred == true).sum())
    return {"checkpoint": str(checkpoint), "input": str(input_file), "task": task.kind, "examples": len(true),
            "correct": correct, "accuracy": correct / len(true), "majority_label": names[majority],
            "majority_source": source, "majority_acc": float((true == majority).mean()),
            "task_loss": r["loss"] / len(true), "labels": names, "confusion": confusion.tolist()}


def format_report(res: dict[str, Any]) -> str:
    names, conf = res["labels"], res["confusion"]
    lines = [f"{res['task']} task of {res['checkpoint']} on {res['input']}: {res['examples']} examples",
             f"accuracy           {res['accuracy']:.4f} ({res['correct']}/{res['examples']})",
             f"majority baseline  {res['majority_acc']:.4f} (always {res['majority_label']!r}, the "
             f"{res['majority_source']}'s most frequent {'answer' if res['task'] == 'multiple_choice' else 'label'})",
             f"task loss          {res['task_loss']:.4f} nats per example",
             "", "confusion (rows: true, columns: predicted)"]
    width = max(5, *(len(n) for n in names), *(len(str(v)) for row in conf for v in row))
    lines.append(" " * (width + 2) + " ".join(n.rjust(width) for n in names) + "  " + "recall".rjust(7))
    for n, row in zip(names, conf):
        total = sum(row)
        recall = f"{row[names.index(n)] / total:.3f}" if total else "-"
        lines.append(n.rjust(width) + "  " + " ".join(str(v).rjust(width) for v in row) + "  " + recall.rjust(7))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Accuracy, the majority baseline and a confusion table of "
                                                       "a fine-tuned checkpoint's task head on a JSONL file.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint with task.json (e.g. OUT/best)")
    p.add_argument("--input", required=True, metavar="FILE.jsonl", help="labelled examples (training/finetune.py's "
                                                                        "format)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per forward pass (default 16)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.batch_size < 1:
            raise TaskError("--batch-size must be >= 1")
        res = evaluate_task(args.checkpoint, args.input, args.batch_size, args.device)
    except (CheckpointError, TaskError, TaskDataError, TokenizerError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res) if args.json else format_report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
