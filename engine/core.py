"""The engine core: many requests through one model, step by step. No threads, no asyncio, no HTTP.

    core = EngineCore(model, n_slots=32, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eot_id)
    core.add(EngineRequest("a", prompt_ids, SamplingParams(max_new_tokens=20), seed=1))
    while core.has_work():
        for out in core.step():      # RequestOutput: new token ids, logprobs, finish or error kind
            ...

It owns the scheduler (`engine.scheduler`) and runs vLLM V1's step: schedule → execute → update; the model, the
KV cache, the sampler, the CUDA graphs and the compiled decode step sit behind its model runner
(`engine.runner.ModelRunner`), which computes each step's forward passes and draws. Whoever drives the core (the
library's `generate`, the server's core process or its engine thread) reads the outputs, detokenizes them and calls
`abort` when a stop string ends a request.
The sampling state of every slot lives on the model's device (`engine.sampler.Sampler`), and the noise of each
token is a function of (seed, position, token id), so a seeded or greedy request gives the same tokens alone or
batched.

Prompt log-probabilities (`EngineRequest.prompt_logprobs`) are computed during prefill, chunk by chunk, from the
chunk's final hidden states, and read back once, with the request's first output (engine/prompt_logprobs.py,
`PromptScorer`).

Structured output (engine/structured_output.py): a request with a grammar (`EngineRequest.structured`; the core
needs the `tokenizer` then) gets a matcher when it is added. In a step where some sampled request has one, the
masks of those rows are filled once, after the step's first forward pass is launched (on CUDA the host work
overlaps it), copied to the device once, and applied by the sampler; after the draws each matcher takes its
request's token, and a request whose grammar is complete finishes (FinishReason.STOP, or EOS when it took
<|endoftext|>). A step with no constrained request does none of this.

Speculative decoding (engine/spec_decode; `speculative`, off by default): in a step decoding at most
`SpecConfig.max_batch` requests, the speculating ones get proposals (prompt lookup or a draft model) and the
decode pass scores [last, d1..dk] for every row at once (`_verify`). The sampler then draws position j of the rows
still alive with its own seeded noise, penalties, bias, min_tokens and grammar state as if d1..dj were taken (they
were, exactly when each was the draw): a row emits its draws up to the first that differs from its proposal or ends
its request (nothing after it is drawn), and its cache keeps the positions of the tokens it emitted. The tokens are
those of a run without speculation.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.compiled_decode import DEFAULT_MAX_BATCH as DEFAULT_COMPILE_MAX_BATCH
from engine.ops import Draw, RowDraws
from engine.params import bad_token
from engine.prompt_logprobs import PROMPT_LOGPROBS_PIECE, PromptScorer
from engine.request import EngineRequest, ErrorKind, RequestOutput, check_context
from engine.runner import ModelRunner, StepBatch
from engine.scheduler import Scheduler, Step, finish_reason
from engine.spec_decode import SpecConfig, Speculator
from engine.spec_decode.config import VERIFY_POSITIONS
from engine.structured_output import Grammars, Matchers
from model.gpt import GPT
from model.kv_cache import device_index
from model.linear import DEFAULT_INT4_GROUP

log = logging.getLogger("engine.core")


def is_fatal_device_error(e: BaseException) -> bool:
    """An error after which the device is unusable: a CUDA error (an illegal access, a device-side assert) is
    sticky, every later call fails with it, so the engine must stop (its process exits, /live turns 503 and the
    orchestrator restarts it); out of memory fails its step only. torch.AcceleratorError is torch >= 2.8's type
    for them; before it (and for the driver's own) a RuntimeError that says so."""
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return isinstance(e, RuntimeError) and str(e).startswith(("CUDA error", "CUDA driver error"))


def _runner_attr(name: str) -> property:
    """EngineCore.<name>: the model runner's attribute, read through the core."""
    return property(lambda self: getattr(self.runner, name), doc=f"ModelRunner.{name}")


class EngineCore:
    def __init__(self, model: GPT, *, n_slots: int, vocab_size: int, eos_id: int | None = None,
                 max_len: int | None = None, prefill_chunk: int | None = None,
                 cuda_graphs: bool | None = None, pad_vocab: bool = True, prefix_cache: bool = False,
                 min_prefix: int = 16, idle_prefill_chunk: int | None = None, tokenizer=None,
                 prepack: bool = False, quantize: str = "none", int4_group: int = DEFAULT_INT4_GROUP,
                 kv_dtype: torch.dtype | None = None, speculative: SpecConfig | None = None,
                 draft_model: GPT | None = None, compile: str = "off",
                 compile_max_batch: int = DEFAULT_COMPILE_MAX_BATCH, compile_cache: str | None = None,
                 before_timing=None) -> None:
        # the model and what computes with it: weights' format, KV cache, sampler, CUDA graphs, compiled step
        self.runner = ModelRunner(model, n_slots=n_slots, vocab_size=vocab_size, eos_id=eos_id, max_len=max_len,
                                  cuda_graphs=cuda_graphs, pad_vocab=pad_vocab, prepack=prepack, quantize=quantize,
                                  int4_group=int4_group, kv_dtype=kv_dtype, compile=compile,
                                  compile_max_batch=compile_max_batch, compile_cache=compile_cache,
                                  before_timing=before_timing)
        # prefix caching (engine.prefix_cache): off here; the server turns it on (GPT_PREFIX_CACHE)
        self.scheduler = Scheduler(n_slots, prefill_chunk, eos_id, prefix_cache=prefix_cache, min_prefix=min_prefix,
                                   idle_prefill_chunk=idle_prefill_chunk)
        self.tokenizer = tokenizer  # for grammars (structured output); None: requests with one are refused
        self._matchers: Matchers | None = None  # made with the first constrained request
        self.fatal_error: str | None = None  # a step's device error that no later step survives (the loop stops)
        # counters (read by stats())
        self.decode_steps = 0
        self.generated_tokens = 0
        self.max_batch_seen = 0
        self.vocab_size = vocab_size
        # prompt log-probabilities of the requests that asked, from admission to their first output
        # (the piece size is read from this module when a core is made: tests set a smaller one here)
        self._scores = PromptScorer(vocab_size, piece=PROMPT_LOGPROBS_PIECE)
        self.speculator = self._make_speculator(speculative, draft_model)

    # what the runner owns, read here as before (engine.build, the tests, the benchmarks)
    model = _runner_attr("model")
    device = _runner_attr("device")
    dtype = _runner_attr("dtype")
    max_len = _runner_attr("max_len")
    n_slots = _runner_attr("n_slots")
    kv_dtype = _runner_attr("kv_dtype")
    cache = _runner_attr("cache")
    sampler = _runner_attr("sampler")
    weights = _runner_attr("weights")
    kernels = _runner_attr("kernels")
    packed_layers = _runner_attr("packed_layers")
    weight_bytes = _runner_attr("weight_bytes")
    cuda_graphs = _runner_attr("cuda_graphs")
    compile = _runner_attr("compile")
    compile_max_batch = _runner_attr("compile_max_batch")
    compile_cache = _runner_attr("compile_cache")
    compile_seconds = _runner_attr("compile_seconds")
    compile_source = _runner_attr("compile_source")
    compile_timing = _runner_attr("compile_timing")
    attention_seconds = _runner_attr("attention_seconds")
    kv_resident_seconds = _runner_attr("kv_resident_seconds")
    warmup_error = _runner_attr("warmup_error")
    warmup_seconds = _runner_attr("warmup_seconds")
    prefill_chunks = _runner_attr("prefill_chunks")
    prompt_tokens = _runner_attr("prompt_tokens")
    copied_tokens = _runner_attr("copied_tokens")
    _graphed = _runner_attr("_graphed")
    _compiled = _runner_attr("_compiled")
    _compiling = _runner_attr("_compiling")
    _attention = _runner_attr("_attention")

    # ------------------------------------------------------------------ requests
    def add(self, request: EngineRequest) -> None:
        """Queue a request. ValueError if it can never run here (validation upstream refuses these first)."""
        p = request.params
        # validation (app/validation.py, engine.generate) applied these rules and drew the seed; here they are asserts
        check_context(len(request.prompt), max(p.max_new_tokens, 0), self.max_len, "the engine's context length")
        if p.seed is None:
            raise ValueError("the request has no seed: validation draws one (engine.params.draw_seed)")
        if p.max_new_tokens < 0:  # 0: the request only runs (and scores) its prompt
            raise ValueError(f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
        if request.prompt_logprobs is not None and request.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be None or >= 0, got {request.prompt_logprobs}")
        for name, ids in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids)):
            if bad := bad_token(ids, self.vocab_size):
                raise ValueError(f"{name}: token id {bad[1]} is out of range [0, {self.vocab_size})")
        if request.structured is not None:
            self.matchers.add(request.request_id, request.structured)  # GrammarError (a ValueError): refused
        try:
            self.scheduler.add(request)
        except ValueError:
            if request.structured is not None and request.request_id not in self.scheduler.by_id:
                self._matchers.drop(request.request_id)
            raise
        if request.prompt_logprobs is not None:
            self._scores.add(request.request_id, request.prompt_logprobs)
        if self.speculator is not None and request.speculate and p.max_new_tokens > 1:
            self.speculator.add(request.request_id, request.prompt)

    @property
    def matchers(self) -> Matchers:
        if self._matchers is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: it cannot constrain output to a grammar")
            self._matchers = Matchers(Grammars.for_tokenizer(self.tokenizer), self.n_slots, self.device)
        return self._matchers

    def abort(self, request_ids) -> None:
        self.scheduler.abort(request_ids)
        for rid in request_ids:
            self._scores.drop(rid)
            if self.speculator is not None:
                self.speculator.drop(rid)
            if self._matchers is not None:
                self._matchers.drop(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def expire(self) -> list[RequestOutput]:
        """End requests past their deadline without stepping (a paused or idle loop still enforces them)."""
        return self._outputs(self.scheduler.expire(time.monotonic()))

    def shutdown(self, message: str = "the server shut down before the request finished") -> list[RequestOutput]:
        """End every request still here with ErrorKind.SHUTDOWN."""
        return self._outputs(self.scheduler.end_all(ErrorKind.SHUTDOWN, message))

    def _outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs as they leave the core: prompt log-probabilities on first outputs; the matchers of the requests
        that ended dropped."""
        if self._matchers is not None and self._matchers:
            for out in outputs:
                if out.done:
                    self._matchers.drop(out.request_id)
        if self.speculator is not None:
            self.speculator.record(outputs)
        return self._scores.attach(outputs)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self.poll_compiled()  # the background compile may have finished: its steps go in between steps
        step = self.scheduler.schedule(time.monotonic())
        try:
            draws = self._execute(step)
        except Exception as e:  # a failing forward (e.g. out of memory) fails its requests, not the engine
            log.exception("engine step failed")
            if is_fatal_device_error(e):
                self.fatal_error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            return self._outputs(self.scheduler.fail_step(step, f"generation failed: {type(e).__name__}: {e}"))
        return self._outputs(self.scheduler.update(step, draws))

    def _execute(self, step: Step) -> list:
        """The runner computes the step (slot ops, prefill chunks, the plain decode step); the core adds the
        grammar masks, and verifies the decoding rows' proposals when the step speculates."""
        self.runner.apply(step.ops)
        masks = _StepMasks(self._matchers, step) if self._matchers else None
        batch = StepBatch(step, masks, self._scores)
        draws = self.runner.prefill(batch)
        if step.decode:
            n = len(step.decode)
            self.max_batch_seen = max(self.max_batch_seen, n)
            spec = self.speculator
            t0 = time.perf_counter() if spec is not None else 0.0
            proposals = self._proposals(step.decode)
            if proposals is not None:
                verified = self._verify(step.decode, proposals, masks)
                self.generated_tokens += sum(map(len, verified)) - n  # the tokens beyond a row's one (below)
                draws += verified
                # what the pass cost beyond a plain step, from this core's timings (engine.spec_decode.costs), and
                # what each row accepted: whether its proposals pay (engine.spec_decode.adaptive)
                positions = 1 + max(map(len, proposals))
                if self._compiled_passes(n):  # priced by the pass that ran: its padded width
                    positions = self._compiled.fill(positions - 1) + 1
                spec.costs.verify(n, positions, time.perf_counter() - t0)
                extra = spec.costs.extra(n, positions)
                for r, p, out in zip(step.decode, proposals, verified):
                    if p:
                        spec.observe(r.id, len(p), len(out) - 1, extra)
            else:
                draws += self.runner.decode(batch)
                if spec is not None:
                    spec.costs.plain(n, time.perf_counter() - t0)
            self.decode_steps += 1
        self.generated_tokens += len(draws)
        if masks:
            masks.advance(draws)
        return draws

    # ------------------------------------------------------------------ speculative decoding
    def _make_speculator(self, config: SpecConfig | None, draft_model: GPT | None) -> Speculator | None:
        if config is None or not config.enabled:
            return None
        draft = None
        if config.method == "draft":
            from engine.spec_decode.draft import DraftProposer

            if draft_model is None:
                raise ValueError("speculative method draft needs the draft model (draft_model)")
            self.runner.convert_draft(draft_model)  # the draft in the target's format
            # its cache in the served cache's dtype: engine/sizing.py budgets a slot as the two KV slots in that dtype
            draft = DraftProposer(draft_model, self.n_slots, self.vocab_size, max_len=self.max_len,
                                  kv_dtype=self.kv_dtype, p_min=config.draft_p_min)
        return Speculator(config, draft)

    def _proposals(self, decode) -> list[list[int]] | None:
        """Each decoding row's proposal, or None when this step does not speculate (speculation off, a batch above
        max_batch, no row with a proposal). A row proposes at most what it may still generate after this step's
        first token, what its cache slot has room for, and its share of VERIFY_POSITIONS."""
        spec = self.speculator
        if spec is None or len(decode) > spec.config.max_batch or not any(r.id in spec for r in decode):
            return None
        lengths = self.cache.lengths
        per_row = max(1, VERIFY_POSITIONS // len(decode) - 1)
        fill = None
        if self._compiled_passes(len(decode)):
            # a batch the compiled steps decode verifies through a compiled pass (engine.compiled_decode), within
            # its room, or not at all: an eager one costs ~4x a compiled step, and on the copy workload made for
            # speculation it cost more than it saved (docs/performance.md, "Decode steps compiled ahead of time");
            # a proposal fills the padded width it is verified in (one token more for two: same pass)
            per_row = min(per_row, self._compiled.verify_room(len(decode)))
            if per_row == 0:
                return None
            fill = self._compiled.fill
        limits = [min(r.request.params.max_new_tokens - r.generated - 1, self.max_len - lengths[i] - 1, per_row)
                  for i, r in enumerate(decode)]
        proposals = spec.propose([r.id for r in decode], limits, fill)
        if not any(proposals):
            return None
        # one padded pass: every row computes 1 + the longest proposal positions, which must fit every slot
        room = min(self.max_len - lengths[i] - 1 for i in range(len(decode)))
        return [p[:room] for p in proposals] if room > 0 else None

    def _compiled_passes(self, n: int) -> bool:
        """Whether a batch of n decoding rows verifies through compiled passes (or not at all)."""
        return self._compiled is not None and n <= self._compiled.max_batch

    def _verify(self, decode, proposals: list[list[int]], masks) -> list[list]:
        """Score every decoding row at 1 + its proposal's positions in one pass, then draw them (every position at
        once where no row's draw reads its history, `Sampler.draw_ahead`; else position by position over the rows
        whose proposals held so far): each row's draws (a list) up to and including the first that differs from its
        proposal (or the one after its last proposed token), or that ends its request (EOS, a stop id,
        max_new_tokens, a complete grammar: the scheduler's rule, engine.scheduler.finish_reason), so nothing after
        it is recorded and the accepted count is what is emitted. The slots keep the positions of the tokens
        emitted; the rest of the pass's entries lie past their lengths, to be overwritten."""
        n, spec = len(decode), self.speculator
        before = list(self.cache.lengths[:n])
        logits = self.runner.verify_logits(proposals)  # (n, T, V)
        spec.steps += 1
        eos = self.scheduler.eos_id

        def goes_on(i: int, d, j: int) -> bool:  # d, row i's draw at position j, is its proposal and ends nothing
            r = decode[i]
            return (j < len(proposals[i]) and d.token == proposals[i][j]
                    and finish_reason(r.request.params, eos, r.generated + j + 1, d) is None)

        ahead = None if masks else self.sampler.draw_ahead(logits, range(n))
        if ahead is not None:  # every position drawn in one go (a draw reads its position only), kept up to the
            # first that leaves its proposal: one sampler pass, not one a position (a 9-position greedy step of the
            # bundled model 4.7 -> 2.7 ms: docs/performance.md, "Speculation that pays for itself")
            out = []
            for i, draws in enumerate(ahead):
                j = 0
                while goes_on(i, draws[j], j):
                    j += 1
                out.append(draws[:j + 1])
            self.sampler.record_ahead(range(n), [[d.token for d in o] for o in out])
            return self._keep(decode, before, out)
        out = [[d] for d in self.sampler.step(logits[:, 0], range(n), masks.next(decode) if masks else None)]
        matchers = self._matchers if masks else None
        accept_grammar(matchers, decode, [o[0] for o in out])
        alive = [i for i in range(n) if goes_on(i, out[i][0], 0)]
        j = 1
        while alive:
            rows = device_index(alive, self.device)
            constrained = [decode[i].id for i in alive if decode[i].id in matchers] if matchers else []
            mask = matchers.fill(constrained) if constrained else None
            ds = self.sampler.step(logits[rows, j], alive, mask)
            accept_grammar(matchers, [decode[i] for i in alive], ds)
            for i, d in zip(alive, ds):
                out[i].append(d)
            alive = [i for i, d in zip(alive, ds) if goes_on(i, d, j)]
            j += 1
        return self._keep(decode, before, out)

    def _keep(self, decode, before: list[int], out: list[list]) -> list[list]:
        """The slots keep the positions of the tokens each row emits (`out`)."""
        for i in range(len(decode)):
            self.cache.truncate(i, before[i] + len(out[i]))
        return out

    # ------------------------------------------------------------------ warm-up and stats
    def warmup(self, graph_capture=None) -> None:
        """A short prefill, then a decode step and a sampled step over every slot, and a row alone, so first requests
        do not pay one-time costs (oneDNN primitive creation, the one-row kernel choice); CUDA
        graphs are captured here, last, over empty slots. `graph_capture` replaces the CUDA capture
        (engine.cuda_graphs.eager_capture: the same sequence on a CPU, for tests)."""
        self.runner.warmup(graph_capture, speculator=self.speculator)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compile and install its steps (tests, benchmarks); True when they are in use."""
        return self.runner.wait_compiled(timeout)

    def poll_compiled(self) -> bool:
        """Between steps: install the compiled steps if their background compile has finished. True when it did
        (the stats changed)."""
        return self.runner.poll_compiled()

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": s.n_running, "queued": s.n_waiting, "max_batch_size": self.n_slots,
                "max_batch_seen": self.max_batch_seen, "decode_steps": self.decode_steps,
                "prefill_chunks": self.prefill_chunks, "prompt_tokens": self.prompt_tokens,
                "prefix_cache": s.prefix is not None, "prefix_hit_tokens": s.hit_tokens,
                "prefix_copied_tokens": self.copied_tokens,
                "generated_tokens": self.generated_tokens, "cuda_graphs": self._graphed is not None,
                "compiled_decode": self._compiled is not None,
                "compiling": self._compiling is not None or self._attention is not None,
                "compile_seconds": self.compile_seconds, "compile_source": self.compile_source,
                "compile_timing": self.compile_timing,
                "warmup_seconds": self.warmup_seconds, "prepacked_layers": self.packed_layers,
                "weights": self.weights["format"],
                "weight_bytes": self.weight_bytes, "kv_bytes": self.cache.nbytes(),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
                "kv_resident": self.cache.resident, "kv_resident_seconds": self.kv_resident_seconds,
                "compiled_attention": self.cache.decode_attention is not None,
                "attention_compile_seconds": self.attention_seconds,
                "speculative": self.speculator.stats() if self.speculator is not None else None}


class _StepMasks:
    """The grammar masks of one step: the constrained requests among those sampled, filled and copied to the
    device once, at the first sampler call that needs them (after a forward pass is launched), then handed to
    each sampler call as the rows of its constrained requests."""

    def __init__(self, matchers: Matchers, step: Step) -> None:
        self.matchers = matchers
        self.sampled = step.sampled
        self.ids = [r.id for r in self.sampled if r.id in matchers]
        self.dev: torch.Tensor | None = None
        self.at = 0

    def __bool__(self) -> bool:
        return bool(self.ids)

    def next(self, reqs) -> torch.Tensor | None:
        k = sum(1 for r in reqs if r.id in self.matchers)
        if not k:
            return None
        if self.dev is None:
            self.dev = self.matchers.fill(self.ids)
        rows = self.dev[self.at:self.at + k]
        self.at += k
        return rows

    def advance(self, draws: list[RowDraws]) -> None:
        """Each constrained request's matcher takes its token; `stop` on the draws whose grammar is complete.
        (A list of draws is a verified row's: its matcher took them as they were drawn, EngineCore._verify.)"""
        rows = [(r, d) for r, d in zip(self.sampled, draws) if not isinstance(d, list)]
        accept_grammar(self.matchers, [r for r, _ in rows], [d for _, d in rows])


def accept_grammar(matchers: Matchers | None, reqs, draws: list[Draw]) -> None:
    """Constrained requests' matchers take their draws now (the next position's masks depend on them);
    `stop` on a draw whose grammar is complete or refused it."""
    if not matchers:
        return
    for r, d in zip(reqs, draws):
        if r.id in matchers:
            ok, done = matchers.accept(r.id, d.token)
            d.stop = done or not ok
            if not ok:  # the request ends with an error (Scheduler.update), not with this token
                d.failed = matchers.error(r.id)
