"""The front's side of every request (vLLM V1's `OutputProcessor`): the one loop over the engine's outputs.

Each step's `RequestOutput`s are turned into what the routes stream: the token's text (detokenized here,
held back while a character or a stop string is incomplete), its log-probability and alternatives, and on the
last token the finish reason and whole text. A stop string found here ends the request: `process` returns
its id so the client aborts it in the core. Items go to per-request asyncio queues; this runs on the event
loop, once per engine step.

A request that asked for its prompt's log-probabilities gets a `PromptOut` first (each prompt token with its
text, log-probability, rank and alternatives). A request that only scores its prompt (max_new_tokens 0) gets
nothing else: its `PromptOut` carries `finished`, as the last `TokenOut` of other requests does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.params import SamplingParams
from engine.request import ErrorKind, PromptLogprobs, RequestOutput
from engine.sequence import Sequence
from engine.stopping import FinishReason
from model.tokenizer import Tokenizer


@dataclass
class Finished:
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    prompt_tokens: int
    text: str
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


@dataclass
class TokenOut:
    index: int  # 1-based position in the generated sequence
    id: int
    text: str  # text this token releases (held back while a character or a stop string is incomplete)
    logprob: float
    special: bool
    top: list[tuple[int, str, float]] | None = None  # the top_n most likely tokens at this step
    finished: Finished | None = None  # set on the last token of the request


@dataclass
class PromptToken:
    id: int
    text: str  # the text this token releases when the prompt is decoded as a stream (its characters, once whole)
    logprob: float | None  # None for the first prompt token
    rank: int | None = None  # 1 + the number of tokens more likely at its position
    top: list[tuple[int, str, float]] | None = None  # the most likely tokens at its position (id, text, logprob)


@dataclass
class PromptOut:
    """The prompt's tokens with their log-probabilities (before any generated token); `finished` is set when the
    request only scored its prompt (nothing generated)."""

    tokens: list[PromptToken]
    finished: Finished | None = None


@dataclass
class Failed:
    kind: ErrorKind
    message: str


class _Disconnected:
    """Put on a request's queue when its client went away: the consumer stops."""


DISCONNECTED = _Disconnected()


class RequestState:
    """One request as the front sees it: its sequence (text, stops), its queue of items, its deadline."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 *, top_n: int, timeout_s: float, abort: Callable[[str], None],
                 prompt_logprobs: int | None = None) -> None:
        self.id = request_id
        self.prompt_logprobs = prompt_logprobs
        self.seq = Sequence(list(prompt), params, tokenizer)
        self.prompt = self.seq.prompt
        self.top_n = top_n
        self.timeout_s = timeout_s
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False  # the last item (Finished or Failed) was queued, or the request was cancelled
        self.last_token_at = 0.0
        self.cached_tokens = 0  # from the first output: prompt tokens the core reused instead of computing
        self._abort = abort

    @property
    def seed(self) -> int:
        return self.seq.seed

    def cancel(self) -> None:
        """Stop generating (the core frees the slot at its next step)."""
        if not self.closed:
            self.closed = True
            self._abort(self.id)

    def disconnect(self) -> None:
        """The client went away: stop generating and wake the consumer."""
        self.cancel()
        self.queue.put_nowait(DISCONNECTED)

    async def events(self, grace_s: float = 5.0) -> AsyncIterator[PromptOut | TokenOut | Failed]:
        """Items as they arrive; ends after the last token or a Failed, or silently when the client disconnected.

        The core enforces the deadline; waiting past it (plus a grace) is a safety net for a core stuck in one
        very long step."""
        while True:
            if not self.queue.empty():  # the common case under load: no timer, no task per token
                item = self.queue.get_nowait()
            else:
                remaining = self.deadline + grace_s - time.monotonic()
                try:
                    item = await asyncio.wait_for(self.queue.get(), timeout=max(remaining, 0.01))
                except TimeoutError:
                    self.cancel()
                    yield Failed(ErrorKind.TIMEOUT, f"the request exceeded the time limit of {self.timeout_s:g} s")
                    return
            if item is DISCONNECTED:
                return
            yield item
            if isinstance(item, Failed) or item.finished is not None:
                return


class OutputProcessor:
    """Requests in flight by id; `process` hands each engine step's outputs to them.

    `on_token(state, first, now)` and `on_end(state, outcome)` (a FinishReason, or an ErrorKind) let the
    server observe latencies and outcomes without this module knowing about HTTP or metrics."""

    def __init__(self, tokenizer: Tokenizer, on_token: Callable | None = None, on_end: Callable | None = None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.on_token, self.on_end = on_token, on_end

    def __len__(self) -> int:
        return len(self.states)

    def add(self, state: RequestState) -> None:
        self.states[state.id] = state

    def drop(self, request_id: str) -> RequestState | None:
        """The request was cancelled by its reader: forget it (its later outputs, if any, are ignored)."""
        st = self.states.pop(request_id, None)
        if st is not None and self.on_end is not None:
            self.on_end(st, "cancelled")
        return st

    def process(self, outputs: list[RequestOutput]) -> list[str]:
        """Queue each output's items; returns the ids that a stop string ended here (to abort in the core)."""
        now = time.monotonic()
        stopped: list[str] = []
        for out in outputs:
            st = self.states.get(out.request_id)
            if st is None:  # cancelled meanwhile
                continue
            if out.error is not None:
                self._end(st, Failed(out.error, out.message), out.error)
                continue
            if out.prompt_logprobs is not None or not out.token_ids:
                item = PromptOut(self.prompt_tokens(st.prompt, out.prompt_logprobs) if out.prompt_logprobs else [])
                if not out.token_ids:  # the prompt was only scored: the request ends here
                    if out.finish is not None:
                        item.finished = Finished(out.finish, 0, st.seed, len(st.prompt), "")
                        self._end(st, item, out.finish)
                    continue
                st.queue.put_nowait(item)
            last = len(out.token_ids) - 1  # several tokens when speculation verified proposals
            for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
                ev = st.seq.append(token, logprob, out.finish if i == last else None)
                n = len(st.seq.tokens)
                top = None
                if out.top is not None and st.top_n:
                    top = [(t, self.tokenizer.decode([t]), v) for t, v in out.top[i][:st.top_n]]
                if n == 1:
                    st.cached_tokens = out.cached_tokens
                if self.on_token is not None:
                    self.on_token(st, n == 1, now, out.queue_s)
                st.last_token_at = now
                item = TokenOut(n, ev.id, ev.text, ev.logprob, ev.special, top)
                if ev.finish_reason is None:
                    st.queue.put_nowait(item)
                    continue
                item.finished = Finished(ev.finish_reason, n, st.seed, len(st.prompt), st.seq.text, st.cached_tokens)
                self._end(st, item, ev.finish_reason)
                if out.finish is None:  # a stop string: the core has not finished it
                    stopped.append(st.id)
                break
        return stopped

    def prompt_tokens(self, prompt: list[int], scores: PromptLogprobs) -> list[PromptToken]:
        """The prompt as PromptTokens: texts from one streaming decode (a character split across tokens is given
        to the token that completes it, so the texts add up to the prompt's text), alternatives decoded."""
        dec = self.tokenizer.stream_decoder()
        texts = [dec.feed(t) for t in prompt]
        texts[-1] += dec.flush()
        names: dict[int, str] = {}

        def name(t: int) -> str:
            if t not in names:
                names[t] = self.tokenizer.decode([t])
            return names[t]

        out = []
        for i, (t, text, lp, rank) in enumerate(zip(prompt, texts, scores.logprobs, scores.ranks)):
            top = None
            if scores.top is not None:
                top = [(a, name(a), v) for a, v in scores.top[i]]
            out.append(PromptToken(t, text, lp, rank, top))
        return out

    def fail_all(self, kind: ErrorKind, message: str) -> None:
        """Every request in flight gets a final Failed (the engine stopped or died)."""
        for st in list(self.states.values()):
            self._end(st, Failed(kind, message), kind)

    def _end(self, st: RequestState, item: TokenOut | Failed, outcome) -> None:
        del self.states[st.id]
        st.closed = True
        if self.on_end is not None:
            self.on_end(st, outcome)
        st.queue.put_nowait(item)
