"""GPTConfig: every architectural switch of the model, with GPT-2 defaults and named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Norm = Literal["pre", "post"]
Activation = Literal["gelu", "relu"]
Position = Literal["learned", "sinusoidal"]


class ContextLengthError(ValueError):
    """A sequence would grow past the cache's (or the model's) context length. Here, beside block_size and free of
    torch, because the HTTP front checks prompts against it (engine.request) and does not load torch."""


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024  # maximum context: prompt + generated tokens
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms, as GPT-2
    norm: Norm = "pre"  # pre: x + f(LN(x)) (GPT-2); post: LN(x + f(x)) (original Transformer / GPT-1)
    activation: Activation = "gelu"  # gelu is GPT-2's tanh approximation
    position: Position = "learned"  # learned table (GPT-2) or fixed sinusoids
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        errors = []
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                errors.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not errors and self.n_embd % self.n_head:
            errors.append(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            errors.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        for name, allowed in (("norm", Norm), ("activation", Activation), ("position", Position)):
            if getattr(self, name) not in allowed.__args__:
                errors.append(f"{name} must be one of {list(allowed.__args__)}, got {getattr(self, name)!r}")
        if self.position == "sinusoidal" and self.n_embd % 2:
            errors.append("sinusoidal positions need an even n_embd")
        if errors:
            raise ValueError("invalid GPTConfig: " + "; ".join(errors))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Build from a dict, refusing unknown keys (a typo must not silently become a default)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys: {unknown}")
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    # small models for tests and CPU experiments
    "tiny": dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32),
    "small": dict(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=128),
}
