"""Next-token selection for a batch of sequences, each with its own parameters and random stream.

Order of logit processing (as Hugging Face's): repetition penalty → temperature →
top-k → top-p. Temperature 0 means greedy argmax. Every sampled row draws its noise
from its own `torch.Generator`, so a seeded request gives the same tokens whether it
runs alone or shares the batch with others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 → off
    top_p: float = 1.0  # 1 → off; else the smallest set of tokens with probability ≥ top_p
    repetition_penalty: float = 1.0  # 1 → off; > 1 discourages tokens already in prompt or output
    seed: int | None = None  # None → a random seed, reported back so the result can be reproduced
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    stop_at_eos: bool = True

    def errors(self) -> list[str]:
        """Problems with the parameters, each naming its field (empty when valid)."""
        e = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            e.append(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            e.append(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            e.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            e.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            e.append(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            e.append(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            e.append("stop must be a list of non-empty strings")
        return e

    def validate(self) -> None:
        if errs := self.errors():
            raise ValueError("; ".join(errs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL's penalty: a seen token's logit l becomes l / p if l > 0 else l · p (lower for p > 1).

    logits (B, V) float, presence (B, V) bool, penalty (B, 1).
    """
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(presence, penalized, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's top-k tokens, then the smallest prefix (by probability) whose mass is ≥ top_p.

    logits (B, V) already divided by temperature; top_k (B,) long with 0 = off; top_p (B,) float.
    Returns (candidate logits (B, K) sorted high to low with the removed ones at -inf, their token ids (B, K)).
    K = V when any row needs top-p or has no top-k, else max(top_k): a partial sort is enough then.
    """
    V = logits.size(-1)
    needs_full = bool((top_p < 1.0).any()) or bool((top_k == 0).any())
    K = V if needs_full else min(int(top_k.max()), V)
    vals, ids = torch.topk(logits, K, dim=-1)  # sorted descending
    rank = torch.arange(K, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    vals = vals.masked_fill(rank >= k, float("-inf"))
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(vals, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # a token stays while the mass of the better ones is still < p; the top token always stays
        vals = vals.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return vals, ids


def sample_next(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                presence: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. Returns (token ids (B,), log-probabilities of those tokens (B,)).

    The log-probability is under the model's own distribution (raw logits, temperature 1),
    as TGI and OpenAI report it, whatever the sampling parameters were.
    presence (B, V) bool marks tokens seen so far; needed only if a row has a repetition penalty.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    device = logits.device
    penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if presence is not None and bool((penalty != 1.0).any()):
        logits = apply_repetition_penalty(logits, presence, penalty)

    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=device)
        temp = torch.tensor([params[i].temperature for i in sampled], device=device)[:, None]
        top_k = torch.tensor([params[i].top_k for i in sampled], device=device)
        top_p = torch.tensor([params[i].top_p for i in sampled], device=device)
        vals, ids = filter_top_k_top_p(logits[rows] / temp, top_k, top_p)
        probs = torch.softmax(vals, dim=-1)
        # Exponential race (argmax p / E, E ~ Exp(1)) is an exact categorical sample, never picks a
        # zero-probability token and needs no cumsum; the noise comes from each row's own generator.
        # Every row draws a full vocabulary of noise and keeps the first K (by rank): K depends on the
        # other rows of the batch, and drawing only K would make a seeded row's random stream (and so
        # its tokens) depend on who it shares the batch with.
        V = logits.size(-1)
        noise = torch.stack([torch.empty(V).exponential_(generator=generators[i])[: probs.size(1)] for i in sampled])
        choice = torch.argmax(probs / noise.to(device), dim=-1, keepdim=True)
        tokens[rows] = ids.gather(1, choice).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
