"""The generation engine: one worker thread owns the model and the KV-cache slots.

Scheduling (continuous / iteration-level batching). Each iteration of the worker:
1. drops waiting or running requests that were cancelled (client gone) or ran past their deadline;
2. admits waiting requests into free KV-cache slots (FIFO), resetting each slot;
3. prefills up to `prefill_chunk` prompt tokens in total, oldest admitted first, chunk by chunk: a long
   prompt takes several iterations, so running streams wait at most one chunk between their tokens;
   a request whose prompt is complete samples its first token and joins the decoding batch;
4. runs one decode step for every decoding sequence at once, samples a token for each, and frees
   the slots of the ones that finished (EOS, stop string, max_new_tokens).
Requests therefore join and leave the batch between decode steps. The sampling state of every slot
(parameters, seed, token history) lives on the model's device in `model.sampling.Sampler`, and the
noise of each token is a function of (seed, position, token id), so a seeded or greedy request gives
the same tokens alone or batched; the host keeps the detokenizer and stop strings (`Sequence`).

Decoding slots are kept contiguous (0..n-1): a request that finishes hands its slot to the last
decoding one (its cache entries are copied once), and a request whose prefill completes moves to slot
n. A decode step then reads the KV cache and the sampler state through views, feeds the sampler's
device-side last tokens back into the model, and makes one device→host copy (the chosen ids, their
log-probabilities and any top-n alternatives).

Results go back to asyncio in one `loop.call_soon_threadsafe` per step (not per token) into
per-request asyncio.Queues: a `TokenOut` per token (the last one carries `finished`), or a `Failed`.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from model.generate import Sequence, decode_step
from model.gpt import GPT
from model.kv_cache import KVCache
from model.sampling import Sampler, SamplingParams
from model.stopping import FinishReason
from model.tokenizer import Tokenizer

log = logging.getLogger("app.engine")


class EngineError(Exception):
    status = 500
    error_type = "generation"


class QueueFullError(EngineError):
    status = 429
    error_type = "overloaded"


class EngineClosedError(EngineError):
    status = 503
    error_type = "unavailable"


@dataclass
class Finished:
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    prompt_tokens: int
    text: str


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
class Failed:
    status: int
    error_type: str
    message: str


class _Disconnected:
    """Put on a request's queue when its client went away: the consumer stops."""


DISCONNECTED = _Disconnected()


class GenerationRequest:
    """One request as the engine sees it. Built on the event loop; the worker owns the slot fields."""

    def __init__(self, prompt: list[int], params: SamplingParams, tokenizer: Tokenizer, *, timeout_s: float,
                 top_n: int = 0, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.seq = Sequence(list(prompt), params, tokenizer)
        self.prompt = self.seq.prompt
        self.top_n = top_n
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.timeout_s = timeout_s
        self.deadline = self.arrival + timeout_s
        self.cancelled = False  # set from the event loop; the worker checks it every iteration
        self.disconnected = False
        self.closed = False  # Finished or Failed was delivered
        # worker-owned
        self.slot: int | None = None
        self.prefilled = 0
        self.last_token_at = 0.0

    @property
    def seed(self) -> int:
        return self.seq.seed

    # ---- event-loop side
    def cancel(self) -> None:
        self.cancelled = True

    def disconnect(self) -> None:
        """The client went away: stop generating and wake the consumer."""
        self.disconnected = True
        self.cancelled = True
        self.queue.put_nowait(DISCONNECTED)

    async def events(self, grace_s: float = 5.0) -> AsyncIterator[TokenOut | Failed]:
        """Items as they arrive; ends after the last token or a Failed, or silently when the client disconnected.

        The worker enforces the deadline; waiting past it (plus a grace) is a safety net for a worker
        stuck in one very long step.
        """
        while True:
            if not self.queue.empty():  # the common case under load: no timer, no task per token
                item = self.queue.get_nowait()
            else:
                remaining = self.deadline + grace_s - time.monotonic()
                try:
                    item = await asyncio.wait_for(self.queue.get(), timeout=max(remaining, 0.01))
                except TimeoutError:
                    self.cancel()
                    yield Failed(504, "timeout", f"the request exceeded the time limit of {self.timeout_s:g} s")
                    return
            if item is DISCONNECTED:
                return
            yield item
            if isinstance(item, Failed) or item.finished is not None:
                return


def _put_all(items: list[tuple[GenerationRequest, TokenOut | Failed]]) -> None:
    """On the event loop: hand a step's items to their requests' queues."""
    for r, item in items:
        r.queue.put_nowait(item)


class Engine:
    def __init__(self, model: GPT, tokenizer: Tokenizer, *, max_batch_size: int = 8, max_queue: int = 128,
                 prefill_chunk: int = 128, metrics=None, warmup: bool = True,
                 cuda_graphs: bool | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = model.config.block_size
        self.max_batch_size, self.max_queue, self.prefill_chunk = max_batch_size, max_queue, prefill_chunk
        self.cache = KVCache(model.config, max_batch_size, self.block_size, dtype=self.dtype, device=self.device)
        self.sampler = Sampler(max_batch_size, tokenizer.vocab_size, self.block_size, self.device)
        model.pad_vocab(self.sampler.padded)  # the sampler reads the logits in place, as whole blocks
        self.metrics = metrics
        self._warmup_enabled = warmup
        # decode steps from CUDA graphs (model.cuda_graphs): on by default on CUDA, captured at warm-up
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self._graphed = None

        self._cv = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()  # guarded by _cv
        self._prefilling: list[GenerationRequest] = []  # worker-owned from here on
        self._decoding: list[GenerationRequest] = []  # _decoding[i].slot == i
        self._free = list(range(max_batch_size))  # sorted; every free slot is >= len(_decoding)
        self._outbox: list[tuple[GenerationRequest, TokenOut | Failed]] = []
        self._stop = False
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._thread: threading.Thread | None = None

        self.accepting = True
        self.ready = threading.Event()  # set once the warm-up ran (or was skipped)
        self.warmup_error: str | None = None
        # stats (written by the worker, read anywhere)
        self.n_running = 0
        self.max_batch_seen = 0
        self.decode_steps = 0
        self.prefill_chunks = 0

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpt-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def n_queued(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict:
        return {"running": self.n_running, "queued": self.n_queued, "max_batch_size": self.max_batch_size,
                "max_batch_seen": self.max_batch_seen, "decode_steps": self.decode_steps,
                "prefill_chunks": self.prefill_chunks}

    def submit(self, req: GenerationRequest) -> None:
        with self._cv:
            if self._stop or not self.accepting:
                raise EngineClosedError("the server is shutting down and accepts no new requests")
            if self._thread is not None and not self._thread.is_alive():
                raise EngineError("the generation engine has stopped; see the server log")
            # free slots count: a burst on an idle server fills the slots first, then the queue
            if len(self._waiting) + self.n_running >= self.max_batch_size + self.max_queue:
                raise QueueFullError(f"the server is overloaded: {self.n_running} requests are running and "
                                     f"{len(self._waiting)} waiting; retry later")
            self._waiting.append(req)
            self._cv.notify()

    def pause(self) -> None:
        """Test hook: hold admission and decoding (deadlines and cancellations are still enforced)."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()
        with self._cv:
            self._cv.notify()

    def begin_drain(self) -> None:
        """Refuse new requests; the ones already accepted run to completion."""
        with self._cv:
            self.accepting = False

    def idle(self) -> bool:
        return not self._waiting and self.n_running == 0

    def wait_idle(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker; requests still waiting or running end with a 503 error."""
        with self._cv:
            self._stop = True
            self.accepting = False
            self._cv.notify()
        self._unpaused.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        with torch.inference_mode():
            if self._warmup_enabled:
                self._warmup()
            self.ready.set()
            while True:
                with self._cv:
                    self._expire_waiting()
                    if self._stop:
                        break
                    runnable = self._unpaused.is_set()
                    if runnable:
                        self._admit()
                    if not runnable or not (self._prefilling or self._decoding):
                        if not runnable and (self._prefilling or self._decoding):
                            self._check_active()
                        self._flush()
                        self._cv.wait(timeout=0.02 if (self._waiting or not runnable) else 0.5)
                        continue
                try:
                    self._step()
                except Exception as e:  # a failing forward (e.g. out of memory) must not kill the server
                    log.exception("engine step failed")
                    for r in self._prefilling + self._decoding:
                        self._finish(r, Failed(500, "generation", f"generation failed: {type(e).__name__}: {e}"))
                self._flush()
                self.n_running = len(self._prefilling) + len(self._decoding)
            # stopping
            with self._cv:
                leftover = list(self._waiting) + self._prefilling + self._decoding
                self._waiting.clear()
            for r in leftover:
                if r.slot is not None:
                    self._release(r)
                self._send(r, Failed(503, "unavailable", "the server shut down before the request finished"))
                self._count(r, 503, "shutdown")
            self._flush()
            self.n_running = 0

    def _warmup(self) -> None:
        """A short prefill, then a decode step and a sampled step over every slot, so first requests do not
        pay one-time costs (allocator growth, oneDNN primitive creation)."""
        t0 = time.perf_counter()
        n = self.max_batch_size
        try:
            if self.cache.max_len >= 3:  # a 2-token prefill of every slot at once, then a sampled decode step
                for s in range(n):
                    self.sampler.admit(s, SamplingParams(temperature=1.0, top_p=0.9), [0, 0], seed=s)
                logits = self.model.forward_cached(self.sampler.history[:n, :2], self.cache, range(n))
                self.sampler.step(logits, range(n))
                logits = decode_step(self.model, self.cache, range(n), self.sampler.last[:n])
                self.sampler.step(logits, range(n))
                if self.cuda_graphs:
                    self._capture_graphs()
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

    def _capture_graphs(self) -> None:
        """Capture the decode step per batch bucket; keep the graphs only if a replay equals eager decoding."""
        try:
            from model.cuda_graphs import GraphedDecode

            graphed = GraphedDecode(self.model, self.cache, self.max_batch_size)
            graphed.capture_all()
            if graphed.check(self.max_batch_size):
                self._graphed = graphed
                log.info("decode steps run from CUDA graphs (%d batch buckets)", len(graphed.buckets))
            else:
                log.warning("CUDA graph replay differs from eager decoding; decoding eagerly")
        except Exception as e:  # a capture that fails costs speed, never the server
            log.warning("CUDA graphs unavailable (%s: %s); decoding eagerly", type(e).__name__, e)

    def _expire_waiting(self) -> None:
        """Drop waiting requests that were cancelled or ran out of time (caller holds the lock)."""
        if not self._waiting:
            return
        now = time.monotonic()
        keep = deque()
        for r in self._waiting:
            if r.cancelled:
                self._count(r, 499, "cancelled")
            elif now > r.deadline:
                self._count(r, 504, "timeout")
                self._send(r, self._timeout_error(r))
            else:
                keep.append(r)
        if len(keep) != len(self._waiting):
            self._waiting = keep

    def _admit(self) -> None:
        while self._waiting and self._free:
            r = self._waiting.popleft()
            r.slot = self._free.pop(0)
            self.cache.reset(r.slot)
            self.sampler.admit(r.slot, r.seq.params, r.prompt, seed=r.seq.seed, top_n=r.top_n)
            r.prefilled = 0
            self._prefilling.append(r)
            if self.metrics:
                self.metrics.queue_time.observe(time.monotonic() - r.arrival)
        self.n_running = len(self._prefilling) + len(self._decoding)

    def _check_active(self) -> None:
        now = time.monotonic()
        for r in self._prefilling + self._decoding:
            if r.cancelled:
                self._release(r)
                self._count(r, 499, "cancelled")
            elif now > r.deadline:
                self._finish(r, self._timeout_error(r), count=(504, "timeout"))

    def _step(self) -> None:
        self._check_active()
        # prefill: a token budget per iteration, so decoding streams stall for at most one chunk. Prompts
        # of equal length that fit the budget together go in one forward pass (a burst of similar
        # requests reads the weights once, not once per prompt)
        budget = self.prefill_chunk
        while self._prefilling and budget > 0:
            r = self._prefilling[0]
            n = min(budget, len(r.prompt) - r.prefilled)
            group = [r]
            if r.prefilled == 0 and n == len(r.prompt):
                for q in self._prefilling[1:]:
                    if q.prefilled or len(q.prompt) != n or (len(group) + 1) * n > budget:
                        break
                    group.append(q)
            slots = [q.slot for q in group]
            if len(group) == 1:
                idx = self.sampler.prompt_slice(r.slot, r.prefilled, r.prefilled + n).view(1, -1)
            else:  # the prompts are on the device already (written at admission)
                idx = self.sampler.history[torch.tensor(slots, device=self.device), :n]
            logits = self.model.forward_cached(idx, self.cache, slots)
            self.prefill_chunks += 1
            budget -= n * len(group)
            for q in group:
                q.prefilled += n
            if r.prefilled < len(r.prompt):
                continue
            del self._prefilling[:len(group)]
            if self.metrics:
                self.metrics.prompt_tokens.inc(n * len(group))
            self._emit(self.sampler.step(logits, slots), group)
            joining = [q for q in group if not q.closed]
            for i, q in enumerate(joining):
                self._join_decoding(q, joining[i + 1:])
        # one decode step for every running sequence, slots 0..n-1
        if self._decoding:
            batch = list(self._decoding)
            n = len(batch)
            self.max_batch_seen = max(self.max_batch_seen, n)
            if self._graphed is not None:
                logits = self._graphed(self.sampler.last[:n], n)
            else:
                logits = decode_step(self.model, self.cache, range(n), self.sampler.last[:n])
            self.decode_steps += 1
            self._emit(self.sampler.step(logits, range(n)), batch)

    def _emit(self, draws, reqs: list[GenerationRequest]) -> None:
        """Hand each request its token; finished ones give their slot back (after the whole batch is read)."""
        now = time.monotonic()
        metrics = self.metrics
        done = []
        for r, d in zip(reqs, draws):
            ev = r.seq.append(d.token, d.logprob)
            n = len(r.seq.tokens)
            top = None
            if d.top is not None and r.top_n:
                top = [(t, self.tokenizer.decode([t]), v) for t, v in d.top[:r.top_n]]
            if metrics:
                if n == 1:
                    metrics.ttft.observe(now - r.arrival)
                else:
                    metrics.itl.observe(now - r.last_token_at)
            r.last_token_at = now
            out = TokenOut(n, ev.id, ev.text, ev.logprob, ev.special, top)
            if ev.finish_reason is None:
                self._send(r, out)
            else:
                out.finished = Finished(ev.finish_reason, n, r.seq.seed, len(r.prompt), r.seq.text)
                done.append((r, out, ev.finish_reason.value))
        if metrics:
            metrics.generated_tokens.inc(len(reqs))
        for r, out, reason in done:
            self._finish(r, out, count=(200, reason))

    def _send(self, r: GenerationRequest, item: TokenOut | Failed) -> None:
        if isinstance(item, Failed) or item.finished is not None:
            r.closed = True
        self._outbox.append((r, item))

    def _flush(self) -> None:
        """Deliver everything the step produced: one wake-up of each event loop, not one per token."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict = {}
        for r, item in items:
            by_loop.setdefault(r.loop, []).append((r, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                for r, _ in batch:
                    r.cancelled = True

    def _finish(self, r: GenerationRequest, item: TokenOut | Failed, count: tuple[int, str] | None = None) -> None:
        # slot and metrics first: whoever sees the result also sees the slot free and the request counted
        self._release(r)
        if count is None and isinstance(item, Failed):
            count = (item.status, "error")
        if count:
            self._count(r, *count)
        self._send(r, item)

    def _join_decoding(self, r: GenerationRequest, waiting: list[GenerationRequest] = ()) -> None:
        """A request whose prefill completed takes slot n (n = requests decoding), moving there if needed.

        `waiting`: other requests of the same prefill that join next (they hold slots too)."""
        target, src = len(self._decoding), r.slot
        if src != target:
            holder = next((q for q in [*self._prefilling, *waiting] if q.slot == target), None)
            if holder is None:  # the target is free: move
                self._move([src], [target])
                self._free.remove(target)
                bisect.insort(self._free, src)
            else:  # another prompt is being prefilled there: swap the two
                self._move([src, target], [target, src])
                holder.slot = src
            r.slot = target
        self._decoding.append(r)

    def _move(self, src: list[int], dst: list[int]) -> None:
        self.cache.move(src, dst)
        self.sampler.move(src, dst)

    def _release(self, r: GenerationRequest) -> None:
        if r.slot is None:
            return
        freed = r.slot
        if r in self._prefilling:
            self._prefilling.remove(r)
        elif freed < len(self._decoding) and self._decoding[freed] is r:
            last = len(self._decoding) - 1
            if freed != last:  # the last decoding request takes the freed slot: slots stay 0..n-1
                moved = self._decoding[last]
                self._move([last], [freed])
                moved.slot = freed
                self._decoding[freed] = moved
                freed = last
            self._decoding.pop()
        self.cache.reset(freed)
        self.sampler.release(freed)
        bisect.insort(self._free, freed)
        r.slot = None
        self.n_running = len(self._prefilling) + len(self._decoding)

    def _count(self, r: GenerationRequest, status: int, finish_reason: str) -> None:
        if self.metrics:
            self.metrics.count_request(status, finish_reason)
            self.metrics.latency.observe(time.monotonic() - r.arrival)

    @staticmethod
    def _timeout_error(r: GenerationRequest) -> Failed:
        where = f"after {len(r.seq.tokens)} generated tokens" if r.slot is not None else "while waiting in the queue"
        return Failed(504, "timeout", f"the request exceeded the time limit of {r.timeout_s:g} s ({where})")
