"""Generation for the library and the CLIs: a batch of prompts through the engine core.

`generate` / `stream_generate` validate the requests (parameters, context length, the seed drawn once
here when none is given), then drive a `engine.core.EngineCore` to completion: the same scheduler,
cache, sampler and step the server runs. `Sequence` (engine/sequence.py) is the reader's side of a
request. `prefill` / `decode_step` are the bare model calls,
kept for the benchmarks that time the model alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from engine.core import EngineCore
from engine.params import SamplingParams, draw_seed
from engine.request import EngineRequest, check_context
from engine.sequence import Sequence, TokenEvent
from engine.spec_decode import SpecConfig, parse_speculative
from model.gpt import GPT
from model.kv_cache import KVCache
from model.tokenizer import Tokenizer


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


def make_sequences(model: GPT, tokenizer: Tokenizer, prompts: list[list[int]],
                   params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
    """Validate each request (parameters, context length), draw the seeds of those without one, build the state."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} parameter sets")
    for p, sp in zip(prompts, params):
        sp.validate()
        check_context(len(p), sp.max_new_tokens, model.config.block_size)
    # the library's one place a seed is drawn (the server's is app/validation.py); the caller's params stay as given
    return [Sequence(list(p), sp if sp.seed is not None else replace(sp, seed=draw_seed()), tokenizer)
            for p, sp in zip(prompts, params)]


def speculation(model: GPT, tokenizer: Tokenizer, speculative: SpecConfig | str | None,
                draft_model: GPT | None = None) -> tuple[SpecConfig | None, GPT | None]:
    """The library's speculative option: a SpecConfig or its string (`off`, `ngram`, `draft:CHECKPOINT`) → the
    config and, for a draft named by its checkpoint, the draft model loaded beside `model` (same tokenizer)."""
    if speculative is None:
        return None, None
    config = parse_speculative(speculative) if isinstance(speculative, str) else speculative.check()
    if not config.enabled:
        return None, None
    if config.method == "draft" and draft_model is None:
        from engine.spec_decode.draft import load_draft

        param = next(model.parameters())
        draft_model = load_draft(config.draft, tokenizer, param.device, param.dtype)
    return config, draft_model


def run(model: GPT, seqs: list[Sequence], prefill_chunk: int | None = None,
        speculative: SpecConfig | str | None = None, draft_model: GPT | None = None,
        ) -> Iterator[tuple[int, TokenEvent]]:
    """Drive sequences to completion through one engine core (a slot each); yields (index, event) per token.
    `speculative`: speculative decoding (engine/spec_decode; the same tokens, sooner when proposals hold)."""
    tokenizer = seqs[0].tokenizer
    spec, draft_model = speculation(model, tokenizer, speculative, draft_model)
    core = EngineCore(model, n_slots=len(seqs), vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eot_id,
                      max_len=max(len(s.prompt) + s.params.max_new_tokens for s in seqs),
                      prefill_chunk=prefill_chunk, cuda_graphs=False, pad_vocab=False, speculative=spec,
                      draft_model=draft_model)
    for i, s in enumerate(seqs):
        core.add(EngineRequest(str(i), s.prompt, s.params))
    while core.has_work():
        for out in core.step():
            if out.error is not None:
                raise RuntimeError(out.message)
            i = int(out.request_id)
            last = len(out.token_ids) - 1  # several tokens when speculation verified proposals
            for j, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
                ev = seqs[i].append(token, logprob, out.finish if j == last else None)
                if ev.finish_reason is not None and out.finish is None:  # a stop string: the core stops too
                    core.abort([out.request_id])
                yield i, ev
                if ev.finish_reason is not None:
                    break


def stream_generate(model: GPT, tokenizer: Tokenizer, prompts: list[list[int]],
                    params: SamplingParams | list[SamplingParams], prefill_chunk: int | None = None,
                    speculative: SpecConfig | str | None = None,
                    draft_model: GPT | None = None) -> Iterator[tuple[int, TokenEvent]]:
    """Generate for a batch of prompts together, yielding (prompt index, event) per token."""
    yield from run(model, make_sequences(model, tokenizer, prompts, params), prefill_chunk, speculative, draft_model)


def generate(model: GPT, tokenizer: Tokenizer, prompts: list[list[int]],
             params: SamplingParams | list[SamplingParams], prefill_chunk: int | None = None,
             speculative: SpecConfig | str | None = None, draft_model: GPT | None = None) -> list[Sequence]:
    """Generate for a batch of prompts together; returns the finished sequences in prompt order. `speculative`:
    `ngram` or `draft:CHECKPOINT` (or a SpecConfig; `draft_model` a loaded draft) gives the same tokens, sooner
    where proposals hold (engine/spec_decode)."""
    seqs = make_sequences(model, tokenizer, prompts, params)
    for _ in run(model, seqs, prefill_chunk, speculative, draft_model):
        pass
    return seqs
