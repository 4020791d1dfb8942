"""The engine core on its own (engine/core.py), driven step by step as the library and the server drive it:
batching is invisible in the results, chunked prefill changes nothing, a failing step fails its requests and the
core goes on."""

from __future__ import annotations

import pytest
import torch

from engine.core import EngineCore
from engine.generate import generate
from engine.params import SamplingParams
from engine.request import EngineRequest, ErrorKind
from model import zero_pages
from model.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [
    ("hello", dict(max_new_tokens=20, temperature=0)),
    ("abc", dict(max_new_tokens=30, temperature=0, repetition_penalty=1.3)),
    ("to be or not to be", dict(max_new_tokens=25, temperature=0.9, seed=1)),
    ("x", dict(max_new_tokens=40, temperature=1.0, top_k=5, seed=2)),
    ("once upon a time", dict(max_new_tokens=12, temperature=1.2, top_p=0.8, seed=3)),
    ("the the the", dict(max_new_tokens=33, temperature=0.7, top_k=20, top_p=0.9, seed=4, presence_penalty=0.5)),
]


@pytest.fixture
def ckpt(tiny_ckpt):
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


# ---------------------------------------------------------------------------------------------- prefix caching
def conversation(core: EngineCore, ckpt, params: dict, turns: int = 4, top_n: int = 2) -> list[list]:
    """Turns of one chat, each prompt = the previous prompt + its reply + new text; plus an unrelated request and
    a sibling that shares the first turn, interleaved so reuse comes from idle and from running slots."""
    tok = ckpt.tokenizer
    prompt = tok.encode("ROMEO: what light? JULIET: ")  # the tiny model's context is 128 bytes
    results = []
    for t in range(turns):
        reqs = [EngineRequest(f"t{t}", list(prompt), SamplingParams(**params), seed=11 + t, top_n=top_n),
                EngineRequest(f"o{t}", tok.encode(f"unrelated {t} "), SamplingParams(**params), seed=5, top_n=top_n)]
        if t:
            reqs.append(EngineRequest(f"s{t}", results[0][0] + tok.encode(" and then"), SamplingParams(**params),
                                      seed=7, top_n=top_n))
        got = drive(core, reqs)
        outs = got[f"t{t}"]
        results.append((list(prompt), sum(len(r.prompt) for r in reqs), got))
        prompt = prompt + [o.token_ids[0] for o in outs] + tok.encode(f" t{t}: more ")
    return results


@pytest.mark.parametrize("params", [
    dict(max_new_tokens=12, temperature=0),
    dict(max_new_tokens=12, temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.4),
    dict(max_new_tokens=12, temperature=1.0, top_k=8, frequency_penalty=0.3),
])
@pytest.mark.parametrize("chunk", [None, 5])
def test_a_reused_prefix_gives_the_tokens_of_a_fresh_prefill(ckpt, params, chunk):
    kw = dict(n_slots=3, vocab_size=ckpt.tokenizer.vocab_size, eos_id=None, prefill_chunk=chunk)
    fresh = conversation(EngineCore(ckpt.model, **kw), ckpt, params)
    core = EngineCore(ckpt.model, **kw, prefix_cache=True, min_prefix=4)
    cached = conversation(core, ckpt, params)
    hits = 0
    for (p0, _, got0), (p1, _, got1) in zip(fresh, cached):
        assert p0 == p1
        for rid, outs0 in got0.items():
            outs1 = got1[rid]
            # greedy and seeded sampled requests: the same tokens; logprobs and top-n as a fresh prefill gives them
            # (the margins of this model's top two logits are far above the last bits a batch shape can change)
            assert [o.token_ids for o in outs1] == [o.token_ids for o in outs0], rid
            assert [o.logprobs[0] for o in outs1] == pytest.approx([o.logprobs[0] for o in outs0], abs=1e-4)
            assert [[i for i, _ in o.top[0]] for o in outs1] == [[i for i, _ in o.top[0]] for o in outs0]
            assert outs0[0].cached_tokens == 0
            hits += outs1[0].cached_tokens
    s = core.stats()
    assert hits > 100 and s["prefix_hit_tokens"] == hits  # the metric counts reused tokens exactly
    total = sum(n for _, n, _ in cached)
    assert s["prompt_tokens"] == total - hits  # and computed ones: every prompt token is one or the other


def test_margins_of_the_reuse_test_set_are_not_tiny(ckpt):
    """The equality above is only promised where a last-bit difference cannot flip the argmax: check the set."""
    kw = dict(n_slots=3, vocab_size=ckpt.tokenizer.vocab_size, eos_id=None)
    for _, _, got in conversation(EngineCore(ckpt.model, **kw), ckpt, dict(max_new_tokens=12, temperature=0)):
        for outs in got.values():
            assert min(o.top[0][0][1] - o.top[0][1][1] for o in outs) > 1e-3


# ------------------------------------------------------------------------------------------ prompt log-probabilities
def reference_scores(model, prompt: list[int], vocab: int, top: int):
    """A full forward over the whole prompt (fp32): log_softmax at each position, for tokens 1.."""
    with torch.inference_mode():
        logits, _ = model(torch.tensor([prompt]))
    lsm = torch.log_softmax(logits[0, :, :vocab].float(), -1)
    lps = [lsm[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    ranks = [int((lsm[i - 1] > lsm[i - 1, prompt[i]]).sum()) + 1 for i in range(1, len(prompt))]
    tops = lsm[:-1].topk(top, -1)
    return lps, ranks, tops


@pytest.mark.parametrize("piece", [None, 3 * 300])  # the engine's default piece, and 3 rows per head piece
def test_prompt_logprobs_equal_a_full_forward_chunked_and_batched(ckpt, monkeypatch, piece):
    import engine.core as engine_core

    if piece is not None:
        monkeypatch.setattr(engine_core, "PROMPT_LOGPROBS_PIECE", piece)
    tok, V = ckpt.tokenizer, ckpt.tokenizer.vocab_size
    long_prompt = tok.encode("the king is dead, long live the king; the the then there")  # > 2 chunks of 7
    short = tok.encode("hello")
    refs = {p: reference_scores(ckpt.model, list(p), V, 3) for p in (tuple(long_prompt), tuple(short))}
    core = EngineCore(ckpt.model, n_slots=3, vocab_size=V, eos_id=tok.eot_id, prefill_chunk=7)
    reqs = requests(ckpt)[:3] + [
        EngineRequest("long", long_prompt, SamplingParams(max_new_tokens=5, temperature=0), seed=0,
                      prompt_logprobs=3),
        EngineRequest("score", long_prompt, SamplingParams(max_new_tokens=0), seed=0, prompt_logprobs=0),
        EngineRequest("short", short, SamplingParams(max_new_tokens=3, temperature=0.8), seed=5, top_n=1,
                      prompt_logprobs=2)]
    rows_seen = []
    head = ckpt.model.head
    monkeypatch.setattr(ckpt.model, "head", lambda h: rows_seen.append(h.shape[0]) or head(h))
    got = drive(core, reqs)
    piece_rows = engine_core.PROMPT_LOGPROBS_PIECE // V
    # never the prompt x vocabulary at once: at most a chunk's rows (7), and at most a piece's
    assert max(rows_seen) <= min(max(piece_rows, 3), 7) < len(long_prompt)
    for rid, prompt, k in (("long", long_prompt, 3), ("score", long_prompt, 0), ("short", short, 2)):
        outs = got[rid]
        pl = outs[0].prompt_logprobs
        assert pl is not None and all(o.prompt_logprobs is None for o in outs[1:])
        lps, ranks, tops = refs[tuple(prompt)]
        assert len(pl.logprobs) == len(prompt) and pl.logprobs[0] is None and pl.ranks[0] is None
        assert pl.logprobs[1:] == pytest.approx(lps, abs=1e-5)
        assert pl.ranks[1:] == ranks
        if k:
            assert pl.top[0] == [] and len(pl.top) == len(prompt)
            assert [[t for t, _ in row] for row in pl.top[1:]] == tops.indices[:, :k].tolist()
            torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in pl.top[1:]], dtype=torch.float64),
                                       tops.values[:, :k].double(), atol=1e-5, rtol=0)
            # the token's own logprob and the best alternative's are the same number when it is the best
            assert all(row[0][1] == lp for row, lp, rank in zip(pl.top[1:], pl.logprobs[1:], pl.ranks[1:])
                       if rank == 1)
        else:
            assert pl.top is None
    # scoring only: one output, nothing sampled, finish length
    (only,) = got["score"]
    assert only.token_ids == [] and only.finish == "length" and only.queue_s is not None
    # scoring changes nothing in what is generated: the same requests without prompt log-probabilities
    plain = drive(EngineCore(ckpt.model, n_slots=3, vocab_size=V, eos_id=tok.eot_id, prefill_chunk=7),
                  [EngineRequest(r.request_id, r.prompt, r.params, r.seed, r.top_n) for r in reqs])
    for rid in ("0", "1", "2", "long", "short"):
        assert [o.token_ids for o in got[rid]] == [o.token_ids for o in plain[rid]], rid


def test_scoring_only_requests_grouped_with_generating_ones(ckpt):
    """Whole prompts of equal length prefill in one pass: some rows score only, the others sample."""
    tok, V = ckpt.tokenizer, ckpt.tokenizer.vocab_size
    a, b = tok.encode("abcdef"), tok.encode("uvwxyz")
    assert len(a) == len(b)
    core = EngineCore(ckpt.model, n_slots=4, vocab_size=V, eos_id=tok.eot_id)
    got = drive(core, [
        EngineRequest("s1", a, SamplingParams(max_new_tokens=0), seed=0, prompt_logprobs=1),
        EngineRequest("g", b, SamplingParams(max_new_tokens=6, temperature=0), seed=0),
        EngineRequest("s2", b, SamplingParams(max_new_tokens=0), seed=0),  # no log-probabilities: just ends
    ])
    assert core.prefill_chunks == 1
    solo = generate(ckpt.model, tok, [b], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert [o.token_ids[0] for o in got["g"]] == solo.tokens
    assert got["s1"][0].prompt_logprobs.logprobs[1:] == pytest.approx(reference_scores(ckpt.model, a, V, 1)[0],
                                                                        abs=1e-5)
    assert [(o.token_ids, o.finish, o.prompt_logprobs) for o in got["s2"]] == [([], "length", None)]
    assert not core.has_work() and core.scheduler.free == [0, 1, 2, 3]


def test_prompt_logprobs_of_a_one_token_prompt_and_of_aborted_requests(ckpt):
    V = ckpt.tokenizer.vocab_size
    core = EngineCore(ckpt.model, n_slots=2, vocab_size=V, prefill_chunk=4)
    (out,) = drive(core, [EngineRequest("one", [5], SamplingParams(max_new_tokens=0), seed=0,
                                        prompt_logprobs=2)])["one"]
    assert (out.prompt_logprobs.logprobs, out.prompt_logprobs.ranks, out.prompt_logprobs.top) == ([None], [None], [[]])
    core.add(EngineRequest("gone", [5] * 20, SamplingParams(max_new_tokens=2), seed=0, prompt_logprobs=1))
    core.step()  # one chunk of four scored
    assert "gone" in core._scores
    core.abort(["gone"])
    assert not core._scores and not core.has_work()


def test_stop_token_ids_and_min_tokens_end_requests_in_the_core(ckpt):
    tok, V = ckpt.tokenizer, ckpt.tokenizer.vocab_size
    prompt = tok.encode("the the the")
    greedy = generate(ckpt.model, tok, [prompt], SamplingParams(max_new_tokens=8, temperature=0,
                                                                 stop_at_eos=False))[0].tokens
    stop = greedy[2]
    first = greedy.index(stop)
    core = EngineCore(ckpt.model, n_slots=2, vocab_size=V, eos_id=tok.eot_id)
    got = drive(core, [EngineRequest("s", prompt, SamplingParams(max_new_tokens=8, temperature=0, stop_at_eos=False,
                                                                 stop_token_ids=[stop]), seed=0)])
    assert [o.token_ids[0] for o in got["s"]] == greedy[:first + 1] and got["s"][-1].finish == "stop_sequence"
    # min_tokens past the stop token's first appearance: it cannot be drawn there, and the request goes on
    got = drive(core, [EngineRequest("m", prompt, SamplingParams(max_new_tokens=8, temperature=0, min_tokens=first + 1,
                                                                 stop_at_eos=False, stop_token_ids=[stop]), seed=0)])
    tokens = [o.token_ids[0] for o in got["m"]]
    assert stop not in tokens[:first + 1] and len(tokens) > first + 1
    with pytest.raises(ValueError, match="stop_token_ids"):
        core.add(EngineRequest("x", prompt, SamplingParams(stop_token_ids=[V]), seed=0))
    with pytest.raises(ValueError, match="logit_bias"):
        core.add(EngineRequest("y", prompt, SamplingParams(logit_bias={-1: 1.0}), seed=0))


def test_a_burst_sharing_a_prefix_prefills_it_once_and_gives_the_fresh_tokens(ckpt):
    tok = ckpt.tokenizer
    system = tok.encode("SYSTEM: answer briefly, in verse. ")
    prompts = [system + tok.encode(f"Q{i}: why?") for i in range(4)]  # equal tails: one batched pass after reuse

    def run(on: bool):
        core = EngineCore(ckpt.model, n_slots=4, vocab_size=tok.vocab_size, eos_id=None, prefill_chunk=64,
                          prefix_cache=on, min_prefix=4)
        reqs = [EngineRequest(str(i), p, SamplingParams(max_new_tokens=8, temperature=0.8, seed=i), seed=i, top_n=2)
                for i, p in enumerate(prompts)]
        return drive(core, reqs), core.stats()

    (fresh, s0), (reused, s1) = run(False), run(True)
    assert s1["prefix_hit_tokens"] >= 3 * 32 and s1["prompt_tokens"] == s0["prompt_tokens"] - s1["prefix_hit_tokens"]
    assert s1["prefill_chunks"] == 2  # the first prompt, then the three tails together
    for rid, outs in fresh.items():
        assert [o.token_ids for o in reused[rid]] == [o.token_ids for o in outs]
        assert [o.logprobs[0] for o in reused[rid]] == pytest.approx([o.logprobs[0] for o in outs], abs=1e-4)


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
def test_each_weight_format_gives_a_seeded_request_the_same_tokens_alone_and_batched(tiny_ckpt, fmt):
    """The server's weight formats (model/linear.py, swapped in by the core): a request decoded in a batch of
    three, prefills and decodes interleaved, gets the tokens it gets alone in a one-slot core."""
    def core(slots: int) -> tuple[EngineCore, object]:
        ck = load_checkpoint(tiny_ckpt)
        return EngineCore(ck.model, n_slots=slots, vocab_size=ck.tokenizer.vocab_size, eos_id=None,
                          prepack=True, quantize=fmt, int4_group=32), ck

    batched, ck = core(3)
    assert batched.stats()["weights"] == fmt
    got = drive(batched, requests(ck))
    for r in requests(ck):
        alone = drive(core(1)[0], [r])
        assert [o.token_ids for o in alone[r.request_id]] == [o.token_ids for o in got[r.request_id]], fmt


def test_the_cache_starts_unwritten_and_is_made_resident_after_warm_up(ckpt):
    """A CPU engine allocates its KV cache on untouched zero pages (start-up writes none of it) and faults them in
    from warm-up on, in the background (engine.cache_pages); the tokens are the library's either way (the tests
    above run on a cache never made resident)."""
    if not zero_pages.supported():
        pytest.skip("needs Linux 5.14+ (MADV_POPULATE_WRITE)")
    core = EngineCore(ckpt.model, n_slots=2, vocab_size=ckpt.tokenizer.vocab_size, eos_id=ckpt.tokenizer.eot_id,
                      compile="off")
    assert not core.cache.resident and core.stats()["kv_resident"] is False
    core.warmup()
    core.wait_compiled(60)
    stats = core.stats()
    assert core.cache.resident and stats["kv_resident"] is True and stats["kv_resident_seconds"] >= 0
    out = drive(core, requests(ckpt, CASES[:2]))
    solo = drive(EngineCore(ckpt.model, n_slots=2, vocab_size=ckpt.tokenizer.vocab_size,
                            eos_id=ckpt.tokenizer.eot_id, compile="off"), requests(ckpt, CASES[:2]))
    assert [t for o in out["0"] for t in o.token_ids] == [t for o in solo["0"] for t in o.token_ids]
    assert [t for o in out["1"] for t in o.token_ids] == [t for o in solo["1"] for t in o.token_ids]



def test_a_cpu_warm_up_runs_a_few_rows_and_leaves_every_slot_free(ckpt, monkeypatch):
    """Warm-up on a CPU prefills and decodes CPU_WARM_ROWS rows, not every slot (a 32-slot GPT-2 warm-up was ~0.5 s
    of the start), and hands back an engine whose slots are all empty: as many requests as slots afterwards get the
    tokens of an engine never warmed."""
    from engine.runner import CPU_WARM_ROWS

    def engine() -> EngineCore:
        return EngineCore(ckpt.model, n_slots=len(CASES), vocab_size=ckpt.tokenizer.vocab_size,
                          eos_id=ckpt.tokenizer.eot_id, compile="off")

    core, rows = engine(), []
    forward = type(core.runner.model).forward_cached

    def counting(self, idx, *args, **kwargs):
        rows.append(idx.shape[0])
        return forward(self, idx, *args, **kwargs)

    monkeypatch.setattr(type(core.runner.model), "forward_cached", counting)
    core.warmup()
    monkeypatch.undo()
    assert core.warmup_error is None and max(rows) == CPU_WARM_ROWS < core.n_slots
    assert core.cache.lengths == [0] * core.n_slots
    out, cold = drive(core, requests(ckpt, CASES)), drive(engine(), requests(ckpt, CASES))
    for r in out:
        assert [t for o in out[r] for t in o.token_ids] == [t for o in cold[r] for t in o.token_ids], r
