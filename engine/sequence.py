"""The reader's side of a request, as vLLM's output processor: `Sequence` detokenizes the core's token ids as they
stream, matches stop strings (the caller aborts the request in the core when one hits) and keeps the finish reason;
`TokenEvent` is one token as a client sees it. Free of torch: the HTTP front (engine.output_processor) runs it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.params import SamplingParams
from engine.request import with_seed
from engine.stopping import FinishReason, StopMatcher
from model.tokenizer import Tokenizer


@dataclass
class TokenEvent:
    """One generated token as a client sees it."""

    id: int
    text: str  # text released by this token (may be "" while a character or stop string is pending)
    logprob: float
    special: bool = False  # <|endoftext|>: reported, but not part of the generated text
    finish_reason: FinishReason | None = None  # set on the last token of the sequence


class Sequence:
    """Per-request state on the reader's side: the tokens so far, their text, stop strings, the finish reason.
    Its seed is `params.seed` (`seed`: a shorthand for params with that seed, as EngineRequest's)."""

    def __init__(self, prompt: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 seed: int | None = None) -> None:
        self.prompt, self.params, self.tokenizer = prompt, with_seed(params, seed), tokenizer
        self.tokens: list[int] = []
        self.events: list[TokenEvent] = []
        self.finish_reason: FinishReason | None = None
        self._detok = self.tokenizer.stream_decoder()
        self._stops = StopMatcher(self.params.stop)

    @property
    def seed(self) -> int | None:
        return self.params.seed

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        # an EOS event's text is what a stop string or an unfinished character held back until then (the EOS
        # token itself adds none, see append): it belongs to the text as it did to the stream
        return "".join(e.text for e in self.events)

    def append(self, token_id: int, logprob: float, finish: FinishReason | None = None) -> TokenEvent:
        """Record a token from the core (`finish`: the core ended the request with it: EOS, LENGTH, or STOP for a
        stop token id or a complete grammar), release the text it completes and decide whether a stop string ended
        the request here."""
        self.tokens.append(token_id)
        if finish == FinishReason.EOS or (finish == FinishReason.STOP and token_id in self.params.stop_token_ids):
            # EOS, or one of the request's stop_token_ids (as vLLM, its text is not part of the output): the token
            # adds no text; release anything still held back. (STOP for a grammar that is complete keeps its text.)
            ev = TokenEvent(token_id, self._detok.flush() + self._stops.flush(), logprob,
                            special=finish == FinishReason.EOS, finish_reason=finish)
        else:
            piece = self._detok.feed(token_id)
            if finish is not None:
                piece += self._detok.flush()
            text, stopped = self._stops.feed(piece)
            ev = TokenEvent(token_id, text, logprob)
            if stopped:
                ev.finish_reason = FinishReason.STOP
            elif finish is not None:
                ev.text += self._stops.flush()
                ev.finish_reason = finish
        self.finish_reason = ev.finish_reason
        self.events.append(ev)
        return ev
