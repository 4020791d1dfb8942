"""Shared fixtures: a byte-level tokenizer, the offline GPT-2 tokenizer cache, a tiny checkpoint, one torch thread.
Plain helpers (functions, constants) live in tests/helpers.py and tests/app_helpers.py; tests import those, never
this file or another test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import BLOCK, REPO, tiny_model, write_byte_ranks

SHARED_TIKTOKEN = REPO.parent / "shared" / "tiktoken"
# tiktoken downloads GPT-2's ranks on first use; CI and dev machines have no network but a ready cache
if SHARED_TIKTOKEN.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_TIKTOKEN))

torch.set_num_threads(min(2, os.cpu_count() or 1))
# servers started by the tests (in-process and `python -m app` subprocesses, which inherit this) compute in fp32:
# their outputs are compared with fp32 references. `--dtype auto` may pick bf16 on a CPU that has it
# (engine.cpu_tuning.serving_dtype, tested with fakes in tests/test_sizing.py)
os.environ.setdefault("GPT_DTYPE", "fp32")
# ... and decode eagerly: `--compile auto` would start an inductor compile (~20 s of CPU) in every small test
# server; tests/test_compiled_decode.py covers the compiled step and the auto rule
os.environ.setdefault("GPT_COMPILE", "off")


@pytest.fixture
def byte_tokenizer(tmp_path):
    from model.tokenizer import Tokenizer

    return Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "bytes.tiktoken", [b"th", b"he", b" t", b"the"]))


@pytest.fixture
def default_spec_prices(monkeypatch):
    """Speculation's pauses from the default price of a verification pass (engine.spec_decode.adaptive's
    RATE_FLOOR a proposed token), not from this host's timings of the core's steps (engine.spec_decode.costs):
    the counts a test asserts (proposed, accepted) stay the same on every machine. The timings' own tests set
    their prices."""
    from engine.spec_decode.costs import StepCosts

    monkeypatch.setattr(StepCosts, "extra", lambda self, n, positions: None)


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    from model.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.named("r50k_base")
    except TokenizerError as e:
        pytest.skip(f"GPT-2 ranks unavailable offline: {e}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The test model is tiny: one intra-op thread is fastest, and far faster on a busy shared machine
    (OpenMP threads spin while they wait for cores). A module asks for it with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A 2-layer byte-level GPT (vocab 261, context 128) saved as a real checkpoint."""
    from model.checkpoint import save_checkpoint
    from model.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("ckpt")
    ranks = write_byte_ranks(d / "bytes.tiktoken", [b"th", b"he", b" t", b"the"])
    tok = Tokenizer.from_ranks_file(ranks)
    model = tiny_model(0, vocab_size=tok.vocab_size, block_size=BLOCK)
    return save_checkpoint(d / "tiny", model, tok, {"note": "app tests"}, tokenizer_file=ranks)
