"""A checkpoint directory's files other than its weights, read and checked without torch: its file names, config,
tokenizer and metadata (model/checkpoint.py loads and saves the weights). The HTTP front reads a checkpoint through
here while the engine core's process loads the model, and never loads torch (start-up, memory: docs/performance.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model.config import GPTConfig
from model.tokenizer import Tokenizer, TokenizerError, load_tokenizer

CONFIG, WEIGHTS, TOKENIZER, METADATA = "config.json", "model.safetensors", "tokenizer.json", "metadata.json"
TRAINING_STATE = "training_state.pt"

class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the reason."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_config(path: str | Path) -> GPTConfig:
    file = Path(path) / CONFIG
    try:
        return GPTConfig.from_dict(_read_json(file))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {e}") from e


def read_checkpoint(path: str | Path) -> tuple[GPTConfig, Tokenizer, dict[str, Any]]:
    """A checkpoint's config, tokenizer and metadata, checked, without its weights (what a server's HTTP front
    needs while another process loads the model)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    config = read_config(path)
    metadata = _read_json(path / METADATA) if (path / METADATA).is_file() else {}

    tok_file = path / TOKENIZER
    try:
        tokenizer = load_tokenizer(_read_json(tok_file), path)
    except TokenizerError as e:
        raise CheckpointError(f"{tok_file}: {e}") from e
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{tok_file}: tokenizer has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {config.vocab_size}")
    return config, tokenizer, metadata
