"""Plain helpers the tests share (no tests and no fixtures here; fixtures live in tests/conftest.py): the repo
root, a byte-level tokenizer file, a tiny model, the sampler tests' distributions and read-back counter, and the
training tests' tiny run settings and corpus."""

from __future__ import annotations

import base64
import random
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BLOCK = 128  # context of the tiny checkpoint (tests/conftest.py's tiny_ckpt)


# ------------------------------------------------------------------------------------------------ CPU capabilities
def force_cpu(monkeypatch, **answers):
    """Make `model.cpu_support.support()` answer as another CPU would (e.g. packed_bf16=False: an AVX2 host), for
    the rest of the test; every kernel choice reads it there."""
    import dataclasses

    import model.cpu_support as cs

    forced = dataclasses.replace(cs.support(), **answers)
    monkeypatch.setattr(cs, "support", lambda: forced)
    return forced


# ------------------------------------------------------------------------------------------------ model, tokenizer
def write_byte_ranks(path: Path, merges: list[bytes] = ()) -> Path:
    """A valid .tiktoken ranks file: the 256 bytes plus the given merged tokens."""
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


def tiny_model(seed: int = 0, **overrides):
    from model.config import GPTConfig
    from model.gpt import GPT

    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", **overrides)).eval()


# ------------------------------------------------------------------------------------------------------- sampling
PROBS = torch.tensor([0.3, 0.2, 0.1, 0.1, 0.08, 0.07, 0.05, 0.04, 0.03, 0.01, 0.01, 0.005, 0.005])

# a grammar allows these of PROBS' tokens (the most likely one not among them)
ALLOWED = torch.tensor([0, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1], dtype=torch.bool)


def packed_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(k, V) bool → the packed int32 bitmask (bit j of word i: token 32·i + j)."""
    k, V = allowed.shape
    W = (V + 31) // 32
    bits = torch.zeros(k, W * 32, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    words = (bits.view(k, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class ReadBackCounter:
    """Counts every way a tensor's values reach Python (the host syncs of a CUDA device)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for name, fn in self.saved.items():
            def counted(t, *a, _name=name, _fn=fn, **k):
                self.calls.append(_name)
                return _fn(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


# ------------------------------------------------------------------------------------------------------- training
# a tiny training run's config overrides (tests/test_training.py, tests/test_train_metrics.py)
TINY = ["n_layer=2", "n_head=2", "n_embd=32", "block_size=32", "batch_size=4", "eval_iters=2", "log_interval=1",
        "warmup_iters=2", "learning_rate=3e-3", "min_lr=3e-4", "dropout=0.1", "sample_tokens=8", "num_threads=1"]


def make_corpus(n_lines: int = 600, seed: int = 0) -> str:
    rng = random.Random(seed)
    names = ["ROMEO", "JULIET", "NURSE", "FRIAR"]
    words = ("the a my thy love night day sweet fair death light star heaven hath doth art thou shall "
             "not what with from where speak come go good lord lady kiss name rose").split()
    lines = []
    for _ in range(n_lines):
        if rng.random() < 0.15:
            lines.append(f"\n{rng.choice(names)}:")
        lines.append(" ".join(rng.choices(words, k=rng.randint(4, 10))).capitalize() + rng.choice(".,;!?"))
    return "\n".join(lines) + "\n"


def run_alone_or_together(core, requests: list, together: bool) -> dict[str, list[int]]:
    """Each EngineRequest's tokens through `core`: one at a time (batch 1 throughout), or all added at once."""
    out: dict[str, list[int]] = {}
    for req in requests:
        core.add(req)
        while not together and core.has_work():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out
