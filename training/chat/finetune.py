"""Chat supervised fine-tuning, `python -m training.finetune --task chat` (TRL's SFTTrainer with
assistant_only_loss, on OpenAI's fine-tuning format): the run's model, tokenizer, template and data, handed to
training/chat/loop.py's ChatLoop.

The template is --chat-template FILE, else the one the --init-from checkpoint carries, else
model/chat_template.py's SFT_TEMPLATE (a base model's transcript format is for prompting, not for training).
Its `<|name|>` tokens that the tokenizer lacks are added (model/special_tokens.py: new ids, new embedding
rows); the token that closes an assistant message is the stop token. Every checkpoint of the run carries the
template (tokenizer_config.json) and the stop ids (generation_config.json), so the server and model.export_hf
use them. A resumed run keeps its template (read back from OUT/last).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from model.chat_template import (
    DEFAULT_TEMPLATE,
    SFT_ORIGIN,
    SFT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    chat_config_files,
    end_of_turn,
    load_chat_template,
    template_special_tokens,
)
from model.gpt import GPT
from model.special_tokens import add_special_tokens
from model.tokenizer import EOT
from training.build_model import init_model, resume_model
from training.chat.data import TokenDir, encode_chat_file
from training.chat.encoding import ChatEncoder
from training.chat.loop import ChatLoop
from training.checkpoints import LAST, seed_or_restore_rngs
from training.config import FinetuneConfig
from training.distributed import setup_distributed
from training.errors import TrainError
from training.loop import setup_precision
from training.optim import make_optimizer

CHAT = "chat"  # the --task of chat fine-tuning


def training_template(checkpoint: Path, override: str | None) -> ChatTemplate:
    """--chat-template FILE, else the checkpoint's own template, else SFT_TEMPLATE; eos_token <|endoftext|>."""
    try:
        template = load_chat_template(checkpoint, EOT, override)
    except ChatTemplateError as e:
        raise TrainError(f"--chat-template: {e}") from None
    if override is None and template.source == DEFAULT_TEMPLATE:
        return ChatTemplate(SFT_TEMPLATE, SFT_ORIGIN, eos_token=EOT)
    return template


def run_chat(args: argparse.Namespace, cfg: FinetuneConfig, state: dict[str, Any] | None) -> GPT:
    """Fine-tune on conversations; returns the trained model (this rank's copy, unwrapped)."""
    out = Path(args.out)
    if state is not None and args.chat_template is not None:
        raise TrainError("--chat-template: a resumed run keeps the template it started with")
    d, device = setup_distributed(cfg.device)
    try:
        with TokenDir() as workdir:
            use_bf16 = setup_precision(cfg, device)
            torch.manual_seed(cfg.seed)
            if state is None:
                gpt, cfg, ck = init_model(cfg, args.init_from)
                template = training_template(ck.path, args.chat_template)
                tokenizer = add_special_tokens(gpt, ck.tokenizer, template_special_tokens(template))
                run_meta = {"init_from": str(args.init_from), "task": "chat", "chat_template": template.origin,
                            "train": str(args.train), "val": str(args.val)}
            else:
                gpt, ck = resume_model(out / LAST, cfg)
                tokenizer, run_meta = ck.tokenizer, state["run_meta"]
                template = load_chat_template(out / LAST, EOT)
            try:
                stop = end_of_turn(template, list(tokenizer.special_tokens))
            except ChatTemplateError as e:
                raise TrainError(f"--chat-template: {e}") from None
            stop_ids = sorted({tokenizer.eot_id, *([tokenizer.special_tokens[stop]] if stop else [])})
            run_meta = {**run_meta, "stop_tokens": [tokenizer.decode([i]) for i in stop_ids]}
            spec_file = tokenizer.spec.get("file")
            tokenizer_file = ck.path / spec_file if spec_file else None
            del ck
            encoder = ChatEncoder(template, tokenizer)
            train = encode_chat_file(args.train, encoder, cfg.block_size, cfg.overlong, workdir)
            val = encode_chat_file(args.val, encoder, cfg.block_size, cfg.overlong, workdir)
            if state is None:
                run_meta.update(train_sha256=train.sha256, val_sha256=val.sha256)
            else:
                for f, key in ((train, "train_sha256"), (val, "val_sha256")):
                    if run_meta.get(key) != f.sha256:
                        raise TrainError(f"--resume: {f.path} differs from the file the run started with (sha256)")
            model = gpt.to(device)
            optimizer = make_optimizer(model, cfg, device)
            if state is not None:
                optimizer.load_state_dict(state["optimizer"])
            seed_or_restore_rngs(state, cfg.seed, d.rank)
            return ChatLoop(cfg, train, val, tokenizer, tokenizer_file, chat_config_files(template, stop_ids), out,
                            model, optimizer, d, device, use_bf16, state, run_meta, args.quiet).run()
    finally:
        d.close()
