"""Sampling parameters as the APIs and the library state them: `SamplingParams`, the one table of their bounds
(`BOUNDS`), the token-id range check (`bad_token`) and the one place a request's seed is drawn (`draw_seed`).

No torch here: the HTTP layer (app/protocol, app/validation.py) imports it. The device-side sampler that applies
the parameters is `engine/sampler/`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

# Temperatures below this decode greedily (as vLLM's _SAMPLING_EPS): 1/T would overflow float32 long before
# T reaches 0 (T = 5e-324 is a valid JSON number), and the distribution is already one-hot.
GREEDY_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01  # dividing logits by less overflows; the APIs refuse it
# Seeds (asked for, or drawn when a request has none and reported back) are at most 2^53 - 1, the largest integer
# every JSON reader holds exactly (a JavaScript number; a JSON Schema validator compares as doubles, so a larger
# bound would let it call 2^63 + 100 "valid"): any client can send the same seed back exactly.
RANDOM_SEED_BITS = 53
MAX_SEED = 2**RANDOM_SEED_BITS - 1


@dataclass(frozen=True)
class Bound:
    """An interval of allowed values (None: unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def __contains__(self, v) -> bool:  # NaN is in no interval
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))

    def text(self) -> str:
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        if low is None or self.le is None:
            return f">= {self.ge}" if self.ge is not None else f"> {self.gt}" if self.gt is not None \
                else f"<= {self.le}"
        return f"in {low}, {self.le}]"

    def field(self, **override) -> dict:
        """The bound as pydantic `Field` keyword arguments; `override` states where an API differs in range (and
        why, at the call)."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None} | override


# The one table of sampling bounds: SamplingParams.errors checks it and the HTTP request models take their `Field`
# limits from it (app/protocol), so the library, the engine and both APIs accept the same values.
BOUNDS: dict[str, Bound] = {
    "max_new_tokens": Bound(ge=1),  # (the engine core also runs 0: a request that only scores its prompt)
    "temperature": Bound(ge=0, le=100),
    "top_k": Bound(ge=0),
    "top_p": Bound(gt=0, le=1),
    "repetition_penalty": Bound(ge=MIN_REPETITION_PENALTY, le=100),
    "presence_penalty": Bound(ge=-2, le=2),
    "frequency_penalty": Bound(ge=-2, le=2),
    "seed": Bound(ge=0, le=MAX_SEED),
    "logit_bias": Bound(ge=-100, le=100),  # each value
    # min_tokens above max_new_tokens means what it says (no stop before max_new_tokens): vLLM refuses it, but no
    # JSON schema can state the comparison and /openapi.json must describe every refusal
    "min_tokens": Bound(ge=0),
}
_INTEGER = ("max_new_tokens", "top_k", "seed", "min_tokens")


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 → off
    top_p: float = 1.0  # 1 → off; else the smallest set of tokens with probability ≥ top_p
    repetition_penalty: float = 1.0  # 1 → off; > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per time a token was generated
    seed: int | None = None  # None → a random seed, reported back so the result can be reproduced
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    stop_at_eos: bool = True
    # OpenAI's logit_bias: token id → added to its logit before penalties and temperature (in [-100, 100])
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # vLLM's: EOS (when stop_at_eos) and stop_token_ids cannot be drawn before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: drawing one ends the request (finish STOP)

    def errors(self) -> list[str]:
        """Problems with the parameters, each naming its field (empty when valid)."""
        e = []
        for name, bound in BOUNDS.items():
            if name == "logit_bias":
                if any(v not in bound for v in self.logit_bias.values()):
                    e.append(f"logit_bias values must be {bound.text()}")
                continue
            v = getattr(self, name)
            if name == "seed" and v is None:
                continue
            if name in _INTEGER and not isinstance(v, int):
                e.append(f"{name} must be an integer {bound.text()}, got {v!r}")
            elif v not in bound:
                e.append(f"{name} must be {'an integer ' if name in _INTEGER else ''}{bound.text()}, got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            e.append("stop must be a list of non-empty strings")
        return e

    def validate(self) -> None:
        if errs := self.errors():
            raise ValueError("; ".join(errs))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def bad_token(ids: Iterable[int], vocab_size: int) -> tuple[int, int] | None:
    """The first (position, id) of `ids` outside the vocabulary [0, vocab_size), or None: the one token-id range
    check (prompts, stop_token_ids, logit_bias keys; validation, the core and the sampler)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return i, t
    return None


def draw_seed() -> int:
    """A random seed for a request that names none: the one place seeds are drawn (at validation: the
    server's app/validation.py, the library's engine.generate.make_sequences); everything after requires one."""
    return secrets.randbits(RANDOM_SEED_BITS)

