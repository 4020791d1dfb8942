"""Shared fixtures: small models, a byte-level tokenizer, and the offline GPT-2 tokenizer cache."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_TIKTOKEN = REPO.parent / "shared" / "tiktoken"
# tiktoken downloads GPT-2's ranks on first use; CI and dev machines have no network but a ready cache
if SHARED_TIKTOKEN.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_TIKTOKEN))

torch.set_num_threads(min(2, os.cpu_count() or 1))
# servers started by the tests (in-process and `python -m app` subprocesses, which inherit this) compute in fp32:
# their outputs are compared with fp32 references. `--dtype auto` may pick bf16 on a CPU that has it
# (engine.core_process.serving_dtype, tested with fakes in tests/test_sizing.py)
os.environ.setdefault("GPT_DTYPE", "fp32")


def write_byte_ranks(path: Path, merges: list[bytes] = ()) -> Path:
    """A valid .tiktoken ranks file: the 256 bytes plus the given merged tokens."""
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


@pytest.fixture
def byte_tokenizer(tmp_path):
    from model.tokenizer import Tokenizer

    return Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "bytes.tiktoken", [b"th", b"he", b" t", b"the"]))


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    from model.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.named("r50k_base")
    except TokenizerError as e:
        pytest.skip(f"GPT-2 ranks unavailable offline: {e}")


def tiny_model(seed: int = 0, **overrides):
    from model.config import GPTConfig
    from model.gpt import GPT

    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", **overrides)).eval()
