"""The model a run trains: fresh from the config, the run's own OUT/last (--resume), or another checkpoint's
weights (--init-from, fine-tuning), after checking that the tokenizer and architecture fit the run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import Tokenizer
from training.config import ARCH_KEYS, TrainConfig
from training.data import DataDir
from training.errors import TrainError


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


def resume_model(path: Path, cfg: TrainConfig) -> tuple[GPT, Checkpoint]:
    """A run's own last checkpoint (--resume): its config (vocab padding included) with the run's dropout, its
    weights; and the checkpoint (tokenizer, path) it came from."""
    try:
        last = load_checkpoint(path)
    except CheckpointError as e:
        raise TrainError(f"--resume: {e}") from e
    model = GPT(dataclasses.replace(last.config, dropout=cfg.dropout))
    model.load_state_dict(last.model.state_dict())
    return model, last


def init_model(cfg: TrainConfig, init_from: str | Path) -> tuple[GPT, TrainConfig, Checkpoint]:
    """Another checkpoint's weights (--init-from): the architecture keys of the returned config come from it, and
    a smaller block_size crops its position table. Also returns the checkpoint (tokenizer, path)."""
    try:
        ck = load_checkpoint(init_from)
    except CheckpointError as e:
        raise TrainError(f"--init-from: {e}") from e
    conflicts = [f"{k}={getattr(ck.config, k)!r}" for k in ARCH_KEYS
                 if k in cfg.explicit and getattr(cfg, k) != getattr(ck.config, k)]
    if conflicts:
        raise TrainError(f"--init-from: the checkpoint has {', '.join(conflicts)}; architecture keys cannot "
                         "change when fine-tuning (leave them out of the config)")
    block = cfg.block_size if "block_size" in cfg.explicit else ck.config.block_size
    if block > ck.config.block_size:
        raise TrainError(f"--init-from: block_size {block} exceeds the checkpoint's {ck.config.block_size}")
    cfg = cfg.replace(block_size=block, **{k: getattr(ck.config, k) for k in ARCH_KEYS})
    mconf = dataclasses.replace(ck.config, block_size=block, dropout=cfg.dropout)
    model = GPT(mconf)
    sd = {k: v for k, v in ck.model.state_dict().items()}
    if "transformer.wpe.weight" in sd:
        sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:block]  # crop the position table
    model.load_state_dict(sd)
    return model, cfg, ck


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
