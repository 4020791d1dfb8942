"""What goes into the engine core and what comes out of it: plain dataclasses, no torch, no HTTP.

The same types travel in-process (the library's `generate`, the server's thread mode) and between processes
(the server's core process encodes them with msgspec, `engine/wire.py`), as vLLM V1's `EngineCoreRequest` /
`EngineCoreOutput` do. The core deals in token ids only: detokenizing and stop strings belong to whoever reads
the outputs (`engine.sequence.Sequence`), which aborts a request when its text hits a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from engine.params import SamplingParams
from engine.stopping import FinishReason
from model.config import ContextLengthError


class ErrorKind(StrEnum):
    """Why the core ended a request without finishing it. The HTTP layer maps kinds to statuses (app/errors.py)."""

    TIMEOUT = "timeout"  # it ran past its deadline (waiting or running)
    SHUTDOWN = "shutdown"  # the core stopped before it finished
    FAILED = "failed"  # a forward pass or the sampler raised (e.g. out of memory); the core goes on
    INVALID = "invalid"  # the request cannot run here (does not fit the cache); validation should have caught it
    # raised by the engine's clients before a request reaches the core
    OVERLOADED = "overloaded"  # every slot and queue place is taken
    UNAVAILABLE = "unavailable"  # the engine is not accepting requests: starting, draining, stopped or dead


@dataclass
class StructuredSpec:
    """A grammar the request's output must follow (engine/structured_output.py compiles it). Plain data: it
    travels to the core process inside EngineRequest."""

    kind: str  # "json_schema" | "json_object" | "regex" | "grammar" (EBNF or Lark) | "choice"
    value: str = ""  # the schema as JSON text, the regex, the grammar, or the choices as a JSON list


@dataclass(init=False)
class EngineRequest:
    """One sequence to generate. Its seed is `params.seed`, the one field that holds it: drawn once where the
    request was validated (app/validation.py for the server, engine.generate.make_sequences for the library) and
    required by the core. `EngineRequest(..., params, seed)` is a shorthand for params with that seed (a copy)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams  # the core reads the sampling fields, max_new_tokens and stop_at_eos (not `stop`)
    top_n: int = 0  # also report the top_n most likely tokens at each step
    arrival: float = 0.0  # time.monotonic() when the request arrived (the clock is shared by processes)
    deadline: float | None = None  # time.monotonic() past which it ends with ErrorKind.TIMEOUT
    # None: off; n >= 0: each prompt token's log-probability (from its second token on) and its n most likely
    # alternatives, computed during prefill. With params.max_new_tokens == 0 the request only scores its prompt:
    # it ends after its prefill, no token sampled (finish LENGTH). Such requests never reuse a cached prefix.
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None  # constrain the output to this grammar
    # False: never speculate for this request (when the core speculates: engine/spec_decode). Its tokens are the
    # same either way; this only saves the proposals' work for a request known not to repeat itself
    speculate: bool = True

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int | None = None,
                 top_n: int = 0, arrival: float = 0.0, deadline: float | None = None,
                 prompt_logprobs: int | None = None, structured: StructuredSpec | None = None,
                 speculate: bool = True) -> None:
        # (msgspec decodes the wire's copy without calling this: the fields above are the whole state)
        self.request_id, self.prompt, self.params = request_id, prompt, with_seed(params, seed)
        self.top_n, self.arrival, self.deadline = top_n, arrival, deadline
        self.prompt_logprobs, self.structured, self.speculate = prompt_logprobs, structured, speculate

    @property
    def seed(self) -> int | None:
        return self.params.seed


def context_problem(n_prompt: int, max_new_tokens: int, context: int, new_name: str = "max_new_tokens",
                    what: str = "the model's context length") -> tuple[str, str] | None:
    """The one context-length rule: a prompt of at least one token, and the prompt plus every token the request may
    generate within the context. Validation applies it (app/validation.py, engine.generate.make_sequences) and the
    engine core asserts it. Returns None, or the part at fault ("prompt": it is empty or leaves no room;
    "max_new_tokens") and why (`new_name`: what the caller calls max_new_tokens; `what`: the context's name)."""
    if n_prompt < 1:
        return "prompt", "the prompt is empty: at least one token is needed"
    total = n_prompt + max_new_tokens
    if total <= context:
        return None
    if n_prompt >= context:
        return "prompt", (f"the prompt has {n_prompt} tokens, which fills {what} of {context} tokens and leaves no "
                          "room to generate")
    return "max_new_tokens", (f"the prompt ({n_prompt} tokens) + {new_name} ({max_new_tokens}) = {total} exceeds "
                              f"{what} of {context} tokens; ask for at most {context - n_prompt}")


def check_context(n_prompt: int, max_new_tokens: int, context: int, what: str = "the model's context length") -> None:
    """ContextLengthError (a ValueError) when the request breaks `context_problem`'s rule."""
    if problem := context_problem(n_prompt, max_new_tokens, context, what=what):
        raise ContextLengthError(problem[1])


def with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    """`params` with `seed` (a copy when it differs; None: as they are)."""
    return params if seed is None or params.seed == seed else replace(params, seed=seed)


@dataclass
class PromptLogprobs:
    """The prompt's own log-probabilities, one entry per prompt token; the first token has none (None)."""

    logprobs: list[float | None]  # log P(token i | tokens < i) under the raw model distribution
    ranks: list[int | None]  # 1 + the number of tokens more likely than token i at its position
    top: list[list[tuple[int, float]]] | None = None  # per position: the n most likely (id, logprob); [] first


@dataclass
class RequestOutput:
    """What one engine step produced for one request: new tokens, and how it ended if it did."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # under the model's own distribution (raw logits), one per token
    top: list[list[tuple[int, float]]] | None = None  # per token: the top_n (id, logprob), when asked
    finish: FinishReason | None = None  # LENGTH, EOS, or STOP (its grammar is complete): the core is done
    error: ErrorKind | None = None  # set instead of tokens when the core ended it
    message: str = ""  # the error, in words
    queue_s: float | None = None  # on the first output: seconds from arrival to a KV-cache slot
    cached_tokens: int = 0  # on the first output: prompt tokens reused from the prefix cache, not computed
    prompt_logprobs: PromptLogprobs | None = None  # on the first output, when the request asked for them

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None
