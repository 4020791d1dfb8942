"""A run's checkpoints and resume state: OUT/last (with training_state.pt) and OUT/best, the RNG states
that make `--resume` exact, and tidying what a killed write left behind.

Every write goes through model.checkpoint.save_checkpoint (atomic), so a kill at any moment leaves the
previous checkpoint loadable.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.checkpoint import TRAINING_STATE, save_checkpoint
from model.gpt import GPT
from model.tokenizer import Tokenizer
from training.config import ARCH_KEYS, TrainConfig, build_config
from training.distributed import launched_as_rank0
from training.errors import TrainError

LAST, BEST = "last", "best"


def recover_checkpoint_dirs(out: Path) -> None:
    """Tidy what a killed save_checkpoint can leave: a stale temp dir, or (without renameat2) the old version."""
    for name in (LAST, BEST):
        olds = sorted(out.glob(f".{name}.old-*"), key=lambda p: p.stat().st_mtime)
        if not (out / name).exists() and olds:
            os.rename(olds[-1], out / name)
        for p in list(out.glob(f".{name}.tmp-*")) + list(out.glob(f".{name}.old-*")):
            shutil.rmtree(p, ignore_errors=True)


def load_resume(out: Path, config_file: str | None, overrides: list[str],
                cls: type[TrainConfig] = TrainConfig) -> tuple[dict[str, Any], TrainConfig]:
    """The training state saved in OUT/last and the resumed run's config (a `cls`): the saved one, then the file
    and overrides on top, which may change anything but the architecture."""
    if out.is_dir() and launched_as_rank0():  # under torchrun, rank 0 tidies
        recover_checkpoint_dirs(out)
    state_file = out / LAST / TRAINING_STATE
    if not state_file.is_file():
        raise TrainError(f"--resume: {state_file} not found (nothing to resume in {out})")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise TrainError(f"{state_file}: cannot read training state ({type(e).__name__}: {e})") from e
    cfg = build_config(base=state["config"], file=config_file, overrides=overrides, cls=cls)
    saved = state["config"]
    changed = [k for k in (*ARCH_KEYS, "block_size", "vocab_multiple") if getattr(cfg, k) != saved[k]]
    if changed:
        raise TrainError(f"--resume: cannot change {', '.join(changed)} of a run "
                         f"(saved: {', '.join(f'{k}={saved[k]!r}' for k in changed)})")
    return state, cfg


def rng_state() -> dict[str, Any]:
    """The RNG states of torch (CPU and CUDA), numpy and python, in types torch.load(weights_only=True) reads."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])


def seed_or_restore_rngs(state: dict[str, Any] | None, seed: int, rank: int) -> None:
    """A resumed run continues this rank's saved RNG states; a fresh one seeds them per rank (dropout noise
    differs per rank)."""
    if state is not None:
        rngs = state["rng"]
        if rank < len(rngs):
            set_rng_state(rngs[rank])
        else:
            torch.manual_seed(seed + rank)
    else:
        torch.manual_seed(seed + rank)
        np.random.seed(seed + rank)
        random.seed(seed + rank)


def write_checkpoints(out: Path, model: GPT, tokenizer: Tokenizer, tokenizer_file: Path | None, meta: dict[str, Any],
                      training_state: dict[str, Any], improved: bool,
                      extra_files: dict[str, bytes] | None = None) -> None:
    """OUT/best (weights only) if the run's measure improved, then OUT/last with the training state; both with
    the same extra files (a task head)."""
    if improved:  # best first: a kill between the two writes leaves last older, never best behind last
        save_checkpoint(out / BEST, model, tokenizer, meta, tokenizer_file=tokenizer_file, extra_files=extra_files)
    save_checkpoint(out / LAST, model, tokenizer, meta, tokenizer_file=tokenizer_file,
                    training_state=training_state, extra_files=extra_files)
