"""The language-model trainer's model: fresh from the config, resumed, or initialised from a checkpoint, checked
against the tokenizer of the prepared data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import Tokenizer
from training.build_model import init_model, resume_model
from training.config import ARCH_KEYS, TrainConfig
from training.errors import TrainError
from training.lm.data import DataDir


def tokenizers_match(a: Tokenizer, b: Tokenizer) -> bool:
    """Same ids for the same text: equal ranks and <|endoftext|> id (a named encoding equals its ranks file)."""
    if a.vocab_size != b.vocab_size or a.eot_id != b.eot_id:
        return False
    ra, rb = getattr(a.encoding, "_mergeable_ranks", None), getattr(b.encoding, "_mergeable_ranks", None)
    if ra is not None and rb is not None:
        return ra == rb
    return a.spec == b.spec


def padded_vocab(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_model(cfg: TrainConfig, data: DataDir, resume_from: Path | None = None,
                init_from: str | None = None) -> tuple[GPT, TrainConfig, dict[str, Any]]:
    """(model on the CPU, the run's config, metadata on where the weights came from).

    Seeds torch with cfg.seed first, so fresh weights are the same on every rank (DDP also broadcasts rank 0's).
    With init_from, the architecture keys of the returned config come from the checkpoint.
    """
    tokenizer = data.tokenizer
    init_meta: dict[str, Any] = {}
    torch.manual_seed(cfg.seed)
    if resume_from is not None:
        model, last = resume_model(resume_from, cfg)
        if not tokenizers_match(last.tokenizer, tokenizer):
            raise TrainError(f"--resume: the tokenizer of the data in {data.path} differs from the run's "
                             f"({last.tokenizer.spec})")
    elif init_from:
        model, cfg, ck = init_model(cfg, init_from)
        if not tokenizers_match(ck.tokenizer, tokenizer):
            raise TrainError(f"--init-from: the checkpoint's tokenizer ({ck.tokenizer.spec}, "
                             f"{ck.tokenizer.vocab_size} tokens) differs from the data's ({tokenizer.spec}, "
                             f"{tokenizer.vocab_size} tokens) in {data.path}; prepare the data with the "
                             "checkpoint's tokenizer")
        init_meta = {"init_from": str(init_from)}
    else:
        vocab = padded_vocab(tokenizer.vocab_size, cfg.vocab_multiple)
        try:
            mconf = GPTConfig(vocab_size=vocab, **{k: getattr(cfg, k) for k in (*ARCH_KEYS, "block_size",
                                                                                   "dropout")})
        except ValueError as e:
            raise TrainError(str(e)) from e
        model = GPT(mconf)
    return model, cfg, init_meta
