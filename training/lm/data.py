"""Token data on disk: streaming text → tokens, the prepared data directory, and batch sampling.

A prepared data directory (written by `python -m training.prepare`) holds

    train.bin, val.bin   flat token ids (uint16 while every id < 2**16, else uint32), no header
    meta.json            tokenizer spec, dtype, token and byte counts of each split
    <name>.tiktoken      the ranks file of a trained tokenizer (so the directory is self-contained)

Batches are random windows. The sampler is *stateless*: the windows of an
optimizer step are a pure function of (seed, rank, step, micro-step), so the
"data position" of a run is just its step, a resumed run draws exactly the
batches the uninterrupted run would have, and every DDP rank draws different ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from training.text import InputError, read_text, safe_chunks

if TYPE_CHECKING:
    import torch

META = "meta.json"
SPLITS = ("train", "val")

DataError = InputError  # one error type for bad text input and bad data directories


# --------------------------------------------------------------------------- #
# Encoding text in a streaming way
# --------------------------------------------------------------------------- #


def encode_stream(tokenizer: Tokenizer, path: Path, start: int = 0, stop: int | None = None,
                  on_bytes=None) -> Iterator[np.ndarray]:
    """Token ids (int64 arrays) of bytes [start, stop) of `path`, a chunk at a time.

    `<|endoftext|>` written in the text is plain text here, never the special token.
    on_bytes(n) is called with the number of bytes consumed, for a progress bar.
    """
    for chunk in safe_chunks(read_text(path, start, stop)):
        ids = tokenizer.encode(chunk, allow_special=False)
        if on_bytes is not None:
            on_bytes(len(chunk.encode("utf-8")))
        yield np.asarray(ids, dtype=np.int64)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# --------------------------------------------------------------------------- #
# A prepared data directory
# --------------------------------------------------------------------------- #


@dataclass
class DataDir:
    path: Path
    meta: dict[str, Any]
    tokenizer: Tokenizer
    train: np.memmap
    val: np.memmap

    @property
    def tokenizer_file(self) -> Path | None:
        """The ranks file of a file-based tokenizer (what save_checkpoint copies into checkpoints)."""
        spec = self.tokenizer.spec
        return self.path / spec["file"] if spec.get("type") == "tiktoken_file" else None

    def bytes_per_token(self, split: str) -> float:
        return self.meta[split]["bytes"] / self.meta[split]["tokens"]

    def bits_per_byte(self, split: str, loss_nats: float) -> float:
        """Mean loss (nats/token) → bits per byte of the split's text: loss · tokens / (bytes · ln 2)."""
        s = self.meta[split]
        return loss_nats * s["tokens"] / (s["bytes"] * math.log(2))

    def split(self, name: str) -> np.memmap:
        return self.train if name == "train" else self.val


def open_data_dir(path: str | Path) -> DataDir:
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: data directory not found (create it with python -m training.prepare)")
    meta_file = path / META
    if not meta_file.is_file():
        raise DataError(f"{meta_file}: missing (not a directory written by python -m training.prepare)")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        dtype = np.dtype(meta["dtype"])
        for s in SPLITS:
            int(meta[s]["tokens"]), int(meta[s]["bytes"])
        spec = meta["tokenizer"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{meta_file}: malformed ({type(e).__name__}: {e})") from e
    try:
        tokenizer = load_tokenizer(spec, path)
    except TokenizerError as e:
        raise DataError(f"{meta_file}: tokenizer: {e}") from e
    arrays = {}
    for s in SPLITS:
        f = path / f"{s}.bin"
        if not f.is_file():
            raise DataError(f"{f}: missing")
        n = f.stat().st_size // dtype.itemsize
        if n != meta[s]["tokens"] or f.stat().st_size % dtype.itemsize:
            raise DataError(f"{f}: holds {f.stat().st_size} bytes but {META} says {meta[s]['tokens']} "
                            f"{dtype.name} tokens (incomplete or mismatched data)")
        if n == 0:
            raise DataError(f"{f}: the {s} split is empty")
        arrays[s] = np.memmap(f, dtype=dtype, mode="r")
    return DataDir(path, meta, tokenizer, arrays["train"], arrays["val"])


# --------------------------------------------------------------------------- #
# Batches
# --------------------------------------------------------------------------- #


def check_split_size(data: np.ndarray, block_size: int, name: str) -> None:
    if len(data) < block_size + 1:
        raise DataError(f"the {name} split has {len(data)} tokens; it needs at least block_size + 1 = "
                        f"{block_size + 1} (lower block_size, or give more text / a larger --val-fraction)")


def window_batch(data: np.ndarray, offsets: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x = data[o : o+T] and targets y = data[o+1 : o+T+1] for each offset o."""
    import torch  # here, so that `python -m training.prepare` starts without importing torch

    idx = offsets[:, None] + np.arange(block_size + 1)[None, :]
    w = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
    return w[:, :-1], w[:, 1:]


class BatchSampler:
    """Random windows, a pure function of (seed, rank, step, micro-step): nothing to save but the step."""

    def __init__(self, data: np.ndarray, block_size: int, batch_size: int, seed: int, rank: int = 0) -> None:
        self.data, self.block_size, self.batch_size = data, block_size, batch_size
        self.seed, self.rank = seed, rank
        self.high = len(data) - block_size  # offsets in [0, high)

    def offsets(self, step: int, micro: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, step, micro])
        return rng.integers(0, self.high, size=self.batch_size)

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return window_batch(self.data, self.offsets(step, micro), self.block_size)

    def state(self) -> dict[str, Any]:
        return {"kind": "stateless_random_windows", "seed": self.seed, "block_size": self.block_size,
                "batch_size": self.batch_size}


def fixed_eval_offsets(n_tokens: int, block_size: int, batch_size: int, n_batches: int) -> np.ndarray:
    """The evaluation windows, (n_batches, batch_size) offsets spread evenly over the split.

    The same every evaluation (comparable numbers, no RNG state touched), and evenly spread
    rather than random: random windows over a small split cluster, and their mean loss can
    be several hundredths of a nat off the loss over the whole split.
    """
    n = n_batches * batch_size
    offsets = np.linspace(0, n_tokens - block_size - 1, num=n).round().astype(np.int64)
    return offsets.reshape(n_batches, batch_size)
