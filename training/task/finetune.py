"""Supervised task fine-tuning, `python -m training.finetune --task KIND` (GPT-1, section 3.2): the run's model
(the pre-trained body, the task tokens, a new or resumed head), tokenizer and data, handed to training/task/loop.py's
FinetuneLoop."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from model.task_head import Task, TaskModel, add_task_tokens, load_task
from training.build_model import init_model, resume_model
from training.checkpoints import LAST, seed_or_restore_rngs
from training.config import FinetuneConfig
from training.distributed import setup_distributed
from training.errors import TrainError
from training.loop import setup_precision
from training.optim import make_optimizer
from training.task.data import encode_task_file, label_counts, label_names, majority_output, read_task_file
from training.task.loop import FinetuneLoop


def run_task(args: argparse.Namespace, cfg: FinetuneConfig, state: dict[str, Any] | None, kind: str) -> TaskModel:
    """Fine-tune on labelled examples of `kind`; returns the trained body and head (this rank's copy, unwrapped)."""
    out = Path(args.out)
    train_file, val_file = read_task_file(args.train, kind), read_task_file(args.val, kind)
    if state is not None:
        for f, key in ((train_file, "train_sha256"), (val_file, "val_sha256")):
            if state["run_meta"].get(key) != f.sha256:
                raise TrainError(f"--resume: {f.path} differs from the file the run started with (sha256)")

    d, device = setup_distributed(cfg.device)
    try:
        use_bf16 = setup_precision(cfg, device)
        torch.manual_seed(cfg.seed)
        if state is None:
            gpt, cfg, ck = init_model(cfg, args.init_from)
            tokenizer = add_task_tokens(gpt, ck.tokenizer)
            names = label_names(kind, train_file)
            task = Task.create(kind, names, gpt.config.n_embd, dropout=cfg.dropout,
                               train_label_counts=label_counts(kind, train_file))
            run_meta = {"init_from": str(args.init_from), "task": kind, "labels": names,
                        "train": str(train_file.path), "val": str(val_file.path),
                        "train_sha256": train_file.sha256, "val_sha256": val_file.sha256}
        else:
            gpt, ck = resume_model(out / LAST, cfg)
            tokenizer, run_meta = ck.tokenizer, state["run_meta"]
            names = run_meta["labels"]
            saved = load_task(out / LAST, gpt)
            if saved is None:
                raise TrainError(f"--resume: {out / LAST} has no task head")
            task = Task.create(kind, names, gpt.config.n_embd, dropout=cfg.dropout, **saved.info)
            task.head.load_state_dict(saved.head.state_dict())
        spec_file = tokenizer.spec.get("file")
        tokenizer_file = ck.path / spec_file if spec_file else None
        del ck
        train = encode_task_file(kind, train_file, names, tokenizer, cfg.block_size)
        val = encode_task_file(kind, val_file, names, tokenizer, cfg.block_size)
        majority = majority_output(names, task.info.get("train_label_counts") or label_counts(kind, train_file))
        model = TaskModel(gpt, task.head, kind).to(device)
        optimizer = make_optimizer(model, cfg, device)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
        seed_or_restore_rngs(state, cfg.seed, d.rank)
        return FinetuneLoop(cfg, task, train, val, majority, tokenizer, tokenizer_file, out, model, optimizer, d,
                            device, use_bf16, state, run_meta, args.quiet).run()
    finally:
        d.close()

