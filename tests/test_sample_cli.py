"""`python -m model.sample`: streaming output, determinism, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from model.checkpoint import load_checkpoint, save_checkpoint
from model.generate import generate
from model.sampling import SamplingParams
from tests.conftest import REPO, tiny_model


@pytest.fixture
def ckpt(tmp_path, byte_tokenizer):
    return save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=264), byte_tokenizer,
                           tokenizer_file=tmp_path / "bytes.tiktoken")


def sample(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model.sample", *args], cwd=REPO, capture_output=True,
                          text=True, input=input, timeout=120)


def test_greedy_cli_equals_library(ckpt):
    r = sample("--checkpoint", str(ckpt), "--prompt", "the king", "--max-new-tokens", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    ck = load_checkpoint(ckpt)
    ref = generate(ck.model, ck.tokenizer, [ck.tokenizer.encode("the king")],
                   SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert r.stdout == ref.text + "\n"


def test_seeded_cli_is_reproducible(ckpt):
    args = ["--checkpoint", str(ckpt), "--prompt", "a", "--max-new-tokens", "16", "--seed", "3", "--top-p", "0.9"]
    assert sample(*args).stdout == sample(*args).stdout


def test_interactive_loop(ckpt):
    r = sample("--checkpoint", str(ckpt), "--interactive", "--max-new-tokens", "5", "--temperature", "0",
               input="hello\nhow are you\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("You: ") == 3 and r.stdout.count("Model:") == 2


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "/nonexistent/ck", "--prompt", "x"], "checkpoint directory not found"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be in"),
    (["--prompt", "x", "--max-new-tokens", "1000"], "exceeds the model's context length"),
    (["--prompt", "x", "--top-p", "0"], "top_p must be in"),
])
def test_cli_errors(ckpt, args, message):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(ckpt), *args]
    r = sample(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
