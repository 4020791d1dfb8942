"""Supervised task fine-tuning of a pre-trained GPT (GPT-1, section 3.2): a linear head W_y on the [Extract]
state and L = L_task + λ·L_LM, the language-modelling loss on the same sequences' text tokens kept as an
auxiliary objective (λ = --lm-weight, the config's lm_weight). `--task chat` is chat supervised fine-tuning
instead (training/chat_finetune.py): conversations in OpenAI's fine-tuning format, rendered with a chat
template, the loss on the assistant's tokens only.

Usage::

    python -m training.finetune --init-from checkpoints/shakespeare --task classification \\
        --train train.jsonl --val val.jsonl --out runs/speakers [--lm-weight 0.5] [--config FILE] [--set k=v]
    python -m training.finetune ... --out runs/speakers --resume        # continue OUT/last exactly
    python -m training.finetune --init-from checkpoints/shakespeare --task chat --train chats.jsonl \
        --val val.jsonl --out runs/chat [--chat-template FILE.jinja]

The task kinds, their input encodings and the head are model/task_head.py; the JSONL formats
training/task_data.py. Adds the special tokens [Start] [Delim] [Extract] to the tokenizer, with new embedding
rows. Writes OUT/last (with training_state.pt for --resume) and OUT/best (best validation accuracy; ties: lower
validation task loss), each a normal checkpoint plus task.json and task_head.safetensors; OUT/metrics.jsonl
and OUT/loss.png (and with --tensorboard, OUT/tensorboard). Every evaluation reports the validation accuracy
against the majority baseline (always the training file's most frequent label).

Shares the trainer's pieces (training/loop.py's BaseLoop, optim.py, checkpoints.py, metrics.py,
build_model.py, distributed.py); the loop itself is training/finetune_loop.py. Resume is exact: training
batches are a pure function of (seed, rank, step, micro-step) (training.task_data.ExampleSampler) and the
RNG states are saved with the optimizer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import CheckpointError
from model.gpt import GPT
from model.task_head import KINDS, Task, TaskError, TaskModel, add_task_tokens, load_task
from model.tokenizer import TokenizerError
from training.build_model import init_model, resume_model
from training.chat_data import ChatDataError
from training.chat_finetune import CHAT, run_chat
from training.checkpoints import LAST, load_resume, seed_or_restore_rngs
from training.config import ConfigError, FinetuneConfig, build_config
from training.distributed import setup_distributed
from training.errors import TrainError
from training.finetune_loop import PROG, FinetuneLoop
from training.loop import setup_precision
from training.metrics import summary_writer_class
from training.optim import make_optimizer
from training.task_data import (
    TaskDataError,
    encode_task_file,
    label_counts,
    label_names,
    majority_output,
    read_task_file,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Fine-tune a GPT checkpoint on a labelled task (GPT-1): a linear head on the [Extract] "
                    "token, loss L_task + λ·L_LM. Config precedence: defaults < --config file < --set overrides "
                    "< --lm-weight (with --resume, the saved config replaces the defaults).",
        epilog="Config keys (with defaults): "
               + ", ".join(f"{k}={json.dumps(v)}" for k, v in FinetuneConfig().to_dict().items())
               + ". JSONL lines: classification {\"text\", \"label\"}; entailment {\"premise\", \"hypothesis\", "
               "\"label\"}; similarity {\"text_a\", \"text_b\", \"label\"}; multiple_choice {\"context\", "
               "\"answers\": [...], \"label\": index}; chat {\"messages\": [{\"role\", \"content\", \"weight\"}, "
               "...]} or {\"prompt\", \"completion\"}. Exit status: 0 on success, 2 on a user error, 130 when "
               "interrupted.")
    p.add_argument("--task", choices=(*KINDS, CHAT), help="the task kind (required unless --resume); chat: "
                                                          "conversations, loss on the assistant's tokens")
    p.add_argument("--train", required=True, metavar="FILE.jsonl", help="training examples")
    p.add_argument("--val", required=True, metavar="FILE.jsonl", help="validation examples")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory for checkpoints and logs")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--init-from", metavar="CHECKPOINT", help="the pre-trained checkpoint to fine-tune")
    g.add_argument("--resume", action="store_true", help="continue exactly from OUT/last (optimizer, step, RNG)")
    p.add_argument("--lm-weight", type=float, metavar="λ", help="weight of the auxiliary LM loss (config "
                                                                  "lm_weight; 0 = task loss only)")
    p.add_argument("--chat-template", metavar="FILE.jinja", help="--task chat: the Jinja chat template to "
                   "train with (default: the checkpoint's own, else the <|role|> template of docs/training.md)")
    p.add_argument("--config", metavar="FILE", help="a .json or .toml file of FinetuneConfig keys")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set max_iters=300")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run even if OUT already holds one (its checkpoints are replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bar on the terminal")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to "
                                                                "OUT/tensorboard")
    return p


def run(args: argparse.Namespace) -> TaskModel | GPT:
    """Fine-tune; returns the trained body and head, or the chat model (this rank's copy, unwrapped)."""
    out = Path(args.out)
    overrides = [*args.set, *(["tensorboard=true"] if args.tensorboard else []),
                 *([f"lm_weight={args.lm_weight}"] if args.lm_weight is not None else [])]
    state: dict[str, Any] | None = None
    if args.resume:
        state, cfg = load_resume(out, args.config, overrides, cls=FinetuneConfig)
        saved = state.get("run_meta", {})
        kind = saved.get("task")
        if kind not in (*KINDS, CHAT):
            raise TrainError(f"--resume: {out / LAST} is not a fine-tuning run")
        if args.task is not None and args.task != kind:
            raise TrainError(f"--resume: the run fine-tunes a {kind} task, not {args.task}")
    else:
        if args.task is None:
            raise TrainError("--task is required (one of " + ", ".join((*KINDS, CHAT)) + ")")
        kind = args.task
        cfg = build_config(file=args.config, overrides=overrides, cls=FinetuneConfig)
        if (out / LAST).exists() and not args.overwrite:
            raise TrainError(f"{out} already holds a run ({out / LAST}); pass --resume to continue it, "
                             "--overwrite to start again, or choose another --out")
    if cfg.tensorboard:
        summary_writer_class()
    if kind == CHAT:
        if args.lm_weight is not None:
            raise TrainError("--lm-weight is for the classification tasks; --task chat learns the assistant's "
                             "tokens only")
        return run_chat(args, cfg, state)
    if args.chat_template is not None:
        raise TrainError("--chat-template is for --task chat")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (TrainError, ConfigError, TaskDataError, ChatDataError, TaskError, CheckpointError, TokenizerError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
