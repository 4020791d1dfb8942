"""The speculative decoding settings as the core takes them (`SpecConfig`), parsed from the server's strings.

GPT_SPECULATIVE: `off`, `ngram` (prompt lookup) or `draft:CHECKPOINT` (a smaller model with the same tokenizer).
Bad values raise SpecError (a ValueError) with one line saying what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

# proposed tokens per step (vLLM's num_speculative_tokens; llama.cpp's --draft-max is 16). 8 over 4 on this CPU
# (bundled-model copy workload, batch 1, same run): copy 2.1x vs 1.77x, self-repeating text 1.87x vs 1.71x
DEFAULT_K = 8
# a verification pass scores at most about this many positions: n rows propose at most 16 // n - 1 tokens each (at
# least 1), since the pass's cost grows with its positions once it is no longer a read of the weights
VERIFY_POSITIONS = 16
# vLLM's prompt_lookup_min / prompt_lookup_max. Min 3 over 2 (same run, batch 1): sampled chat 1.04x vs ~0.91-0.95x
# of speculation off (2-grams of a 2048-token vocabulary match by chance), self-repeating text 1.83x vs 1.69x
DEFAULT_NGRAM_MIN, DEFAULT_NGRAM_MAX = 3, 4
# the largest decode batch that still speculates: above it a step is compute-bound more than read-bound, and every row
# of the padded verification pass pays for k + 1 positions (docs/api.md, speculative decoding)
DEFAULT_MAX_BATCH = 4
# a draft token the draft itself gives less probability than this ends its proposal (llama.cpp's --draft-p-min).
# Off by default: how sure a draft is says little across models (random GPT-2's 2-block draft is never 0.5 sure of
# a token yet agrees with the target 79% of the time: 1.71x at 0, 0.71x at 0.5; the bundled model's 1-layer draft
# gains a little from 0.5), and AdaptiveK already shortens proposals that fail
DEFAULT_DRAFT_P_MIN = 0.0
METHODS = ("off", "ngram", "draft")


class SpecError(ValueError):
    """Speculative decoding settings that cannot be used; the message is one line."""


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"  # off | ngram | draft
    draft: str | None = None  # the draft checkpoint (method "draft")
    k: int = DEFAULT_K  # at most this many tokens proposed per request and step
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    max_batch: int = DEFAULT_MAX_BATCH  # no speculation in a step decoding more requests than this
    draft_p_min: float = DEFAULT_DRAFT_P_MIN

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def check(self) -> SpecConfig:
        """The config itself, or SpecError naming the first problem."""
        if self.method not in METHODS:
            raise SpecError(f"unknown speculative method {self.method!r}: use off, ngram or draft:CHECKPOINT")
        if self.method == "draft" and not self.draft:
            raise SpecError("speculative method draft needs a checkpoint: draft:CHECKPOINT")
        if self.k < 1:
            raise SpecError(f"the number of speculative tokens must be >= 1, got {self.k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecError(f"n-gram sizes must satisfy 1 <= min <= max, got min {self.ngram_min}, "
                            f"max {self.ngram_max}")
        if self.max_batch < 1:
            raise SpecError(f"the speculative batch limit must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise SpecError(f"the draft's probability floor must be in [0, 1), got {self.draft_p_min}")
        return self


def parse_speculative(value: str | None, k: int = DEFAULT_K, ngram_min: int = DEFAULT_NGRAM_MIN,
                      ngram_max: int = DEFAULT_NGRAM_MAX, max_batch: int = DEFAULT_MAX_BATCH,
                      draft_p_min: float = DEFAULT_DRAFT_P_MIN) -> SpecConfig:
    """`off` | `ngram` | `draft:CHECKPOINT` (None or empty: off) and the sizes → a checked SpecConfig."""
    text = (value or "off").strip()
    method, _, draft = text.partition(":")
    method = method.strip().lower()
    if method != "draft" and draft:
        raise SpecError(f"unknown speculative method {text!r}: use off, ngram or draft:CHECKPOINT")
    return SpecConfig(method, draft.strip() or None, k, ngram_min, ngram_max, max_batch, draft_p_min).check()
