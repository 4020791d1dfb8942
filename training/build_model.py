"""The model a run starts from when it is not fresh: the run's own OUT/last (--resume), or another checkpoint's
weights (--init-from, fine-tuning), after checking that the architecture fits the run. Every trainer uses these;
a fresh model from the config is the language-model trainer's alone (training/lm/build_model.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.gpt import GPT
from training.config import ARCH_KEYS, TrainConfig
from training.errors import TrainError


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
