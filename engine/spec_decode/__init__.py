"""Speculative decoding: cheap proposals of the next few tokens, verified exactly by the target model in the engine
core's batch (engine/core.py), so a request's tokens are the ones it would get without speculation.

- `config`: the method (`off` | `ngram` | `draft:CHECKPOINT`), the number of proposed tokens and the n-gram sizes,
  parsed into a `SpecConfig` (one-line errors for bad settings).
- `ngram`: prompt lookup (`NgramProposer`): the longest recent n-gram of the sequence found earlier in it, and the
  tokens that followed.
- `draft`: a small model with the same tokenizer (`DraftProposer`), greedy, in KV slots of its own.
- `adaptive`: how many tokens each request proposes (`AdaptiveK`): fewer after rejections, none for a while after
  repeated misses or while what it accepts does not pay for its passes.
- `costs`: what a verification pass costs here (`StepCosts`), from the core's timings of its own steps.
- `speculator`: the core's one handle (`Speculator`): each request's tokens, its proposals, the counters.

Verification (EngineCore._verify): a decoding row with proposals d1..dk feeds [last, d1..dk] in one forward pass;
the sampler then draws position j with its own seeded noise and the state (penalties, min_tokens, grammar) of a
sequence that took d1..dj, and d(j+1) stands exactly when it is that draw. The first draw that differs is kept as
the row's last token of the step; the cache keeps what was accepted and the rest is overwritten later.
"""

from engine.spec_decode.config import SpecConfig, SpecError, parse_speculative


def __getattr__(name: str):
    """`Speculator` on first use (PEP 562): the server's settings parse `config` before torch loads (app/config.py)."""
    if name == "Speculator":
        from engine.spec_decode.speculator import Speculator

        return Speculator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["SpecConfig", "SpecError", "Speculator", "parse_speculative"]
