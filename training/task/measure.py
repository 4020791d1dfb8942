"""A task model's predictions and losses on labelled examples (the task loop's evaluations, python -m
training.task.evaluate)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch
import torch.nn.functional as F

from model.gpt import GPT
from model.task_head import TaskHead, make_batch, special_ids, task_logits
from model.tokenizer import Tokenizer
from training.task.data import TaskSet


@torch.no_grad()
def score_task_set(model: GPT, head: TaskHead, kind: str, tset: TaskSet, rows: np.ndarray, tokenizer: Tokenizer,
                   batch_size: int, device: torch.device,
                   autocast: Callable[[], AbstractContextManager] | None = None) -> dict[str, np.ndarray | float]:
    """The examples `rows` of tset in eval mode: "pred" (arg-max output per row), "loss" (summed task
    cross-entropy), "lm_loss" and "lm_tokens" (summed LM cross-entropy over the text tokens, and their count)."""
    special = special_ids(tokenizer)
    was = model.training, head.training
    model.eval()
    head.eval()
    preds, loss, lm_sum, lm_tokens = [], 0.0, 0.0, 0
    try:
        for b in range(0, len(rows), batch_size):
            idx = rows[b:b + batch_size]
            batch = make_batch([tset.encoded[i] for i in idx], special).to(device)
            with autocast() if autocast is not None else contextlib.nullcontext():
                logits, lm = task_logits(model, head, kind, batch, lm=True)
            y = torch.from_numpy(tset.labels[idx]).to(device)
            loss += F.cross_entropy(logits.float(), y, reduction="sum").item()
            n = int((batch.targets >= 0).sum())
            lm_sum += lm.item() * n
            lm_tokens += n
            preds.append(logits.argmax(-1).cpu().numpy())
    finally:
        model.train(was[0])
        head.train(was[1])
    return {"pred": np.concatenate(preds) if preds else np.zeros(0, np.int64), "loss": loss, "lm_loss": lm_sum,
            "lm_tokens": lm_tokens}
