"""Generation: prefill, decode step, per-sequence state, and a batch loop.

The split follows gpt-fast: `prefill` runs a whole prompt into a KV-cache slot
(in chunks, so a server can interleave them with decode steps), `decode_step`
runs one token for every active slot at once. `model.sampling.Sampler` holds the
per-slot sampling state on the device and picks the tokens; `Sequence` owns what is
per request on the host (parameters, seed, streaming detokenizer, stop strings,
finish reason), so a scheduler only moves token ids around.
`generate` / `stream_generate` drive a fixed batch of prompts to completion; the
HTTP server uses the same pieces with requests joining and leaving between steps.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from model.gpt import GPT
from model.kv_cache import ContextLengthError, KVCache
from model.sampling import RANDOM_SEED_BITS, Sampler, SamplingParams
from model.stopping import FinishReason, StopMatcher
from model.tokenizer import Tokenizer


def check_context(n_prompt: int, max_new_tokens: int, block_size: int) -> None:
    """Refuse a request that cannot fit: its prompt plus every token it may generate must fit in the context."""
    if n_prompt < 1:
        raise ContextLengthError("the prompt is empty: at least one token is needed")
    if n_prompt + max_new_tokens > block_size:
        raise ContextLengthError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {n_prompt + max_new_tokens} "
            f"exceeds the model's context length of {block_size} tokens"
        )


@torch.inference_mode()
def prefill(model: GPT, cache: KVCache, slots: int | list[int], tokens: list | torch.Tensor,
            chunk_size: int | None = None) -> torch.Tensor:
    """Run prompts into empty or partly filled slots, `chunk_size` tokens per forward pass.

    One slot and a (T,) prompt → the logits after its last token (vocab,). Several slots and
    equal-length prompts (B, T) → (B, vocab): one pass reads the weights once for all of them.
    """
    single = isinstance(slots, int)
    rows = [slots] if single else list(slots)
    idx = torch.as_tensor(tokens, dtype=torch.long, device=cache.device).view(len(rows), -1)
    for s in rows:
        cache.check_room(s, idx.size(1))
    chunk = chunk_size or idx.size(1)
    for start in range(0, idx.size(1), chunk):
        logits = model.forward_cached(idx[:, start:start + chunk], cache, rows)
    return logits[0] if single else logits


@torch.inference_mode()
def decode_step(model: GPT, cache: KVCache, slots: list[int] | range, tokens: torch.Tensor) -> torch.Tensor:
    """One new token (B,) for each slot → next-token logits (B, vocab)."""
    return model.forward_cached(tokens.view(-1, 1), cache, slots)


@dataclass
class TokenEvent:
    """One generated token as a client sees it."""

    id: int
    text: str  # text released by this token (may be "" while a character or stop string is pending)
    logprob: float
    special: bool = False  # <|endoftext|>: reported, but not part of the generated text
    finish_reason: FinishReason | None = None  # set on the last token of the sequence


@dataclass
class Sequence:
    """Per-request generation state."""

    prompt: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    tokens: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        self.params.validate()
        # a seed is always chosen up front and reported, so any result can be reproduced
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(RANDOM_SEED_BITS)
        self._eot = self.tokenizer.eot_id if self.params.stop_at_eos else None
        self._detok = self.tokenizer.stream_decoder()
        self._stops = StopMatcher(self.params.stop)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if not e.special)

    def append(self, token_id: int, logprob: float) -> TokenEvent:
        """Record a sampled token, release the text it completes and decide whether the sequence is done."""
        self.tokens.append(token_id)
        if token_id == self._eot:
            # the special token itself adds no text; release anything still held back
            ev = TokenEvent(token_id, self._detok.flush() + self._stops.flush(), logprob, special=True,
                            finish_reason=FinishReason.EOS)
        else:
            piece = self._detok.feed(token_id)
            at_limit = len(self.tokens) >= self.params.max_new_tokens
            if at_limit:
                piece += self._detok.flush()
            text, stopped = self._stops.feed(piece)
            ev = TokenEvent(token_id, text, logprob)
            if stopped:
                ev.finish_reason = FinishReason.STOP
            elif at_limit:
                ev.text += self._stops.flush()
                ev.finish_reason = FinishReason.LENGTH
        self.finish_reason = ev.finish_reason
        self.events.append(ev)
        return ev


def sample_into(sampler: Sampler, logits: torch.Tensor, slots: range | list[int],
                seqs: list[Sequence]) -> list[TokenEvent]:
    """Pick one token per slot from logits (B, vocab), append each to its sequence, return the events."""
    return [s.append(d.token, d.logprob) for s, d in zip(seqs, sampler.step(logits, slots))]


def make_sequences(model: GPT, tokenizer: Tokenizer, prompts: list[list[int]],
                   params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
    """Validate each request (parameters, context length) and build its state."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} parameter sets")
    for p, sp in zip(prompts, params):
        sp.validate()
        check_context(len(p), sp.max_new_tokens, model.config.block_size)
    return [Sequence(list(p), sp, tokenizer) for p, sp in zip(prompts, params)]


def run_batch(model: GPT, seqs: list[Sequence], prefill_chunk: int | None = None,
              ) -> Iterator[tuple[int, TokenEvent]]:
    """Drive sequences to completion together; yields (index, event) as tokens arrive.

    Every sequence gets its own cache slot; finished ones leave the batch, so each
    decode step runs only the live ones.
    """
    param = next(model.parameters())
    max_len = max(len(s.prompt) + s.params.max_new_tokens for s in seqs)
    cache = KVCache(model.config, len(seqs), max_len, dtype=param.dtype, device=param.device)
    sampler = Sampler(len(seqs), seqs[0].tokenizer.vocab_size, max_len, param.device)
    for i, seq in enumerate(seqs):
        sampler.admit(i, seq.params, seq.prompt, seed=seq.seed)
    # Prompts of the same length are prefilled together: one (n, T) pass reads the weights once
    # instead of n times (the same math; the batch changes only the rounding, as in decode).
    groups: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        groups.setdefault(len(seq.prompt), []).append(i)
    for rows in groups.values():
        logits = prefill(model, cache, rows, [seqs[i].prompt for i in rows], prefill_chunk)
        for i, ev in zip(rows, sample_into(sampler, logits, rows, [seqs[i] for i in rows])):
            yield i, ev
    live = list(range(len(seqs)))  # live[slot] = index of the sequence in that slot
    while live := _compact(cache, sampler, live, seqs):
        slots = range(len(live))
        logits = decode_step(model, cache, slots, sampler.last[:len(live)])
        for i, ev in zip(live, sample_into(sampler, logits, slots, [seqs[i] for i in live])):
            yield i, ev


def _compact(cache: KVCache, sampler: Sampler, live: list[int], seqs: list[Sequence]) -> list[int]:
    """Drop finished sequences and move the others down to slots 0..n-1, so decode steps read views."""
    keep = [slot for slot, i in enumerate(live) if not seqs[i].done]
    if len(keep) != len(live):
        moves = [(src, dst) for dst, src in enumerate(keep) if src != dst]
        if moves:
            src, dst = [m[0] for m in moves], [m[1] for m in moves]
            cache.move(src, dst)
            sampler.move(src, dst)
    return [live[slot] for slot in keep]


def stream_generate(model: GPT, tokenizer: Tokenizer, prompts: list[list[int]],
                    params: SamplingParams | list[SamplingParams],
                    prefill_chunk: int | None = None) -> Iterator[tuple[int, TokenEvent]]:
    """Generate for a batch of prompts together, yielding (prompt index, event) per token."""
    yield from run_batch(model, make_sequences(model, tokenizer, prompts, params), prefill_chunk)


def generate(model: GPT, tokenizer: Tokenizer, prompts: list[list[int]],
             params: SamplingParams | list[SamplingParams], prefill_chunk: int | None = None) -> list[Sequence]:
    """Generate for a batch of prompts together; returns the finished sequences in prompt order."""
    seqs = make_sequences(model, tokenizer, prompts, params)
    for _ in run_batch(model, seqs, prefill_chunk):
        pass
    return seqs
