"""The continuous-batching engine on its own (no HTTP): batching is invisible in the results,
prefill is chunked and interleaved, and cancelled / expired / failed requests free their slots."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.engine import Engine, EngineClosedError, Failed, GenerationRequest, QueueFullError, TokenOut
from model.checkpoint import load_checkpoint
from model.sampling import SamplingParams
from tests.test_app_support import one_torch_thread, reference_generate, slow_model, tiny_ckpt  # noqa: F401

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ckpt(tiny_ckpt):  # noqa: F811
    return load_checkpoint(tiny_ckpt)


@pytest.fixture
def make_engine(ckpt):
    engines = []

    def make(**kw) -> Engine:
        kw = {"max_batch_size": 8, "max_queue": 32, "prefill_chunk": 32, **kw}
        e = Engine(ckpt.model, ckpt.tokenizer, **kw)
        e.start()
        assert e.ready.wait(10)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()


def request(ckpt, prompt, timeout_s=10.0, top_n=0, **params) -> GenerationRequest:
    return GenerationRequest(ckpt.tokenizer.encode(prompt), SamplingParams(**params), ckpt.tokenizer,
                             timeout_s=timeout_s, top_n=top_n)


async def drain(req: GenerationRequest) -> list[TokenOut | Failed]:
    return [item async for item in req.events()]


async def run(engine: Engine, req: GenerationRequest) -> list[TokenOut | Failed]:
    engine.submit(req)
    return await drain(req)


def summary(items):
    assert isinstance(items[-1], TokenOut) and items[-1].finished is not None, items[-1]
    return [t.id for t in items], items[-1].finished.text, items[-1].finished.finish_reason


async def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


CASES = [
    ("hello", dict(max_new_tokens=20, temperature=0)),
    ("The king is dead", dict(max_new_tokens=7, temperature=0)),
    ("abc", dict(max_new_tokens=30, temperature=0, repetition_penalty=1.3)),
    ("to be or not to be", dict(max_new_tokens=25, temperature=0.9, seed=1)),
    ("x", dict(max_new_tokens=40, temperature=1.0, top_k=5, seed=2)),
    ("once upon a time", dict(max_new_tokens=12, temperature=1.2, top_p=0.8, seed=3)),
    ("the the the", dict(max_new_tokens=33, temperature=0.7, top_k=20, top_p=0.9, seed=4, repetition_penalty=1.1)),
    ("stop here", dict(max_new_tokens=50, temperature=1.5, seed=5, stop=["e", "q"])),
]


def test_batched_equals_solo_and_really_batches(ckpt, make_engine):
    engine = make_engine()

    async def main():
        solo = []
        for prompt, params in CASES:  # one at a time: each runs alone in the batch
            solo.append(summary(await run(engine, request(ckpt, prompt, **params))))
        assert engine.max_batch_seen == 1

        # five start together, three more join while they run (continuous batching)
        reqs = [request(ckpt, p, **kw) for p, kw in CASES]
        engine.pause()
        for r in reqs[:5]:
            engine.submit(r)
        engine.resume()
        tasks = [asyncio.create_task(drain(r)) for r in reqs[:5]]
        await wait_for(lambda: len(reqs[0].seq.tokens) >= 2)
        for r in reqs[5:]:
            engine.submit(r)
        tasks += [asyncio.create_task(drain(r)) for r in reqs[5:]]
        batched = [summary(items) for items in await asyncio.gather(*tasks)]
        return solo, batched

    solo, batched = asyncio.run(main())
    assert batched == solo
    assert engine.max_batch_seen > 1
    assert engine.n_running == 0 and engine.n_queued == 0
    # and the solo engine results are model.generate's (an independent reference)
    for (prompt, params), (ids, text, _) in zip(CASES[:1] + CASES[3:4], solo[:1] + solo[3:4]):
        ref = reference_generate(ckpt.path, prompt, **params)
        assert ids == ref.tokens and text == ref.text


def test_a_burst_prefills_together_and_finishing_requests_keep_slots_compact(ckpt, make_engine):
    # equal-length prompts that arrive together share one prefill pass; they finish at different
    # steps (max_new_tokens 1..9), so finished slots are handed to the last decoding request (moves),
    # and a prefill that completes behind another one swaps slots: tokens stay each request's solo ones
    engine = make_engine(prefill_chunk=64)
    lengths = [1, 5, 2, 9, 3, 7, 1, 4]
    kinds = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.0, top_k=5), dict(temperature=0.7, repetition_penalty=1.3)]

    def make():
        return [request(ckpt, "the king", max_new_tokens=n, seed=i, **kinds[i % len(kinds)])
                for i, n in enumerate(lengths)]

    async def main():
        solo = [summary(await run(engine, r)) for r in make()]
        reqs = make()
        engine.pause()
        for r in reqs:
            engine.submit(r)
        chunks = engine.prefill_chunks
        engine.resume()
        burst = [summary(items) for items in await asyncio.gather(*(drain(r) for r in reqs))]
        return solo, burst, engine.prefill_chunks - chunks

    solo, burst, passes = asyncio.run(main())
    assert burst == solo
    assert passes < len(lengths)  # grouped: fewer forward passes than prompts
    assert engine.n_running == 0 and sorted(engine._free) == list(range(engine.max_batch_size))


def test_waves_of_mixed_requests_through_few_slots_give_solo_results(ckpt, make_engine):
    # 16 requests of different prompt lengths and output lengths in waves through 4 slots and a small
    # prefill budget: slots are reused, chunked prefills overlap decoding, finished requests hand their
    # slots over (moves) and completed prefills swap with ones still prefilling
    engine = make_engine(max_batch_size=4, prefill_chunk=8)
    prompts = ["a", "the king is dead long live the king", "to be", "once upon a time there was"]

    def make():
        return [request(ckpt, prompts[i % 4] * (1 + i % 3), max_new_tokens=3 + (i * 7) % 11, seed=i,
                        temperature=0 if i % 2 else 0.9, top_p=0.9 if i % 3 == 0 else 1.0) for i in range(16)]

    async def main():
        solo = [summary(await run(engine, r)) for r in make()]
        reqs = make()
        tasks = []
        for wave in range(4):
            for r in reqs[wave * 4:(wave + 1) * 4]:
                engine.submit(r)
                tasks.append(asyncio.create_task(drain(r)))
            await asyncio.sleep(0.01)
        return solo, [summary(items) for items in await asyncio.gather(*tasks)]

    solo, mixed = asyncio.run(main())
    assert mixed == solo
    assert engine.n_running == 0 and sorted(engine._free) == list(range(4))


def test_logprobs_match_between_solo_and_batch(ckpt, make_engine):
    engine = make_engine()

    async def main():
        alone = await run(engine, request(ckpt, "hello", max_new_tokens=10, temperature=0))
        reqs = [request(ckpt, p, max_new_tokens=10, temperature=0) for p in ("hello", "abc", "xyz zy")]
        engine.pause()
        for r in reqs:
            engine.submit(r)
        engine.resume()
        return alone, (await asyncio.gather(*(drain(r) for r in reqs)))[0]

    alone, batched = asyncio.run(main())
    assert [t.logprob for t in batched] == pytest.approx([t.logprob for t in alone], abs=1e-4)


def test_long_prompt_prefill_is_chunked_and_interleaved(ckpt, make_engine):
    engine = make_engine(prefill_chunk=16)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 3  # ~120 byte-level tokens
    n_long = len(ckpt.tokenizer.encode(long_prompt))
    assert n_long > 5 * 16

    async def main():
        a = request(ckpt, "hi", max_new_tokens=30, temperature=0)
        engine.submit(a)
        await wait_for(lambda: len(a.seq.tokens) >= 1)
        b = request(ckpt, long_prompt, max_new_tokens=3, temperature=0)
        assert len(b.prompt) + 3 <= 128
        seen = {}
        send = engine._send

        def spy(r, item):  # runs on the engine thread, when b's first token is produced
            if r is b:
                seen.setdefault("a_tokens_at_b_first", len(a.seq.tokens))
            send(r, item)

        engine._send = spy
        chunks_before = engine.prefill_chunks
        a_before = len(a.seq.tokens)
        engine.submit(b)
        await asyncio.gather(drain(a), drain(b))
        return seen["a_tokens_at_b_first"] - a_before, engine.prefill_chunks - chunks_before

    a_progress, chunks = asyncio.run(main())
    assert chunks == -(-n_long // 16)  # the prompt went in 16-token chunks
    assert a_progress >= chunks - 1  # the running stream got a token after every chunk


def test_chunked_prefill_gives_the_same_tokens(ckpt, make_engine):
    prompt = "all the world's a stage, and all the men and women merely players"

    async def go(engine):
        return summary(await run(engine, request(ckpt, prompt, max_new_tokens=20, temperature=0)))

    small, big = make_engine(prefill_chunk=7), make_engine(prefill_chunk=512)
    assert asyncio.run(go(small)) == asyncio.run(go(big))
    assert small.prefill_chunks > big.prefill_chunks


def test_cancel_frees_the_slot_within_a_step(ckpt, make_engine):
    engine = make_engine(max_batch_size=1)
    slow_model(engine, 0.005)

    async def main():
        a = request(ckpt, "hello", max_new_tokens=100, temperature=0)
        engine.submit(a)
        await wait_for(lambda: len(a.seq.tokens) >= 2)
        a.cancel()
        steps = engine.decode_steps
        await wait_for(lambda: engine.n_running == 0)
        assert engine.decode_steps - steps <= 1
        assert len(a.seq.tokens) < 100
        b = request(ckpt, "abc", max_new_tokens=5, temperature=0)  # reuses the only slot
        return summary(await run(engine, b))

    ids, _, reason = asyncio.run(main())
    assert len(ids) == 5 and reason.value == "length"


def test_admission_counts_free_slots_and_refuses_past_slots_plus_queue(ckpt, make_engine):
    engine = make_engine(max_batch_size=2, max_queue=2)

    async def main():
        engine.pause()  # a burst that arrives before the worker admits anything
        reqs = [request(ckpt, "a", max_new_tokens=3) for _ in range(4)]  # slots + queue
        for r in reqs:
            engine.submit(r)
        with pytest.raises(QueueFullError):
            engine.submit(request(ckpt, "b", max_new_tokens=3))
        assert engine.n_queued == 4
        engine.resume()
        return await asyncio.gather(*(drain(r) for r in reqs))

    for items in asyncio.run(main()):
        assert items[-1].finished is not None


def test_timeout_while_waiting_and_while_running(ckpt, make_engine):
    engine = make_engine(max_batch_size=1)

    async def waiting():
        engine.pause()
        r = request(ckpt, "a", timeout_s=0.1, max_new_tokens=3)
        engine.submit(r)
        items = await drain(r)
        engine.resume()
        return items

    items = asyncio.run(waiting())
    assert len(items) == 1 and isinstance(items[0], Failed)
    assert (items[0].status, items[0].error_type) == (504, "timeout") and "queue" in items[0].message

    restore = slow_model(engine, 0.02)

    async def running():
        r = request(ckpt, "a", timeout_s=0.3, max_new_tokens=100, temperature=0)
        engine.submit(r)
        t0 = time.monotonic()
        items = await drain(r)
        return items, time.monotonic() - t0

    items, took = asyncio.run(running())
    assert isinstance(items[-1], Failed) and items[-1].status == 504 and "generated tokens" in items[-1].message
    assert len(items) > 1 and took < 2  # tokens came, then the deadline ended it (no hang)
    restore()
    asyncio.run(asyncio.sleep(0.05))
    assert engine.n_running == 0


def test_stop_ends_leftover_requests_with_503(ckpt, make_engine):
    engine = make_engine()

    async def main():
        engine.pause()
        r = request(ckpt, "a", max_new_tokens=3)
        engine.submit(r)
        await asyncio.to_thread(engine.stop)
        items = await drain(r)
        with pytest.raises(EngineClosedError):
            engine.submit(request(ckpt, "b", max_new_tokens=3))
        return items

    items = asyncio.run(main())
    assert isinstance(items[0], Failed) and items[0].status == 503


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(ckpt, make_engine):
    engine = make_engine()
    original = engine.model.forward_cached
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return original(*a, **kw)

    engine.model.forward_cached = flaky
    try:
        async def main():
            first = await run(engine, request(ckpt, "a", max_new_tokens=3))
            second = await run(engine, request(ckpt, "a", max_new_tokens=3))
            return first, second

        first, second = asyncio.run(main())
    finally:
        engine.model.__dict__.pop("forward_cached", None)
    assert isinstance(first[-1], Failed) and first[-1].status == 500 and "boom" in first[-1].message
    assert second[-1].finished is not None and engine.n_running == 0


def test_top_n_alternatives(ckpt, make_engine):
    engine = make_engine()
    async def main():
        return await run(engine, request(ckpt, "hello", top_n=3, max_new_tokens=4, temperature=0))

    items = asyncio.run(main())
    for t in items:
        assert len(t.top) == 3
        assert t.top[0][0] == t.id and t.top[0][2] == pytest.approx(t.logprob, abs=1e-5)  # greedy: the best one
        assert [v for *_, v in t.top] == sorted((v for *_, v in t.top), reverse=True)


def test_seed_is_reported_and_reproducible(ckpt, make_engine):
    engine = make_engine()

    async def main():
        a = await run(engine, request(ckpt, "hi", max_new_tokens=15, temperature=1.0))  # random seed, reported
        seed = a[-1].finished.seed
        b = await run(engine, request(ckpt, "hi", max_new_tokens=15, temperature=1.0, seed=seed))
        return a, b

    a, b = asyncio.run(main())
    assert summary(a) == summary(b)
