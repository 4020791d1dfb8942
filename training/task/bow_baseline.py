"""A bag-of-words logistic regression on a task's JSONL files (training/task/data.py's formats): the baseline the
fine-tuned GPT is compared with in docs/training.md.

Usage::

    python -m training.task.bow_baseline --task classification --train train.jsonl --val val.jsonl [--json]

Words are lower-cased `\\w+('\\w+)?` runs; the vocabulary is the training file's words seen at least --min-count
times (at most --max-vocab, the most frequent). Binary features per example:

    classification   bow(text)
    entailment       [bow(premise), bow(hypothesis), bow(premise) ⊙ bow(hypothesis)]   (words in both)
    similarity       [bow(a) + bow(b), bow(a) ⊙ bow(b)]                                (order-free)
    multiple_choice  per answer [bow(answer), bow(context) ⊙ bow(answer)] → one score; softmax over the answers

Softmax regression (multinomial; a conditional logit for multiple choice), full-batch Adam, with an L2 penalty
chosen among --l2 by accuracy on a random 10% of the training file (held out, then refit on all of it): the
validation file is used only for the reported accuracy. Deterministic (CPU, fixed seed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from model.task_items import KINDS, item_parts
from training.task.data import (
    TaskDataError,
    TaskFile,
    label_counts,
    label_indices,
    label_names,
    majority_output,
    read_task_file,
)

PROG = "python -m training.task.bow_baseline"
WORD = re.compile(r"\w+(?:'\w+)?")


def words(text: str) -> set[str]:
    return set(WORD.findall(text.lower()))


def texts_of(kind: str, f: TaskFile) -> list[tuple]:
    return [item_parts(kind, it) for it in f.items]


def build_vocab(kind: str, parts: list[tuple], min_count: int, max_vocab: int) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for p in parts:
        texts = [p[0], *p[1]] if kind == "multiple_choice" else list(p)
        for t in texts:
            counts.update(words(t))
    common = [w for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_count]
    return {w: i for i, w in enumerate(common[:max_vocab])}


def features(kind: str, parts: list[tuple], vocab: dict[str, int]) -> tuple[torch.Tensor, list[int]]:
    """A sparse (rows, dim) binary matrix, and the number of rows per example (answers for multiple choice)."""
    V = len(vocab)
    ids = lambda t: {vocab[w] for w in words(t) if w in vocab}  # noqa: E731
    rows, cols, per = [], [], []
    r = 0

    def add(cs: set[int]) -> None:
        nonlocal r
        rows.extend([r] * len(cs))
        cols.extend(sorted(cs))
        r += 1

    for p in parts:
        if kind == "classification":
            add(ids(p[0]))
            per.append(1)
        elif kind == "entailment":
            a, b = ids(p[0]), ids(p[1])
            add(a | {V + i for i in b} | {2 * V + i for i in a & b})
            per.append(1)
        elif kind == "similarity":
            a, b = ids(p[0]), ids(p[1])
            add(a | b | {V + i for i in a & b})
            per.append(1)
        else:
            c = ids(p[0])
            for ans in p[1]:
                a = ids(ans)
                add(a | {V + i for i in c & a})
            per.append(len(p[1]))
    dim = {"classification": V, "entailment": 3 * V, "similarity": 2 * V, "multiple_choice": 2 * V}[kind]
    idx = torch.tensor([rows, cols], dtype=torch.long)
    x = torch.sparse_coo_tensor(idx, torch.ones(len(rows)), (r, dim), check_invariants=True).coalesce()
    return x, per


def scores(kind: str, x: torch.Tensor, per: list[int], w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    s = torch.sparse.mm(x, w) + b
    if kind != "multiple_choice":
        return s
    flat = s.squeeze(-1)
    out = flat.new_full((len(per), max(per)), float("-inf"))
    rows = torch.repeat_interleave(torch.arange(len(per)), torch.tensor(per))
    cols = torch.cat([torch.arange(n) for n in per])
    out[rows, cols] = flat
    return out


def fit(kind: str, x: torch.Tensor, per: list[int], y: torch.Tensor, n_out: int, l2: float, steps: int,
        seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(x.size(1), n_out, generator=g) * 0.01).requires_grad_()
    b = torch.zeros(n_out, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(scores(kind, x, per, w, b), y) + l2 * (w * w).sum()
        loss.backward()
        opt.step()
    return w.detach(), b.detach()


def accuracy(kind: str, x, per, y, w, b) -> float:
    with torch.no_grad():
        return (scores(kind, x, per, w, b).argmax(-1) == y).float().mean().item()


def run(kind: str, train: TaskFile, val: TaskFile, min_count: int = 2, max_vocab: int = 5000,
        l2s: tuple[float, ...] = (1e-4, 1e-3, 1e-2), steps: int = 300, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    names = label_names(kind, train)
    y_tr = torch.from_numpy(label_indices(kind, train, names))
    y_va = torch.from_numpy(label_indices(kind, val, names))
    p_tr, p_va = texts_of(kind, train), texts_of(kind, val)
    n_out = 1 if kind == "multiple_choice" else len(names)
    # choose the L2 weight on a random 10% of the training file (random, not the last 10%: the pair tasks'
    # negatives come from anywhere in the file, so a region held out by position would be skewed)
    perm = torch.randperm(len(p_tr), generator=torch.Generator().manual_seed(seed))
    n_held = max(1, len(p_tr) // 10)
    held_i, fit_i = sorted(perm[:n_held].tolist()), sorted(perm[n_held:].tolist())
    vocab = build_vocab(kind, [p_tr[i] for i in fit_i], min_count, max_vocab)
    xa, pa = features(kind, [p_tr[i] for i in fit_i], vocab)
    xh, ph = features(kind, [p_tr[i] for i in held_i], vocab)
    held = {l2: accuracy(kind, xh, ph, y_tr[held_i], *fit(kind, xa, pa, y_tr[fit_i], n_out, l2, steps, seed))
            for l2 in l2s}
    best_l2 = max(l2s, key=lambda v: (held[v], -v))
    vocab = build_vocab(kind, p_tr, min_count, max_vocab)
    xt, pt = features(kind, p_tr, vocab)
    xv, pv = features(kind, p_va, vocab)
    w, b = fit(kind, xt, pt, y_tr, n_out, best_l2, steps, seed)
    majority = majority_output(names, label_counts(kind, train))
    return {"task": kind, "train": str(train.path), "val": str(val.path), "train_examples": len(p_tr),
            "val_examples": len(p_va), "vocab": len(vocab), "features": xt.size(1), "l2": best_l2,
            "held_out_acc": held, "train_acc": accuracy(kind, xt, pt, y_tr, w, b),
            "val_acc": accuracy(kind, xv, pv, y_va, w, b),
            "majority_acc": float((y_va.numpy() == majority).mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="Bag-of-words logistic regression baseline for a task's "
                                                       "JSONL files: prints its validation accuracy.")
    p.add_argument("--task", required=True, choices=KINDS)
    p.add_argument("--train", required=True, metavar="FILE.jsonl")
    p.add_argument("--val", required=True, metavar="FILE.jsonl")
    p.add_argument("--min-count", type=int, default=2, help="minimum training count of a word (default 2)")
    p.add_argument("--max-vocab", type=int, default=5000, help="vocabulary size cap (default 5000)")
    p.add_argument("--steps", type=int, default=300, help="full-batch Adam steps (default 300)")
    p.add_argument("--l2", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2],
                   help="L2 weights to choose from on a held-out random 10%% of the training file "
                        "(default 1e-4 1e-3 1e-2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        train, val = read_task_file(args.train, args.task), read_task_file(args.val, args.task)
        res = run(args.task, train, val, args.min_count, args.max_vocab, tuple(args.l2), args.steps, args.seed)
    except TaskDataError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['task']}: bag-of-words logistic regression, {res['vocab']} words ({res['features']} features), "
              f"L2 {res['l2']:g} (held-out accuracy {json.dumps(res['held_out_acc'])})\n"
              f"train accuracy {res['train_acc']:.4f} on {res['train_examples']} examples\n"
              f"val accuracy   {res['val_acc']:.4f} on {res['val_examples']} examples "
              f"(majority baseline {res['majority_acc']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
