"""Structured output: grammar-constrained decoding (JSON schema, any JSON object, regex, Lark/GBNF grammar, a
choice of strings). Pure of HTTP; the shape of vLLM V1's `vllm/v1/structured_output/`.

    grammars = Grammars.for_tokenizer(tokenizer)     # one per tokenizer and process: the library's tokenizer + cache
    grammars.compile(StructuredSpec("json_schema", schema_text))   # GrammarError (a ValueError) with the reason
    matchers = Matchers(grammars, n_slots, device)   # the engine core's: one matcher per constrained request
    matchers.add(request_id, spec); bitmask = matchers.fill([ids...]); matchers.accept(request_id, token)

The library is **llguidance** (https://github.com/guidance-ai/llguidance), chosen over xgrammar and outlines-core
on our own tokenizers (the bundled model's 2,048-token BPE and GPT-2's r50k_base, both tiktoken byte-level BPE)
with `python -m bench.structured_libs` (bench/results/structured-libs.json; the timings are in docs/performance.md):
- tokenizers: all three take ours. llguidance builds its tokenizer from the tiktoken Encoding itself
  (`llguidance.tiktoken`); xgrammar from the raw bytes of every token; outlines-core from a bytes → ids map.
- coverage: JSON schema in llguidance and xgrammar (objects, arrays, enums, nested, `pattern`, numeric bounds,
  string lengths, `$ref`, anyOf), regex, and a grammar (llguidance: Lark, and GBNF through its converter;
  xgrammar: EBNF and Lark); outlines-core has JSON schema and regex only, and its index over the vocabulary
  is slow to build.
- compile: llguidance builds its lexer lazily, so a schema "compiles" at once; xgrammar precomputes masks per
  grammar state, which takes long on GPT-2's vocabulary.
- per-token mask: with GPT-2's vocabulary and 64 constrained rows the mask is the whole cost, and xgrammar's is
  slow inside strings with a maxLength (the strings a small model needs bounded), so llguidance's bounded worst
  case decided it; on the 2,048-token vocabulary both are fast.
The library's masks are computed without the GIL, in parallel over the batch (`LLExecutor`) where there are
cores to spare.

The mask is the packed int32 bitmask (bit j of word i allows token 32·i + j), one row per constrained request,
filled on the host and applied on the model's device by `engine.sampler.Sampler` (`Masker.apply`: it zeroes the
disallowed tokens' exp(z − max z)); the distribution is that of masking after the penalties and before
temperature, top-k and top-p, so those act within the allowed set. `<|endoftext|>` is allowed
exactly where the grammar may end. A request ends when its grammar is complete (`accept` says `done`: nothing
can follow, or <|endoftext|> was taken), or at max_new_tokens (the text may then be incomplete, as OpenAI's).

JSON is compact (no free whitespace; `", "` and `": "` as separators, as `json.dumps` writes it), so a schema with
bounded strings and arrays bounds the output's length, and a small model cannot wander into endless whitespace.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.request import StructuredSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger("engine.structured_output")

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept per tokenizer (least recently used dropped)


class GrammarError(ValueError):
    """A spec the library cannot compile, with the library's reason."""


def _llg():
    try:
        import llguidance
        import llguidance.tiktoken
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise GrammarError("structured output needs the llguidance package (pip install llguidance)") from e
    return llguidance


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of a spec (no tokenizer needed); GrammarError for a malformed one."""
    llg = _llg()
    kind, value = spec.kind, spec.value
    if kind not in KINDS:
        raise GrammarError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    if kind == "json_object":
        value, kind = '{"type": "object"}', "json_schema"
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        try:
            return llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    if kind == "choice":
        try:
            choices = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the choices are not a JSON list: {e}") from None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise GrammarError("choices must be a non-empty list of non-empty strings")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if not value:
        raise GrammarError(f"the {kind} must not be empty")
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    try:  # Lark, or GBNF (llama.cpp's `root ::= ...`) converted to Lark
        return llg.grammar_from("grammar", value)
    except ValueError as e:
        raise GrammarError(str(e)) from None


class Grammars:
    """The library's view of one tokenizer and a cache of compiled grammars, keyed by (kind, text).

    One per tokenizer per process (`for_tokenizer`): the server's front compiles at validation (so a bad spec is
    a 4xx naming the field), the engine core compiles again in its own process, once per spec. A compiled grammar
    is a template matcher: a request's matcher is a copy of it (microseconds), and the lexer states the template
    built stay warm for every later copy. Thread-safe."""

    _by_tokenizer: dict[int, Grammars] = {}
    _lock = threading.Lock()

    def __init__(self, tokenizer) -> None:
        llg = _llg()
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eos_id = tokenizer.eot_id
        self.ll_tokenizer = llg.tiktoken.lltokenizer_from_encoding(tokenizer.encoding, n_vocab=tokenizer.vocab_size,
                                                                   eos_token=tokenizer.eot_id)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.compiles = 0  # cache misses (tests count them)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> Grammars:
        with cls._lock:
            g = cls._by_tokenizer.get(id(tokenizer))
            if g is None or g.tokenizer is not tokenizer:  # (an id reused by a new object)
                g = cls._by_tokenizer[id(tokenizer)] = cls(tokenizer)
            return g

    def compile(self, spec: StructuredSpec):
        """The compiled grammar (a template matcher) of a spec, cached; GrammarError with the library's reason."""
        key = (spec.kind, spec.value)
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        llg = _llg()
        grammar = grammar_text(spec)
        try:
            template = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        except ValueError as e:
            raise GrammarError(_reason(str(e))) from None
        if template.is_error():
            raise GrammarError(_reason(template.get_error()))
        with self._cache_lock:
            self.compiles += 1
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: StructuredSpec):
        return self.compile(spec).deep_copy()

    def forget(self, spec: StructuredSpec) -> None:
        """Drop a spec's compiled grammar: the next matcher compiles afresh. Copies share the template's lexer, and
        one that met a limit of the library while decoding (a regex like `a{1000000}`: "too many expressions
        constructed") leaves every later copy failed from its first mask, which then allows only <|endoftext|>."""
        with self._cache_lock:
            self._cache.pop((spec.kind, spec.value), None)


def _reason(error: str) -> str:
    """The library's error on one line, without the lines that point into the text (carets, source echo)."""
    lines = [ln.strip() for ln in error.strip().splitlines()]
    lines = [ln for ln in lines if ln and set(ln) - set("^~ ") and not re.match(r"\d+ \|", ln)]
    return " ".join(lines)[:500] if lines else "the grammar is invalid"


class Matchers:
    """The engine core's side: one matcher per constrained request, and the host bitmask of a step.

    `fill(ids)` writes one mask row per request (in that order; in parallel with ≥ 8 cores) into a host buffer
    and returns them on the device after one host→device copy (from pinned memory on CUDA: asynchronous; the
    core fills after launching the step's forward pass, so on a GPU the fill overlaps it).
    `accept(id, token)` advances a request's matcher."""

    def __init__(self, grammars: Grammars, n_slots: int, device: torch.device | str = "cpu",
                 threads: int | None = None) -> None:
        import torch  # here, not at the top: the HTTP front compiles grammars (Grammars) and loads no torch

        llg = _llg()
        self.grammars = grammars
        self.device = torch.device(device)
        self.words = (grammars.vocab_size + 31) // 32
        pin = self.device.type == "cuda"
        self.host = torch.full((n_slots, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.dev = self.host if self.device.type == "cpu" else torch.empty_like(self.host, device=self.device)
        self._by_id: dict[str, Any] = {}
        self._specs: dict[str, StructuredSpec] = {}
        # the library's thread pool pays off with cores to spare; on a 2-core CPU a loop is faster (bench.structured)
        threads = threads if threads is not None else min(16, (os.cpu_count() or 1) // 2)
        self._executor = llg.LLExecutor(threads) if threads >= 4 else None
        self.fills = 0  # rows filled (tests count them)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, request_id: str, spec: StructuredSpec) -> None:
        self._by_id[request_id] = self.grammars.matcher(spec)
        self._specs[request_id] = spec

    def drop(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)
        self._specs.pop(request_id, None)

    def fill(self, request_ids: list[str]) -> torch.Tensor:
        """The next-token masks of these requests, rows in this order, on the device (one copy)."""
        import llguidance.torch as lt  # loads torch: the core's side only
        k = len(request_ids)
        host = self.host[:k]
        if k == 1 or self._executor is None:
            for i, r in enumerate(request_ids):
                lt.fill_next_token_bitmask(self._by_id[r], self.host, i)
        else:
            lt.fill_next_token_bitmask_par(self._executor, [(self._by_id[r], i) for i, r in enumerate(request_ids)],
                                           host)
        self.fills += k
        if self.dev is self.host:
            return host
        dev = self.dev[:k]
        dev.copy_(host, non_blocking=True)
        return dev

    def accept(self, request_id: str, token: int) -> tuple[bool, bool]:
        """Advance a request's matcher with its sampled token: (accepted, done: the grammar is complete and
        nothing can follow, or it took <|endoftext|>)."""
        m = self._by_id[request_id]
        ok = m.consume_token(token) and not m.is_error()  # (a matcher failed at its mask takes <|endoftext|>)
        if not ok:
            log.warning("request %s: the grammar refused sampled token %d: %s", request_id, token,
                        self.error(request_id))
            self.grammars.forget(self._specs[request_id])
        return ok, m.is_stopped()

    def error(self, request_id: str) -> str:
        """Why a request's matcher refused a token (a limit of the library met while decoding): the library's first
        line (the rest is a dump of the parser's state)."""
        lines = self._by_id[request_id].get_error().strip().splitlines()
        return lines[0].strip() if lines else "the grammar refused the token"
