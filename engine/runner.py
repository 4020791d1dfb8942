"""The model runner: the model and everything that computes with it, behind the engine core (vLLM V1's
`GPUModelRunner`; the core only schedules).

    runner = ModelRunner(model, n_slots=32, vocab_size=V, eos_id=eos)
    runner.apply(step.ops)                      # the scheduler's slot ops on the cache and the sampler
    draws = runner.prefill(batch)               # the step's prompt chunks: forward passes and draws
    draws += runner.decode(batch)               # the plain decode step: compiled, graphed or eager

It owns the model and its weights' format (`model.linear.convert` / `tune` / `drop_plain`, the padded vocabulary),
the KV cache, the sampler, the CUDA graphs (engine/cuda_graphs.py), the compiled CPU decode step
(engine/compiled_decode.py: started at warm-up, installed between steps once it matches the eager step) and the
warm-up. What a step decides (which rows, which grammar masks, which proposals) comes from the core in a `StepBatch`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine import compiled_attention
from engine.cache_pages import ResidentFill
from engine.compile_cache import CachePrune, mark_in_use, setup_of
from engine.compile_gate import check_compile_memory, time_one_row
from engine.compiled_decode import DEFAULT_MAX_BATCH as DEFAULT_COMPILE_MAX_BATCH
from engine.compiled_decode import one_line
from engine.compiled_decode import resolve_mode as resolve_compile
from engine.cpu_tuning import KernelChoices
from engine.heap import release_freed_memory
from engine.ops import Admit, Copy, Draw, Free, Idle, Move, Op
from engine.params import SamplingParams
from engine.prompt_logprobs import PromptScorer
from engine.sampler import Sampler
from engine.scheduler import Step
from engine.sizing import SizingError
from model.gpt import GPT
from model.kv_cache import KVCache, device_index
from model.linear import DEFAULT_INT4_GROUP, convert, drop_plain, small_linear_forced, tune, weight_bytes

# rows a CPU's warm-up prefills and decodes (ModelRunner.warmup): a batch, and a row alone after it
CPU_WARM_ROWS = 2

if TYPE_CHECKING:
    from engine.spec_decode import Speculator

log = logging.getLogger("engine.core.runner")  # a child of engine.core: its log lines are the core's


class Masks(Protocol):
    """The step's grammar masks (engine.core's `_StepMasks`): the rows of the given requests, filled at the first
    draw that needs them (after a forward pass is launched)."""

    def next(self, reqs) -> torch.Tensor | None: ...


@dataclass
class StepBatch:
    """What the engine core hands the runner for one step: the scheduled step, the grammar masks of its constrained
    rows (None: no constrained request) and the prompt scorer of the requests that asked for prompt logprobs."""

    step: Step
    masks: Masks | None = None
    scores: PromptScorer | None = None


class ModelRunner:
    def __init__(self, model: GPT, *, n_slots: int, vocab_size: int, eos_id: int | None = None,
                 max_len: int | None = None, cuda_graphs: bool | None = None, pad_vocab: bool = True,
                 prepack: bool = False, quantize: str = "none", int4_group: int = DEFAULT_INT4_GROUP,
                 kv_dtype: torch.dtype | None = None, compile: str = "off",
                 compile_max_batch: int = DEFAULT_COMPILE_MAX_BATCH, compile_cache: str | None = None,
                 before_timing: Callable[[], object] | None = None) -> None:
        """`before_timing`: called before the first start-up timing (the core process waits there for its front's
        imports to end, engine.core_process.wait_quiet)."""
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len = max_len or model.config.block_size
        self.n_slots = n_slots
        self.kv_dtype = kv_dtype or self.dtype
        try:
            # on a CPU on untouched zero pages, made resident in the background from warm-up on (engine.cache_pages)
            self.cache = KVCache(model.config, n_slots, self.max_len, dtype=self.kv_dtype, device=self.device,
                                 resident=False)
        except (RuntimeError, OSError) as e:  # out of memory (CPU allocator, an anonymous mapping, or CUDA)
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
        self.prepack, self.quantize, self.int4_group = prepack, quantize, int4_group  # the draft's too
        # a compiled CPU decode step (engine.compiled_decode; quantized layers through their twins: model.linear)
        self.compile = resolve_compile(compile, model, self.device, self.dtype, quantize, self.kv_dtype)
        # auto keeps the compiled steps only where they beat the eager step on this machine (engine.compile_gate)
        self.compile_timed = compile == "auto" and self.compile == "on"
        self.compile_timing: dict | None = None  # that timing, once made
        self.compile_attention = compiled_attention.wanted(self.cache, compile)  # a CPU cache's decode attention
        self._attention: compiled_attention.AttentionBuild | None = None  # ... while its compile runs
        self.compile_max_batch = min(compile_max_batch, n_slots)
        self.compile_cache = compile_cache  # the compiled steps' folder (None: engine.compiled_decode's default)
        self._compiled = None  # the compiled decode steps in use (engine.compiled_decode), once checked
        self._compiling = None  # ... while their compile runs in the background
        self.cache_lock: int | None = None  # the compile cache folder of the steps held in use (engine.compile_cache)
        self.pruning: CachePrune | None = None  # the cache's stale folders being removed
        if self.converts:
            # the packed layers keep their plain weight until `tune` has copied the ones it gives MKL (no unpacking
            # through a GEMM), and when compiling for good: the graph reads them (eager keeps its kernels)
            self.weights = convert(model, quantize, int4_group, keep_plain=True)
            if self.device.type == "cpu":
                if before_timing is not None:
                    before_timing()
                choices = KernelChoices(compile_cache)
                self.kernels = tune(model, known=choices.load())
                if not small_linear_forced():  # GPT_SMALL_LINEAR's choice is not a measurement
                    choices.save(self.kernels)
            if self.compile != "on":  # compiling: until the compile has read them (_install_compiled)
                drop_plain(model)
        self.packed_layers = self.weights["swapped"] if self.weights["format"] == "none" else 0
        self.weight_bytes = weight_bytes(model)
        # decode steps from CUDA graphs (engine.cuda_graphs): on by default on CUDA, captured at warm-up
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self._graphed = None
        self.warmup_error: str | None = None
        self.warmup_seconds: float | None = None  # the warm-up's (EngineCore.warmup), once done
        self.compile_seconds: float | None = None  # the compiled decode step's start-up cost, once made
        self.compile_source: str | None = None  # "compiled" or "cache" (engine.compiled_decode)
        self.attention_seconds: float | None = None  # the compiled decode attention's build, once done
        self._filling: ResidentFill | None = None  # the lazily allocated cache's pages, made resident after warm-up
        self.kv_resident_seconds: float | None = None  # ... how long that took, once done
        # counters of what it computed (read by EngineCore.stats())
        self.prefill_chunks = 0
        self.prompt_tokens = 0  # computed (prefilled)
        self.copied_tokens = 0  # KV entries copied between slots for prefix reuse

    @property
    def converts(self) -> bool:
        """The served weights change format (quantized, or packed on a CPU)."""
        return self.quantize != "none" or (self.prepack and self.device.type == "cpu")

    def convert_draft(self, draft_model: GPT) -> None:
        """The draft model (speculative decoding) in the target's weight format."""
        if self.converts:
            convert(draft_model, self.quantize, self.int4_group, keep_plain=True)
            if self.device.type == "cpu":
                tune(draft_model)
            drop_plain(draft_model)

    # ------------------------------------------------------------------ the step
    def apply(self, ops: list[Op]) -> None:
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

    def prefill(self, batch: StepBatch) -> list[Draw]:
        """The step's prompt chunks through the model (scored for the requests that asked), and the draws of the
        rows whose prompt ends in their chunk."""
        masks, draws = batch.masks, []
        for chunk in batch.step.prefills:
            slots = chunk.slots
            if len(slots) == 1:
                idx = self.sampler.prompt_slice(slots[0], chunk.start, chunk.start + chunk.n).view(1, -1)
            else:  # the prompts are on the device already (written at admission)
                idx = self.sampler.history[device_index(slots, self.device), chunk.start:chunk.start + chunk.n]
            scoring = [i for i, r in enumerate(chunk.reqs) if r.request.prompt_logprobs is not None]
            if scoring:  # the hidden states of every position, through the head in pieces
                h = self.model.forward_cached(idx, self.cache, slots, hidden=True)
                batch.scores.score(chunk, h, scoring, self.model.head, self.sampler.history)
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
        return draws

    def decode(self, batch: StepBatch) -> list[Draw]:
        """One token for each decoding row (slots 0..n-1): drawn inside the compiled step for a plain plan
        (engine/plain_draw.py), else the logits of the compiled step, a CUDA graph or an eager pass to the sampler."""
        step, masks = batch.step, batch.masks
        n = len(step.decode)
        graphed = self._graphed or self._compiled
        kind = self.sampler.plain_kind(range(n)) if self._compiled and n <= self._compiled.max_batch else None
        if kind is not None:  # the draw is inside the compiled step (engine/plain_draw.py)
            return self.sampler.take(range(n), *self._compiled.draw(self.sampler.last[:n], n, kind))
        if graphed is not None and n <= graphed.max_batch:
            logits = graphed(self.sampler.last[:n], n)
        else:
            logits = self.model.forward_cached(self.sampler.last[:n, None], self.cache, range(n))
        return self.sampler.step(logits, range(n), masks.next(step.decode) if masks else None)

    def verify_logits(self, proposals: list[list[int]]) -> torch.Tensor:
        """The logits (n, T, V) of the decoding rows 0..n-1 fed [last, d1..dk] (padded to the longest proposal, T = 1
        + k) in one pass (speculative decoding; EngineCore._verify draws from them)."""
        T = 1 + max(len(p) for p in proposals)
        idx = device_index([[0, *p] + [0] * (T - 1 - len(p)) for p in proposals], self.device)
        idx[:, 0] = self.sampler.last[:len(proposals)]
        if self._compiled is not None and T - 1 <= self._compiled.verify_room(len(proposals)):
            return self._compiled.verify(idx)
        return self.model.forward_cached(idx, self.cache, range(len(proposals)), all_logits=True)

    # ------------------------------------------------------------------ warm-up, CUDA graphs, the compiled step
    @torch.inference_mode()
    def warmup(self, graph_capture=None, *, speculator: Speculator | None = None) -> None:
        """EngineCore.warmup: `speculator` warms its verification pass and draft. No long prefill: the longest
        chunk a step prefills (GPT-2: 1.8 s of start-up) gave a fresh server's first long prompt no measurable
        gain (docs/performance.md, "Start-up")."""
        t0 = time.perf_counter()
        # a CPU warms a few rows, not every slot: a new batch size's first step costs 2-16 ms more than its next
        # (GPT-2, oneDNN's primitives) while 32 rows of prefill and decode took ~0.3 s of the start in-process
        # and ~0.5 s in a server (docs/performance.md, "Start-up"); CUDA warms every slot before its capture
        n = self.n_slots if self.device.type != "cpu" else min(self.n_slots, CPU_WARM_ROWS)
        try:
            if self.max_len >= 3:  # a 2-token prefill of those slots at once, then a sampled decode step
                for s in range(n):
                    self.sampler.admit(s, SamplingParams(temperature=1.0, top_p=0.9), [0, 0], seed=s)
                logits = self.model.forward_cached(self.sampler.history[:n, :2], self.cache, range(n))
                self.sampler.step(logits, range(n))
                logits = self.model.forward_cached(self.sampler.last[:n, None], self.cache, range(n))
                self.sampler.step(logits, range(n))
                if self.device.type == "cpu":  # one row alone: a CPU picks its one-row matmul library per weight
                    # here (model.gpt.linear), not during the first request
                    self.model.forward_cached(self.sampler.last[:1, None], self.cache, range(1))
                spec = speculator
                if spec is not None and self.max_len >= spec.config.k + 4:  # a verification pass's shape (one row,
                    # 1 + k positions, under a mask) and the draft's passes, before the first request needs them
                    k = spec.config.k
                    self.model.forward_cached(self.sampler.last[:1, None].expand(1, k + 1).contiguous(), self.cache,
                                              range(1), all_logits=True)
                    if spec.draft is not None:
                        spec.draft.propose([("warm-up", [0, 0], k)])
                        spec.draft.drop("warm-up")
            if self.cuda_graphs or self.compile == "on":  # on empty slots: slot 0 may now hold the whole
                for s in range(n):  # context, and a captured step writes at each slot's length
                    self.cache.reset(s)
            if self.cuda_graphs:
                self._capture_graphs(graph_capture)
            if self.compile == "on":
                self._compile_decode(speculator)
            if self.compile_attention:
                self._attention = compiled_attention.AttentionBuild(self.cache, self.dtype, self.compile_cache)
                self._attention.start()
            if not self.cache.resident:  # after every start-up timing: its memory traffic would disturb them
                self._filling = ResidentFill(self.cache).start()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.warmup_seconds = round(time.perf_counter() - t0, 2)
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

    def _compile_decode(self, speculator: Speculator | None = None) -> None:
        """Start compiling the decode step of the small batch buckets on a CPU (engine.compiled_decode), in a
        background thread: the engine serves eagerly meanwhile and swaps the steps in at a step boundary. With a
        `speculator`, one row's verification pass too (its last token and up to k proposed)."""
        from engine.compiled_decode import CompiledDecode

        config, cache = self.model.config, self.cache

        def fits() -> None:  # in the compile's thread; a KV cache not yet resident (engine.cache_pages) takes its
            # memory meanwhile
            fp32_bytes = 4 * GPT.skeleton(config).num_params(non_embedding=False)  # as engine.build sizes it
            check_compile_memory(fp32_bytes, self.device, pending=0 if cache.resident else cache.nbytes())

        self._compiling = CompiledDecode(self.model, self.cache, self.compile_max_batch, sampler=self.sampler,
                                         cache_dir=self.compile_cache, before_compile=fits,
                                         verify_most=1 + speculator.config.k if speculator is not None else 0)
        self._compiling.start()
        log.info("compiling the decode step (batches up to %d) in the background; decoding eagerly meanwhile",
                 self.compile_max_batch)

    def poll_compiled(self) -> bool:
        """At a step boundary: install the compiled steps (and the cache's compiled attention) once their
        background compile has finished, and note the cache's pages made resident; True when one did (the stats
        changed)."""
        changed = False
        if self._filling is not None and self._filling.wait(0):
            self.kv_resident_seconds, self._filling = self._filling.seconds, None
            changed = True
        if self._attention is not None and self._attention.done:
            self._install_attention()
            changed = True
        if self._compiling is None or not self._compiling.done:
            return changed
        self._install_compiled()
        return True

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles and install what they made (tests, benchmarks); True when compiled
        steps are in use."""
        if self._filling is not None and self._filling.wait(timeout):
            self.kv_resident_seconds, self._filling = self._filling.seconds, None
        if self._attention is not None and self._attention.wait(timeout):
            self._install_attention()
        if self._compiling is not None and self._compiling.wait(timeout):
            self._install_compiled()
        return self._compiled is not None

    def _install_attention(self) -> None:
        built, self._attention = self._attention, None
        self.attention_seconds = built.seconds
        if built.error is not None:
            log.warning("decode attention over the %s cache not compiled (%s); attending through SDPA",
                        str(self.kv_dtype).removeprefix("torch."), built.error)
            return
        self.cache.decode_attention = built.fn
        log.info("decode attention over the %s cache %s in %.1f s", str(self.kv_dtype).removeprefix("torch."),
                 "loaded from the compile cache" if built.source == "cache" else "compiled", built.seconds)

    def _install_compiled(self) -> None:
        """Use the compiled steps if their replay equals the eager step on the live cache (and, under auto, their
        one-row step times faster: engine.compile_gate); else one log line."""
        compiled, self._compiling = self._compiling, None
        self.compile_seconds, self.compile_source = compiled.seconds, compiled.source
        if compiled.error is None and compiled.folder is not None:  # its packages exist (kept below or not): the
            # folder is held in use, and older keys of the same weights removed in the background
            self.cache_lock = mark_in_use(compiled.folder, setup_of(compiled, self.weights))
            self.pruning = CachePrune(compiled.cache_dir, compiled.folder).start()
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
        elif not self.compile_timed or self._faster(compiled):  # auto: only where faster (one log line if not)
            self._compiled = compiled
            log.info("decode steps up to %d rows %s in %.1f s (%d batch x %d context buckets x %d kinds%s: %s)",
                     compiled.max_batch, "loaded from the compile cache" if compiled.source == "cache" else
                     "compiled ahead of time by AOTInductor", compiled.seconds, len(compiled.buckets),
                     len(compiled.contexts), len(compiled.kinds),
                     f"; verification passes of {'/'.join(map(str, compiled.verify_widths))} positions"
                     if compiled.verify_widths else "", compiled.folder)
        if self._compiled is None:  # not kept: its packages go before the trim (GPT-2 int4's rejected steps
            # otherwise held 2.2 GB)
            del compiled
            gc.collect()
        release_freed_memory()  # the plain weights, what the compile freed (GPT-2's: 8.7 GB resident after it) and
        # a step not kept: engine.heap.keep_freed_memory's heap keeps freed pages mapped until trimmed

    def _faster(self, compiled) -> bool:
        """auto: whether the compiled one-row step beats the eager one here (engine.compile_gate; kept for /info);
        if not, one log line."""
        try:
            timing = time_one_row(self.model, compiled, self.cache)
        except Exception as e:  # noqa: BLE001 - a timing that fails keeps the engine eager, as a failed check does
            log.warning("timing the compiled decode step failed (%s); decoding eagerly", one_line(e))
            return False
        self.compile_timing = timing.as_dict()
        if not timing.pays:
            log.warning("the compiled decode step is no faster than eager here (%.2f ms a one-row step against "
                        "%.2f); decoding eagerly", timing.compiled_ms, timing.eager_ms)
        return timing.pays
