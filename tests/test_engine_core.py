"""The engine core on its own (model/engine_core.py), driven step by step as the library and the server drive it:
batching is invisible in the results, chunked prefill changes nothing, a failing step fails its requests and the
core goes on."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.engine_core import EngineCore
from model.engine_io import EngineRequest, ErrorKind
from model.generate import generate
from model.sampling import SamplingParams
from tests.test_app_support import one_torch_thread, tiny_ckpt  # noqa: F401

CASES = [
    ("hello", dict(max_new_tokens=20, temperature=0)),
    ("abc", dict(max_new_tokens=30, temperature=0, repetition_penalty=1.3)),
    ("to be or not to be", dict(max_new_tokens=25, temperature=0.9, seed=1)),
    ("x", dict(max_new_tokens=40, temperature=1.0, top_k=5, seed=2)),
    ("once upon a time", dict(max_new_tokens=12, temperature=1.2, top_p=0.8, seed=3)),
    ("the the the", dict(max_new_tokens=33, temperature=0.7, top_k=20, top_p=0.9, seed=4, presence_penalty=0.5)),
]


@pytest.fixture
def ckpt(tiny_ckpt):  # noqa: F811
    return load_checkpoint(tiny_ckpt)


def drive(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list]:
    for r in requests:
        core.add(r)
    out: dict[str, list] = {r.request_id: [] for r in requests}
    while core.has_work():
        for o in core.step():
            out[o.request_id].append(o)
    return out


def requests(ckpt, cases=CASES) -> list[EngineRequest]:
    return [EngineRequest(str(i), ckpt.tokenizer.encode(p), SamplingParams(**kw), seed=kw.get("seed", 0), top_n=2)
            for i, (p, kw) in enumerate(cases)]


@pytest.mark.parametrize("chunk", [None, 3])
def test_batched_and_chunked_equal_the_library_solo(ckpt, chunk):
    core = EngineCore(ckpt.model, n_slots=3, vocab_size=ckpt.tokenizer.vocab_size, eos_id=ckpt.tokenizer.eot_id,
                      prefill_chunk=chunk)  # 6 requests through 3 slots: waves, joins, compaction
    got = drive(core, requests(ckpt))
    for i, (prompt, kw) in enumerate(CASES):
        solo = generate(ckpt.model, ckpt.tokenizer, [ckpt.tokenizer.encode(prompt)],
                        SamplingParams(**{**kw, "seed": kw.get("seed", 0)}))[0]
        outs = got[str(i)]
        assert [o.token_ids[0] for o in outs] == solo.tokens, (prompt, kw)
        assert [o.logprobs[0] for o in outs] == pytest.approx([e.logprob for e in solo.events], abs=1e-4)
        assert outs[-1].finish is not None and all(o.finish is None for o in outs[:-1])
        assert all(len(o.top[0]) == 2 for o in outs)
        assert outs[0].queue_s is not None


def test_greedy_equals_full_recompute(ckpt):
    core = EngineCore(ckpt.model, n_slots=2, vocab_size=ckpt.tokenizer.vocab_size, eos_id=None, prefill_chunk=4)
    prompt = ckpt.tokenizer.encode("The king is dead")
    got = drive(core, [EngineRequest("a", prompt, SamplingParams(max_new_tokens=15, temperature=0), seed=0)])
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(15):
            logits, _ = ckpt.model(torch.tensor([ids]))
            ids.append(int(logits[0, -1, : ckpt.tokenizer.vocab_size].argmax()))
    assert [o.token_ids[0] for o in got["a"]] == ids[len(prompt):]


def test_a_failing_step_fails_its_requests_and_the_core_goes_on(ckpt, monkeypatch):
    core = EngineCore(ckpt.model, n_slots=2, vocab_size=ckpt.tokenizer.vocab_size, eos_id=ckpt.tokenizer.eot_id)
    original = ckpt.model.forward_cached
    monkeypatch.setattr(ckpt.model, "forward_cached", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("oom")))
    core.add(requests(ckpt)[0])
    (out,) = core.step()
    assert out.error == ErrorKind.FAILED and "oom" in out.message
    monkeypatch.setattr(ckpt.model, "forward_cached", original)
    got = drive(core, requests(ckpt)[:2])
    assert all(outs[-1].finish is not None for outs in got.values())


def test_requests_that_cannot_fit_are_refused(ckpt):
    core = EngineCore(ckpt.model, n_slots=1, vocab_size=ckpt.tokenizer.vocab_size, max_len=16)
    with pytest.raises(ValueError, match="context"):
        core.add(EngineRequest("a", [1] * 10, SamplingParams(max_new_tokens=10), seed=0))
    with pytest.raises(ValueError, match="empty"):
        core.add(EngineRequest("b", [], SamplingParams(), seed=0))


def test_shutdown_ends_everything_with_shutdown(ckpt):
    core = EngineCore(ckpt.model, n_slots=1, vocab_size=ckpt.tokenizer.vocab_size)
    for r in requests(ckpt)[:3]:
        core.add(r)
    core.step()
    outs = core.shutdown()
    assert sorted(o.request_id for o in outs) == ["0", "1", "2"] and {o.error for o in outs} == {ErrorKind.SHUTDOWN}
    assert not core.has_work()
