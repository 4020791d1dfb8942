"""GPT-1's supervised fine-tuning (Radford et al. 2018, section 3.2-3.3): a linear head W_y over the final hidden
state (after the last LayerNorm) at the `[Extract]` token, and each task kind's input transformation.

    classification   [Start] text [Extract]                              → softmax over the labels
    entailment       [Start] premise [Delim] hypothesis [Extract]        → softmax over the labels
    similarity       [Start] a [Delim] b [Extract]  and  [Start] b [Delim] a [Extract]; the two [Extract]
                     states are added before the head                    → softmax over the labels
    multiple_choice  [Start] context [Delim] answer_i [Extract] for each answer → one score per answer,
                     softmax over the answers

`[Start]`, `[Delim]` and `[Extract]` are special tokens added to the tokenizer after its own ids, with new rows
of the (tied) embedding. A text longer than the context loses its beginning: the first text part is cut from the
left first (the premise, text_a, the context), then the second; the special tokens always stay.

A fine-tuned checkpoint is a normal one (model.checkpoint.load_checkpoint loads it, it generates; its
tokenizer.json lists the special tokens) plus two files beside it:

    task.json              {"format_version": 1, "kind": ..., "labels": [...], "special_tokens": [...], ...}
    task_head.safetensors  "weight" (n_out, n_embd) and "bias" (n_out); n_out = len(labels), or 1 for
                           multiple_choice (one score per answer)

`load_task(dir, model, device)` reads them back (None when the checkpoint has no task head);
`Task.predict(model, tokenizer, items)` gives label → probability for each item.

Items (their kinds and shapes): model/task_items.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from model.gpt import GPT, linear
from model.special_tokens import add_special_tokens
from model.task_items import KINDS, TaskError, check_kind, item_error, item_parts
from model.tokenizer import Tokenizer

START, DELIM, EXTRACT = "[Start]", "[Delim]", "[Extract]"
SPECIAL_TOKENS = (START, DELIM, EXTRACT)
TASK_FILE, HEAD_FILE = "task.json", "task_head.safetensors"
TASK_FORMAT_VERSION = 1


# --------------------------------------------------------------------------- #
# special tokens and token sequences
# --------------------------------------------------------------------------- #


def special_ids(tokenizer: Tokenizer) -> tuple[int, int, int]:
    """The ids of [Start], [Delim], [Extract] in this tokenizer."""
    special = tokenizer.special_tokens
    missing = [s for s in SPECIAL_TOKENS if s not in special]
    if missing:
        raise TaskError(f"the tokenizer lacks the task tokens {missing} (not a fine-tuned checkpoint's tokenizer)")
    return special[START], special[DELIM], special[EXTRACT]


@torch.no_grad()
def add_task_tokens(model: GPT, tokenizer: Tokenizer, generator: torch.Generator | None = None) -> Tokenizer:
    """The tokenizer with [Start], [Delim], [Extract] (new ids after its own), and the model's tied embedding
    grown to hold them (model/special_tokens.py: each new row the mean of the ordinary rows plus N(0, 0.02²))."""
    return add_special_tokens(model, tokenizer, SPECIAL_TOKENS, generator)


def _fit(parts: list[list[int]], budget: int) -> list[list[int]]:
    """Cut the parts to `budget` tokens in all: the first from the left, then the next."""
    over = sum(len(p) for p in parts) - budget
    out = []
    for p in parts:
        cut = min(max(over, 0), len(p))
        out.append(p[cut:])
        over -= cut
    return out


def encode_item(kind: str, tokenizer: Tokenizer, item: Any, block_size: int) -> list[list[int]]:
    """The token sequences of one item (1, or 2 for similarity, or one per answer), each ending in [Extract]
    and at most block_size long. Text is encoded with `<|endoftext|>` and the task tokens as plain text."""
    start, delim, extract = special_ids(tokenizer)
    parts = item_parts(kind, item)
    enc = lambda s: tokenizer.encode(s, allow_special=False)  # noqa: E731
    n_special = 2 if kind == "classification" else 3
    if block_size < n_special:
        raise TaskError(f"block_size {block_size} is too small for a {kind} input ({n_special} special tokens)")
    budget = block_size - n_special
    if kind == "classification":
        (text,) = _fit([enc(parts[0])], budget)
        return [[start, *text, extract]]
    if kind in ("entailment", "similarity"):
        a, b = _fit([enc(parts[0]), enc(parts[1])], budget)
        seqs = [[start, *a, delim, *b, extract]]
        if kind == "similarity":
            seqs.append([start, *b, delim, *a, extract])
        return seqs
    context, answers = parts
    ctx = enc(context)
    return [[start, *c, delim, *a, extract] for c, a in (_fit([ctx, enc(ans)], budget) for ans in answers)]


@dataclass
class TaskBatch:
    """Token sequences of several items, right-padded (causal attention: padding after [Extract] changes
    nothing before it)."""

    idx: torch.Tensor  # (N, T) token ids
    extract: torch.Tensor  # (N,) position of each sequence's [Extract]
    targets: torch.Tensor  # (N, T) next-token targets for the LM loss: text tokens only, else -1
    n_seqs: list[int]  # sequences per item, in order

    def to(self, device: torch.device | str) -> TaskBatch:
        return TaskBatch(self.idx.to(device), self.extract.to(device), self.targets.to(device), self.n_seqs)


def make_batch(encoded: Sequence[list[list[int]]], special: Sequence[int]) -> TaskBatch:
    """A batch of items' sequences (encode_item's output, one entry per item)."""
    seqs = [s for item in encoded for s in item]
    T = max(len(s) for s in seqs)
    idx = torch.zeros(len(seqs), T, dtype=torch.long)
    targets = torch.full((len(seqs), T), -1, dtype=torch.long)
    specials = torch.tensor(list(special))
    for i, s in enumerate(seqs):
        t = torch.tensor(s)
        idx[i, : len(s)] = t
        nxt = t[1:].clone()
        nxt[torch.isin(nxt, specials)] = -1  # the LM loss predicts text tokens only
        targets[i, : len(s) - 1] = nxt
    extract = torch.tensor([len(s) - 1 for s in seqs])
    return TaskBatch(idx, extract, targets, [len(item) for item in encoded])


# --------------------------------------------------------------------------- #
# the head
# --------------------------------------------------------------------------- #


class TaskHead(nn.Module):
    """W_y: dropout, then a linear map of the [Extract] state to the label logits (or one score)."""

    def __init__(self, n_embd: int, n_out: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_embd).normal_(0.0, 0.02))
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.drop(h.to(self.weight.dtype)), self.weight, self.bias)


def task_logits(gpt: GPT, head: TaskHead, kind: str, batch: TaskBatch,
                lm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, K) logits per item (labels, or answers with -inf past an item's last answer) and, with lm, the mean
    LM cross-entropy over the batch's text tokens (None without)."""
    h = gpt.hidden(batch.idx)  # (N, T, C)
    hx = h[torch.arange(h.size(0), device=h.device), batch.extract]  # (N, C): the [Extract] states
    if kind == "similarity":
        hx = hx.view(-1, 2, hx.size(-1)).sum(1)  # both orders, added
    scores = head(hx)
    if kind == "multiple_choice":
        flat = scores.squeeze(-1)
        k = max(batch.n_seqs)
        scores = flat.new_full((len(batch.n_seqs), k), float("-inf"))
        rows = torch.repeat_interleave(torch.arange(len(batch.n_seqs)), torch.tensor(batch.n_seqs))
        cols = torch.cat([torch.arange(n) for n in batch.n_seqs])
        scores[rows.to(h.device), cols.to(h.device)] = flat
    lm_loss = None
    if lm:
        if (batch.targets >= 0).any():
            logits = linear(h, gpt.lm_head)
            lm_loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), batch.targets.reshape(-1),
                                      ignore_index=-1)
        else:
            lm_loss = h.sum() * 0.0
    return scores, lm_loss


class TaskModel(nn.Module):
    """The GPT body and its task head as one module (one parameter list for the optimizer, one DDP wrapper)."""

    def __init__(self, gpt: GPT, head: TaskHead, kind: str) -> None:
        super().__init__()
        check_kind(kind)
        self.gpt, self.head, self.kind = gpt, head, kind

    def forward(self, batch: TaskBatch, lm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return task_logits(self.gpt, self.head, self.kind, batch, lm)


# --------------------------------------------------------------------------- #
# a task: kind, labels, head; predict; files
# --------------------------------------------------------------------------- #


@dataclass
class Task:
    kind: str
    labels: list[str]  # label names in the head's output order; [] for multiple_choice
    head: TaskHead
    info: dict[str, Any] = field(default_factory=dict)  # more of task.json (e.g. train_label_counts)

    @classmethod
    def create(cls, kind: str, labels: Sequence[str], n_embd: int, dropout: float = 0.0, **info: Any) -> Task:
        """A fresh task head (W_y ~ N(0, 0.02²), zero bias)."""
        check_kind(kind)
        labels = [] if kind == "multiple_choice" else list(labels)
        if kind != "multiple_choice" and (len(labels) < 2 or len(set(labels)) != len(labels)):
            raise TaskError(f"a {kind} task needs at least 2 distinct labels, got {labels}")
        return cls(kind, labels, TaskHead(n_embd, len(labels) or 1, dropout), dict(info))

    @property
    def n_outputs(self) -> int:
        return len(self.labels) or 1

    def validate_item(self, item: Any) -> str | None:
        """One line saying why `item` is not an input of this task (for a 422), or None when it is."""
        return item_error(self.kind, item)

    def output_names(self, n_scores: int) -> list[str]:
        """What predict's probabilities are keyed by: the labels, or the answer indices "0", "1", ..."""
        return self.labels if self.labels else [str(i) for i in range(n_scores)]

    @torch.no_grad()
    def predict(self, model: GPT, tokenizer: Tokenizer, items: Sequence[Any],
                batch_size: int = 16) -> list[dict[str, float]]:
        """Label (or answer index) → probability, for each item; TaskError names the first bad item."""
        for i, item in enumerate(items):
            err = self.validate_item(item)
            if err is not None:
                raise TaskError(f"item {i}: {err}")
        special = special_ids(tokenizer)
        if max(special) >= model.config.vocab_size:
            raise TaskError(f"the model has {model.config.vocab_size} embedding rows, too few for the task "
                            f"tokens {special}")
        device = next(model.parameters()).device
        was = model.training, self.head.training
        model.eval()
        self.head.eval()
        out: list[dict[str, float]] = []
        try:
            for b in range(0, len(items), batch_size):
                enc = [encode_item(self.kind, tokenizer, it, model.config.block_size) for it in items[b:b + batch_size]]
                batch = make_batch(enc, special).to(device)
                probs = torch.softmax(task_logits(model, self.head, self.kind, batch)[0].float(), -1).cpu()
                for row, n in zip(probs.tolist(), batch.n_seqs):
                    names = self.output_names(n)
                    out.append({name: p for name, p in zip(names, row)})
        finally:
            model.train(was[0])
            self.head.train(was[1])
        return out

    def files(self) -> dict[str, bytes]:
        """task.json and task_head.safetensors, for model.checkpoint.save_checkpoint(extra_files=...)."""
        meta = {"format_version": TASK_FORMAT_VERSION, "kind": self.kind, "labels": self.labels,
                "special_tokens": list(SPECIAL_TOKENS), **self.info}
        tensors = {"weight": self.head.weight.detach().float().cpu().contiguous(),
                   "bias": self.head.bias.detach().float().cpu().contiguous()}
        return {TASK_FILE: (json.dumps(meta, indent=2) + "\n").encode(), HEAD_FILE: save(tensors)}


def load_task(checkpoint_dir: str | Path, model: GPT, device: str | torch.device = "cpu") -> Task | None:
    """The task head of a checkpoint directory (on `device`, in eval mode), or None when it has none.
    A task file that is corrupt or does not fit `model` raises TaskError (a ValueError) naming the file."""
    path = Path(checkpoint_dir)
    task_file, head_file = path / TASK_FILE, path / HEAD_FILE
    if not task_file.is_file():
        if head_file.exists():
            raise TaskError(f"{task_file}: missing (the checkpoint has {HEAD_FILE} without it)")
        return None
    try:
        meta = json.loads(task_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise TaskError(f"{task_file}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise TaskError(f"{task_file}: expected a JSON object")
    kind, labels = meta.get("kind"), meta.get("labels")
    if kind not in KINDS:
        raise TaskError(f"{task_file}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise TaskError(f"{task_file}: labels must be a list of strings")
    if kind == "multiple_choice" and labels:
        raise TaskError(f"{task_file}: a multiple_choice task has no labels (its outputs are the answers)")
    if kind != "multiple_choice" and (len(labels) < 2 or len(set(labels)) != len(labels)):
        raise TaskError(f"{task_file}: a {kind} task needs at least 2 distinct labels, got {labels}")

    tok_file = path / "tokenizer.json"
    try:
        listed = json.loads(tok_file.read_text(encoding="utf-8")).get("special_tokens") or {}
    except (OSError, ValueError, AttributeError):
        listed = {}
    missing = [s for s in SPECIAL_TOKENS if s not in listed]
    if missing:
        raise TaskError(f"{tok_file}: the task needs the special tokens {missing}, which it does not list")
    too_big = {s: listed[s] for s in SPECIAL_TOKENS if not isinstance(listed[s], int)
               or not 0 <= listed[s] < model.config.vocab_size}
    if too_big:
        raise TaskError(f"{tok_file}: special token ids {too_big} are outside the model's "
                        f"{model.config.vocab_size} embedding rows")

    if not head_file.is_file():
        raise TaskError(f"{head_file}: missing file")
    try:
        state = load_file(str(head_file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise TaskError(f"{head_file}: truncated or corrupt safetensors file ({e})") from e
    n_out, n_embd = len(labels) or 1, model.config.n_embd
    want = {"weight": (n_out, n_embd), "bias": (n_out,)}
    if set(state) != set(want):
        raise TaskError(f"{head_file}: expected tensors {sorted(want)}, found {sorted(state)}")
    for k, shape in want.items():
        if tuple(state[k].shape) != shape:
            raise TaskError(f"{head_file}: {k} has shape {tuple(state[k].shape)}, expected {shape} "
                            f"({n_out} outputs for {task_file.name}'s {kind} task, n_embd {n_embd} of the model)")
        if not state[k].is_floating_point() or not torch.isfinite(state[k]).all():
            raise TaskError(f"{head_file}: {k} is not finite floating point")
    head = TaskHead(n_embd, n_out)
    head.load_state_dict({"weight": state["weight"].float(), "bias": state["bias"].float()})
    info = {k: v for k, v in meta.items() if k not in ("format_version", "kind", "labels", "special_tokens")}
    return Task(kind, labels, head.to(device).eval(), info)

