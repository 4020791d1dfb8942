"""The engine core: many requests through one model, step by step. No threads, no asyncio, no HTTP.

    core = EngineCore(model, n_slots=32, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eot_id)
    core.add(EngineRequest("a", prompt_ids, SamplingParams(max_new_tokens=20), seed=1))
    while core.has_work():
        for out in core.step():      # RequestOutput: new token ids, logprobs, finish or error kind
            ...

It owns the scheduler (`engine.scheduler`), the KV cache, the sampler and the CUDA graphs, and runs vLLM V1's
step: schedule → execute → update. Whoever drives it (the library's `generate`, the server's core process or
its engine thread) reads the outputs, detokenizes them and calls `abort` when a stop string ends a request.
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
from engine.compiled_decode import one_line
from engine.compiled_decode import resolve_mode as resolve_compile
from engine.ops import Admit, Copy, Draw, Free, Idle, Move, Op, RowDraws
from engine.params import SamplingParams, bad_token
from engine.prompt_logprobs import PROMPT_LOGPROBS_PIECE, PromptScorer
from engine.request import EngineRequest, ErrorKind, RequestOutput, check_context
from engine.sampler import Sampler
from engine.scheduler import Scheduler, Step, finish_reason
from engine.sizing import SizingError
from engine.spec_decode import SpecConfig, Speculator
from engine.spec_decode.config import VERIFY_POSITIONS
from engine.structured_output import Grammars, Matchers
from model.gpt import GPT
from model.kv_cache import KVCache, device_index
from model.linear import DEFAULT_INT4_GROUP, convert, drop_plain, tune, weight_bytes

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


class EngineCore:
    def __init__(self, model: GPT, *, n_slots: int, vocab_size: int, eos_id: int | None = None,
                 max_len: int | None = None, prefill_chunk: int | None = None,
                 cuda_graphs: bool | None = None, pad_vocab: bool = True, prefix_cache: bool = False,
                 min_prefix: int = 16, idle_prefill_chunk: int | None = None, tokenizer=None,
                 prepack: bool = False, quantize: str = "none", int4_group: int = DEFAULT_INT4_GROUP,
                 kv_dtype: torch.dtype | None = None, speculative: SpecConfig | None = None,
                 draft_model: GPT | None = None, compile: str = "off",
                 compile_max_batch: int = DEFAULT_COMPILE_MAX_BATCH, compile_cache: str | None = None) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len = max_len or model.config.block_size
        self.n_slots = n_slots
        self.kv_dtype = kv_dtype or self.dtype
        try:
            self.cache = KVCache(model.config, n_slots, self.max_len, dtype=self.kv_dtype, device=self.device)
        except RuntimeError as e:  # out of memory (CPU allocator or CUDA)
            raise SizingError(f"cannot allocate the KV cache ({n_slots} slots x {self.max_len} tokens): "
                              f"{type(e).__name__}: {e}") from e
        self.sampler = Sampler(n_slots, vocab_size, self.max_len, self.device, eos_id=eos_id)
        if pad_vocab:  # the sampler then reads the logits in place, as whole blocks (a server owns its model;
            model.pad_vocab(self.sampler.padded)  # the library leaves a caller's model as it is: it may train on)
        # the weights' format (model.linear): a server swaps its Linears for one copy in the layout their kernel reads
        # (prepack: oneDNN's blocked fp32/bf16 on a CPU; quantize: int8 / int4), after pad_vocab; the library leaves
        # a caller's model as it is. The one-row kernel choice is timed here, at start-up, never on a request
        self.weights = {"format": "none", "swapped": 0}
        self.kernels: dict = {}
        # a compiled CPU decode step (engine.compiled_decode); quantized weights (fbgemm's packed int8) stay eager
        self.compile = resolve_compile(compile, model, self.device, self.dtype, quantize)
        self.compile_max_batch = min(compile_max_batch, n_slots)
        self.compile_cache = compile_cache  # the compiled steps' folder (None: engine.compiled_decode's default)
        self._compiled = None  # the compiled decode steps in use (engine.compiled_decode), once checked
        self._compiling = None  # ... while their compile runs in the background
        if quantize != "none" or (prepack and self.device.type == "cpu"):
            # the packed layers keep their plain weight until `tune` has copied the ones it gives MKL (no unpacking
            # through a GEMM), and when compiling for good: the graph reads them (eager keeps its kernels)
            self.weights = convert(model, quantize, int4_group, keep_plain=True)
            if self.device.type == "cpu":
                self.kernels = tune(model)
            if self.compile != "on":  # compiling: until the compile has read them (_install_compiled)
                drop_plain(model)
        self.packed_layers = self.weights["swapped"] if self.weights["format"] == "none" else 0
        self.weight_bytes = weight_bytes(model)
        # prefix caching (engine.prefix_cache): off here; the server turns it on (GPT_PREFIX_CACHE)
        self.scheduler = Scheduler(n_slots, prefill_chunk, eos_id, prefix_cache=prefix_cache, min_prefix=min_prefix,
                                   idle_prefill_chunk=idle_prefill_chunk)
        self.tokenizer = tokenizer  # for grammars (structured output); None: requests with one are refused
        self._matchers: Matchers | None = None  # made with the first constrained request
        # decode steps from CUDA graphs (engine.cuda_graphs): on by default on CUDA, captured at warm-up
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self._graphed = None
        self.warmup_error: str | None = None
        self.compile_seconds: float | None = None  # the compiled decode step's start-up cost, once made
        self.compile_source: str | None = None  # "compiled" or "cache" (engine.compiled_decode)
        self.fatal_error: str | None = None  # a step's device error that no later step survives (the loop stops)
        # counters (read by stats())
        self.decode_steps = 0
        self.prefill_chunks = 0
        self.prompt_tokens = 0  # computed (prefilled)
        self.copied_tokens = 0  # KV entries copied between slots for prefix reuse
        self.generated_tokens = 0
        self.max_batch_seen = 0
        self.vocab_size = vocab_size
        # prompt log-probabilities of the requests that asked, from admission to their first output
        # (the piece size is read from this module when a core is made: tests set a smaller one here)
        self._scores = PromptScorer(vocab_size, piece=PROMPT_LOGPROBS_PIECE)
        self.speculator = self._make_speculator(speculative, draft_model, prepack, quantize, int4_group)

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
        if self._compiling is not None and self._compiling.done:  # the background compile has finished
            self._install_compiled()
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
        self._apply(step.ops)
        masks = _StepMasks(self._matchers, step) if self._matchers else None
        draws = []
        for chunk in step.prefills:
            slots = chunk.slots
            if len(slots) == 1:
                idx = self.sampler.prompt_slice(slots[0], chunk.start, chunk.start + chunk.n).view(1, -1)
            else:  # the prompts are on the device already (written at admission)
                idx = self.sampler.history[device_index(slots, self.device), chunk.start:chunk.start + chunk.n]
            scoring = [i for i, r in enumerate(chunk.reqs) if r.request.prompt_logprobs is not None]
            if scoring:  # the hidden states of every position, through the head in pieces
                h = self.model.forward_cached(idx, self.cache, slots, hidden=True)
                self._scores.score(chunk, h, scoring, self.model.head, self.sampler.history)
                logits = self.model.head(h[:, -1]) if chunk.sampled else None
            else:
                logits = self.model.forward_cached(idx, self.cache, slots)
            self.prefill_chunks += 1
            self.prompt_tokens += chunk.n * len(slots)
            rows = chunk.sampled
            if rows:
                mask = masks.next([chunk.reqs[i] for i in rows]) if masks else None
                if len(rows) == len(slots):
                    draws += self.sampler.step(logits, slots, mask)
                else:  # some of the group only score their prompt
                    draws += self.sampler.step(logits[device_index(rows, logits.device)],
                                               [slots[i] for i in rows], mask)
        if step.decode:
            n = len(step.decode)
            self.max_batch_seen = max(self.max_batch_seen, n)
            proposals = self._proposals(step.decode)
            if proposals is not None:
                verified = self._verify(step.decode, proposals, masks)
                self.generated_tokens += sum(map(len, verified)) - n  # the tokens beyond a row's one (below)
                draws += verified
            else:
                graphed = self._graphed or self._compiled
                kind = self.sampler.plain_kind(range(n)) if self._compiled and n <= self._compiled.max_batch else None
                if kind is not None:  # the draw is inside the compiled step (engine/plain_draw.py)
                    draws += self.sampler.take(range(n), *self._compiled.draw(self.sampler.last[:n], n, kind))
                else:
                    if graphed is not None and n <= graphed.max_batch:
                        logits = graphed(self.sampler.last[:n], n)
                    else:
                        logits = self.model.forward_cached(self.sampler.last[:n, None], self.cache, range(n))
                    draws += self.sampler.step(logits, range(n), masks.next(step.decode) if masks else None)
            self.decode_steps += 1
        self.generated_tokens += len(draws)
        if masks:
            masks.advance(draws)
        return draws

    # ------------------------------------------------------------------ speculative decoding
    def _make_speculator(self, config: SpecConfig | None, draft_model: GPT | None, prepack: bool, quantize: str,
                         int4_group: int) -> Speculator | None:
        if config is None or not config.enabled:
            return None
        draft = None
        if config.method == "draft":
            from engine.spec_decode.draft import DraftProposer

            if draft_model is None:
                raise ValueError("speculative method draft needs the draft model (draft_model)")
            if quantize != "none" or (prepack and self.device.type == "cpu"):  # the draft in the target's format
                convert(draft_model, quantize, int4_group, keep_plain=True)
                if self.device.type == "cpu":
                    tune(draft_model)
                drop_plain(draft_model)
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
        limits = [min(r.request.params.max_new_tokens - r.generated - 1, self.max_len - lengths[i] - 1, per_row)
                  for i, r in enumerate(decode)]
        proposals = spec.propose([r.id for r in decode], limits)
        if not any(proposals):
            return None
        # one padded pass: every row computes 1 + the longest proposal positions, which must fit every slot
        room = min(self.max_len - lengths[i] - 1 for i in range(len(decode)))
        return [p[:room] for p in proposals] if room > 0 else None

    def _verify(self, decode, proposals: list[list[int]], masks) -> list[list]:
        """Score every decoding row at 1 + its proposal's positions in one pass, then draw position by position
        over the rows whose proposals held so far: each row's draws (a list) up to and including the first that
        differs from its proposal (or the one after its last proposed token), or that ends its request (EOS, a stop
        id, max_new_tokens, a complete grammar: the scheduler's rule, engine.scheduler.finish_reason), so no position
        after it is drawn and the accepted count is what is emitted. The slots keep the positions of the tokens
        emitted; the rest of the pass's entries lie past their lengths, to be overwritten."""
        n, spec = len(decode), self.speculator
        T = 1 + max(len(p) for p in proposals)
        idx = device_index([[0, *p] + [0] * (T - 1 - len(p)) for p in proposals], self.device)
        idx[:, 0] = self.sampler.last[:n]
        before = list(self.cache.lengths[:n])
        logits = self.model.forward_cached(idx, self.cache, range(n), all_logits=True)  # (n, T, V)
        spec.steps += 1
        out = [[d] for d in self.sampler.step(logits[:, 0], range(n), masks.next(decode) if masks else None)]
        matchers = self._matchers if masks else None
        accept_grammar(matchers, decode, [o[0] for o in out])
        eos = self.scheduler.eos_id

        def goes_on(i: int, d, j: int) -> bool:  # d, row i's draw at position j, is its proposal and ends nothing
            r = decode[i]
            return (j < len(proposals[i]) and d.token == proposals[i][j]
                    and finish_reason(r.request.params, eos, r.generated + j + 1, d) is None)

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
        for i, r in enumerate(decode):
            self.cache.truncate(i, before[i] + len(out[i]))
            if proposals[i]:
                spec.observe(r.id, len(proposals[i]), len(out[i]) - 1)
        return out

    def _apply(self, ops: list[Op]) -> None:
        for op in ops:
            match op:
                case Admit(slot, req, keep):
                    if keep:
                        self.cache.truncate(slot, keep)
                    else:
                        self.cache.reset(slot)
                    self.sampler.admit(slot, req.params, req.prompt, seed=req.seed, top_n=req.top_n,
                                       constrained=req.structured is not None)
                case Move(src, dst):
                    self.cache.move(src, dst)
                    self.sampler.move(src, dst)
                case Copy(src, dst, n):
                    self.cache.copy_prefix(src, dst, n)
                    self.copied_tokens += n
                case Idle(slot):  # the request left; its cache entries stay for prefix reuse
                    self.sampler.release(slot)
                case Free(slot):
                    self.cache.reset(slot)
                    self.sampler.release(slot)
                case _:
                    raise TypeError(f"not a slot operation: {op!r}")

    # ------------------------------------------------------------------ warm-up and stats
    @torch.inference_mode()
    def warmup(self, graph_capture=None) -> None:
        """A short prefill, then a decode step and a sampled step over every slot, then the longest prefill a step
        makes, so first requests do not pay one-time costs (allocator growth, oneDNN primitive creation); CUDA
        graphs are captured here, last, over empty slots. `graph_capture` replaces the CUDA capture
        (engine.cuda_graphs.eager_capture: the same sequence on a CPU, for tests)."""
        t0 = time.perf_counter()
        n = self.n_slots
        try:
            if self.max_len >= 3:  # a 2-token prefill of every slot at once, then a sampled decode step
                for s in range(n):
                    self.sampler.admit(s, SamplingParams(temperature=1.0, top_p=0.9), [0, 0], seed=s)
                logits = self.model.forward_cached(self.sampler.history[:n, :2], self.cache, range(n))
                self.sampler.step(logits, range(n))
                logits = self.model.forward_cached(self.sampler.last[:n, None], self.cache, range(n))
                self.sampler.step(logits, range(n))
                if self.device.type == "cpu":  # one row alone: a CPU picks its one-row matmul library per weight
                    # here (model.gpt.linear), not during the first request
                    self.model.forward_cached(self.sampler.last[:1, None], self.cache, range(1))
                spec = self.speculator
                if spec is not None and self.max_len >= spec.config.k + 4:  # a verification pass's shape (one row,
                    # 1 + k positions, under a mask) and the draft's passes, before the first request needs them
                    k = spec.config.k
                    self.model.forward_cached(self.sampler.last[:1, None].expand(1, k + 1).contiguous(), self.cache,
                                              range(1), all_logits=True)
                    if spec.draft is not None:
                        spec.draft.propose([("warm-up", [0, 0], k)])
                        spec.draft.drop("warm-up")
                # the longest prompt one step prefills, once (vLLM's start-up profile run does the same): the heap
                # grows to it here, not during the first long request (the core process keeps freed memory,
                # engine/core_process.py). GPT-2 124M, 2 CPU cores: +0.6 s of start-up; a fresh server's first
                # distinct 512-token prompt 294-350 ms against ~300-320 for those after it (372-429 ms before)
                longest = min(self.max_len, self.scheduler.idle_prefill_chunk or self.max_len)
                if longest > 2:
                    self.cache.reset(0)
                    self.model.forward_cached(torch.zeros(1, longest, dtype=torch.long, device=self.device),
                                              self.cache, [0])
            if self.cuda_graphs or self.compile == "on":  # on empty slots: slot 0 may now hold the whole
                for s in range(n):  # context, and a captured step writes at each slot's length
                    self.cache.reset(s)
            if self.cuda_graphs:
                self._capture_graphs(graph_capture)
            if self.compile == "on":
                self._compile_decode()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            log.info("warm-up done in %.0f ms", (time.perf_counter() - t0) * 1000)
        except Exception as e:
            self.warmup_error = f"warm-up generation failed: {type(e).__name__}: {e}"
            log.error(self.warmup_error)
        finally:
            for s in range(n):
                self.cache.reset(s)
                self.sampler.release(s)

    def _capture_graphs(self, capture=None) -> None:
        """Capture the decode step per (batch, context) bucket; keep the graphs only if a replay equals eager
        decoding."""
        try:
            from engine.cuda_graphs import GraphedDecode

            graphed = GraphedDecode(self.model, self.cache, self.n_slots, capture=capture)
            graphed.capture_all()
            if graphed.check(self.n_slots):
                self._graphed = graphed
                log.info("decode steps run from CUDA graphs (%d batch x %d context buckets)", len(graphed.buckets),
                         len(graphed.contexts))
            else:
                log.warning("CUDA graph replay differs from eager decoding; decoding eagerly")
        except Exception as e:  # a capture that fails costs speed, never the server
            log.warning("CUDA graphs unavailable (%s: %s); decoding eagerly", type(e).__name__, e)

    def _compile_decode(self) -> None:
        """Start compiling the decode step of the small batch buckets on a CPU (engine.compiled_decode), in a
        background thread: the engine serves eagerly meanwhile and swaps the steps in at a step boundary."""
        from engine.compiled_decode import CompiledDecode

        self._compiling = CompiledDecode(self.model, self.cache, self.compile_max_batch, sampler=self.sampler,
                                         cache_dir=self.compile_cache)
        self._compiling.start()
        log.info("compiling the decode step (batches up to %d) in the background; decoding eagerly meanwhile",
                 self.compile_max_batch)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compile and install its steps (tests, benchmarks); True when they are in use."""
        if self._compiling is not None and self._compiling.wait(timeout):
            self._install_compiled()
        return self._compiled is not None

    def _install_compiled(self) -> None:
        """Use the compiled steps if their replay equals the eager step on the live cache; else one log line."""
        compiled, self._compiling = self._compiling, None
        self.compile_seconds, self.compile_source = compiled.seconds, compiled.source
        drop_plain(self.model)  # the compile has read the plain weights (or failed): eager steps never do
        try:
            same = compiled.error is None and compiled.check()
        except Exception as e:  # noqa: BLE001 - a failing check costs speed, never the engine
            compiled.error = one_line(e)
            same = False
        if compiled.error is not None:
            log.warning("decode step not compiled (%s); decoding eagerly", compiled.error)
        elif not same:
            log.warning("the compiled decode step differs from eager decoding; decoding eagerly")
        else:
            self._compiled = compiled
            log.info("decode steps up to %d rows %s in %.1f s (%d batch x %d context buckets x %d kinds: %s)",
                     compiled.max_batch, "loaded from the compile cache" if compiled.source == "cache" else
                     "compiled ahead of time by AOTInductor", compiled.seconds, len(compiled.buckets),
                     len(compiled.contexts), len(compiled.kinds), compiled.folder)

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": s.n_running, "queued": s.n_waiting, "max_batch_size": self.n_slots,
                "max_batch_seen": self.max_batch_seen, "decode_steps": self.decode_steps,
                "prefill_chunks": self.prefill_chunks, "prompt_tokens": self.prompt_tokens,
                "prefix_cache": s.prefix is not None, "prefix_hit_tokens": s.hit_tokens,
                "prefix_copied_tokens": self.copied_tokens,
                "generated_tokens": self.generated_tokens, "cuda_graphs": self._graphed is not None,
                "compiled_decode": self._compiled is not None, "compiling": self._compiling is not None,
                "compile_seconds": self.compile_seconds, "compile_source": self.compile_source,
                "prepacked_layers": self.packed_layers, "weights": self.weights["format"],
                "weight_bytes": self.weight_bytes, "kv_bytes": self.cache.nbytes(),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
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
