"""Supervised task fine-tuning of a pre-trained GPT (GPT-1, section 3.2): a linear head W_y on the [Extract]
state and L = L_task + λ·L_LM, the language-modelling loss on the same sequences' text tokens kept as an
auxiliary objective (λ = --lm-weight, the config's lm_weight). `--task chat` is chat supervised fine-tuning
instead (training/chat/finetune.py): conversations in OpenAI's fine-tuning format, rendered with a chat
template, the loss on the assistant's tokens only.

Usage::

    python -m training.finetune --init-from checkpoints/shakespeare --task classification \\
        --train train.jsonl --val val.jsonl --out runs/speakers [--lm-weight 0.5] [--config FILE] [--set k=v]
    python -m training.finetune ... --out runs/speakers --resume        # continue OUT/last exactly
    python -m training.finetune --init-from checkpoints/shakespeare --task chat --train chats.jsonl \
        --val val.jsonl --out runs/chat [--chat-template FILE.jinja]

The task kinds, their input encodings and the head are model/task_head.py; the JSONL formats
training/task/data.py. Adds the special tokens [Start] [Delim] [Extract] to the tokenizer, with new embedding
rows. Writes OUT/last (with training_state.pt for --resume) and OUT/best (best validation accuracy; ties: lower
validation task loss), each a normal checkpoint plus task.json and task_head.safetensors; OUT/metrics.jsonl
and OUT/loss.png (and with --tensorboard, OUT/tensorboard). Every evaluation reports the validation accuracy
against the majority baseline (always the training file's most frequent label).

This file is the command line of both (flags, config, the --resume checks); the task run is
training/task/finetune.py, its loop training/task/loop.py, both on the trainer's shared pieces (training/loop.py's
BaseLoop, optim.py, checkpoints.py, metrics.py, build_model.py, distributed.py). Resume is exact: training
batches are a pure function of (seed, rank, step, micro-step) (training.example_sampler.ExampleSampler) and the
RNG states are saved with the optimizer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from model.checkpoint import CheckpointError
from model.gpt import GPT
from model.task_head import TaskModel
from model.task_items import KINDS, TaskError
from model.tokenizer import TokenizerError
from training.chat.data import ChatDataError
from training.chat.finetune import CHAT, run_chat
from training.checkpoints import LAST, load_resume
from training.config import ConfigError, FinetuneConfig, build_config
from training.errors import FINETUNE_PROG, TrainError
from training.metrics import summary_writer_class
from training.task.data import TaskDataError
from training.task.finetune import run_task


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=FINETUNE_PROG,
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
    return run_task(args, cfg, state, kind)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (TrainError, ConfigError, TaskDataError, ChatDataError, TaskError, CheckpointError, TokenizerError) as e:
        print(f"{FINETUNE_PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
