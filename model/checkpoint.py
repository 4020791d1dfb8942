"""Checkpoints: a self-contained directory that serving needs nothing beside.

    <dir>/config.json        GPTConfig
    <dir>/model.safetensors  weights (no pickle; the tied head is stored once, as the embedding)
    <dir>/tokenizer.json     {"type": "tiktoken", "name": "r50k_base"} or {"type": "tiktoken_file", "file": ...}
    <dir>/<ranks>.tiktoken   the ranks file, for a trained tokenizer
    <dir>/metadata.json      what produced it, step, validation loss, ...
Training state (optimizer, RNG, data position) may sit in the same directory as
`training_state.pt`; loading for serving never reads it.

Loading checks everything and raises `CheckpointError` naming the file and the
problem, so a server refuses a bad checkpoint at start-up in one line. Reading all but the weights, without torch:
model/checkpoint_info.py.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.checkpoint_info import (
    CONFIG,
    METADATA,
    TOKENIZER,
    TRAINING_STATE,
    WEIGHTS,
    CheckpointError,
    read_checkpoint,
)
from model.config import GPTConfig
from model.gpt import GPT, sinusoidal_table
from model.linear import FormatError, block_linears
from model.quantized_format import check_quantized_state, install_quantized, quantized_keys, read_quantization
from model.tokenizer import Tokenizer

TIED = "lm_head.weight"  # not stored: it is transformer.wte.weight
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    path: Path
    model: GPT
    tokenizer: Tokenizer
    config: GPTConfig
    metadata: dict[str, Any]


def _finite(t: torch.Tensor) -> bool:
    """No NaN or ±Inf in t: its min and max (NaN propagates through both) in one pass that writes nothing; a mask
    of `torch.isfinite` took 0.70 s for GPT-2 124M's weights against 0.05 on one core (docs/performance.md)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> Checkpoint:
    """Load and validate a checkpoint directory; the model comes back in eval mode on `device`."""
    path = Path(path)
    config, tokenizer, metadata = read_checkpoint(path)

    weights = path / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing file")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{weights}: truncated or corrupt safetensors file ({e})") from e

    try:
        quant = read_quantization(path)  # model/quantized_format.py's format: int8/int4 tensors stored
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    model = GPT.skeleton(config)  # no time spent on a random init that is overwritten anyway
    if quant is not None:
        names = [n for n, *_ in block_linears(model)]
        try:
            check_quantized_state(state, names, quant, str(weights))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        stored_quantized = quantized_keys(state, quant)
        qstate = {k: state.pop(k) for k in stored_quantized}
    expected = {k: v.shape for k, v in model.state_dict().items()
                if k != TIED and not (quant is not None and k in stored_quantized)}
    problems = [f"missing tensor {k}" for k in expected if k not in state]
    problems += [f"unexpected tensor {k}" for k in state if k not in expected]
    problems += [f"tensor {k} has shape {tuple(state[k].shape)}, config.json implies {tuple(s)}"
                 for k, s in expected.items() if k in state and state[k].shape != s]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{weights}: does not match {CONFIG}: " + "; ".join(problems[:3]) + more)
    bad = [k for k, t in state.items() if t.is_floating_point() and t.numel() and not _finite(t)]
    if bad:
        raise CheckpointError(f"{weights}: non-finite values (NaN/Inf) in {bad[:3]}")

    model.load_state_dict(state, strict=False, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # re-tie after assign
    if config.position == "sinusoidal":  # a buffer, not stored: rebuild it off the meta device
        model.pos_table = sinusoidal_table(config.block_size, config.n_embd)
    if quant is not None:  # the quantized modules replace the meta Linears and embedding before the move
        places = [(name, parent, child_name) for name, parent, child_name, _ in block_linears(model)]
        for _, parent, child_name in places:
            setattr(parent, child_name, torch.nn.Identity())
        model.transformer.wte = model.lm_head = torch.nn.Identity()
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    if quant is not None:
        target = dtype or next(model.parameters()).dtype
        state.update(qstate)
        try:
            install_quantized(model, places, state, quant, torch.device(device), target)
        except FormatError as e:
            raise CheckpointError(f"{weights}: {e}") from None
    return Checkpoint(path, model.eval(), tokenizer, config, metadata)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    return renameat2(AT_FDCWD, bytes(a), AT_FDCWD, bytes(b), RENAME_EXCHANGE) == 0


def save_checkpoint(path: str | Path, model: GPT, tokenizer: Tokenizer, metadata: dict[str, Any] | None = None,
                    tokenizer_file: str | Path | None = None, training_state: dict[str, Any] | None = None,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Write a checkpoint directory atomically: a reader (or a crash) sees the old one or the new one, never half.

    tokenizer_file: the .tiktoken ranks file of a file-based tokenizer (copied in). Defaults to the file
    named by the tokenizer's spec, looked up next to `path`'s previous version if it exists.
    extra_files: more files (name → contents) written into the same atomic directory, e.g. a task head
    (model/task_head.py); loading ignores them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    raw = model._orig_mod if hasattr(model, "_orig_mod") else model  # unwrap torch.compile
    raw = raw.module if hasattr(raw, "module") else raw  # unwrap DDP
    state = {k: v.detach().to("cpu").contiguous() for k, v in raw.state_dict().items() if k != TIED}
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(raw.config.to_dict(), indent=2) + "\n")
    spec = dict(tokenizer.spec)
    if spec["type"] == "tiktoken_file":
        if tokenizer_file is None:
            raise ValueError("a file-based tokenizer needs tokenizer_file (its .tiktoken ranks file)")
        shutil.copyfile(tokenizer_file, tmp / spec["file"])
    (tmp / TOKENIZER).write_text(json.dumps(spec, indent=2) + "\n")
    meta = {"format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "n_params": raw.num_params(), **(metadata or {})}
    meta = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in meta.items()}
    (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
    for name, content in (extra_files or {}).items():
        if Path(name).name != name or name in (WEIGHTS, CONFIG, TOKENIZER, METADATA, TRAINING_STATE):
            raise ValueError(f"extra_files: {name!r} is not a plain file name of its own")
        (tmp / name).write_bytes(content)
    if training_state is not None:
        torch.save(training_state, tmp / TRAINING_STATE)
    for f in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())

    if path.exists() and _exchange(tmp, path):
        shutil.rmtree(tmp)  # tmp now holds the previous version
    else:
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    return path
