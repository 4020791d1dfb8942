"""Speculative decoding inside the engine core (engine/core.py's _verify, engine/spec_decode): the tokens, their
log-probabilities and how each request ends are those of a run without speculation, greedy or seeded, alone or
batched with requests that do not speculate; the cache holds what a full recompute gives; proposals are accepted
(a test whose proposals all fail would prove nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.core import EngineCore
from engine.generate import generate
from engine.params import SamplingParams
from engine.request import EngineRequest, StructuredSpec
from engine.spec_decode import parse_speculative
from engine.stopping import FinishReason
from model.checkpoint import load_checkpoint
from tests.helpers import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "default_spec_prices")

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:\nWhat light", "First Citizen:\nBefore we proceed", "KING HENRY:\n", "the the the the",
           "O Romeo, Romeo! wherefore art thou Romeo?", "a", "JULIET:\nGood night, good night!", "\n\n"]


@pytest.fixture(scope="module")
def ck():
    """The bundled 4-layer model: its greedy text repeats itself, which prompt lookup catches."""
    return load_checkpoint(REPO / "checkpoints" / "shakespeare")


def make_core(ck, spec="off", n_slots=4, **kw) -> EngineCore:
    return EngineCore(ck.model, n_slots=n_slots, vocab_size=ck.tokenizer.vocab_size,
                      eos_id=kw.pop("eos_id", ck.tokenizer.eot_id),
                      speculative=parse_speculative(spec, **kw.pop("spec_kw", {})), pad_vocab=False, **kw)


def drive(core: EngineCore, reqs: list[EngineRequest], on_step=None) -> dict[str, list]:
    for r in reqs:
        core.add(r)
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    while core.has_work():
        for o in core.step():
            out[o.request_id].append(o)
        if on_step is not None:
            on_step(core, out)
    return out


def flat(outs) -> dict:
    """Per request: token ids, logprobs, top alternatives, finish, in order (outputs joined)."""
    res = {}
    for rid, os_ in outs.items():
        res[rid] = dict(tokens=[t for o in os_ for t in o.token_ids], logprobs=[x for o in os_ for x in o.logprobs],
                        top=[x for o in os_ for x in (o.top or [])], finish=os_[-1].finish, error=os_[-1].error)
    return res


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid]["tokens"] == b[rid]["tokens"], rid
        assert a[rid]["finish"] == b[rid]["finish"], rid
        assert a[rid]["logprobs"] == pytest.approx(b[rid]["logprobs"], abs=1e-4), rid
        assert len(a[rid]["top"]) == len(b[rid]["top"])
        for x, y in zip(a[rid]["top"], b[rid]["top"]):
            assert [t for t, _ in x] == [t for t, _ in y]


def reqs(ck, cases, speculate=None) -> list[EngineRequest]:
    return [EngineRequest(str(i), ck.tokenizer.encode(p), SamplingParams(**kw), seed=kw.get("seed", i), top_n=2,
                          speculate=True if speculate is None else speculate[i])
            for i, (p, kw) in enumerate(cases)]


def run_both(ck, cases, speculate=None, n_slots=4, **kw):
    off = flat(drive(make_core(ck, "off", n_slots, **kw), reqs(ck, cases, speculate)))
    core = make_core(ck, "ngram", n_slots, **kw)
    on = flat(drive(core, reqs(ck, cases, speculate)))
    return off, on, core.speculator


@pytest.mark.parametrize("n_slots", [1, 4])
def test_greedy_tokens_are_those_without_speculation(ck, n_slots):
    cases = [(p, dict(max_new_tokens=60, temperature=0)) for p in PROMPTS]
    off, on, spec = run_both(ck, cases, n_slots=n_slots)
    assert_same(off, on)
    assert spec.accepted > 20 and spec.proposed > spec.accepted  # accepted and rejected proposals both


def test_batched_with_requests_that_do_not_speculate(ck):
    cases = [(p, dict(max_new_tokens=50, temperature=0)) for p in PROMPTS[:4]]
    cases += [(p, dict(max_new_tokens=40, temperature=0.8, seed=7)) for p in PROMPTS[4:6]]
    off, on, spec = run_both(ck, cases, speculate=[True, False, True, False, True, False], n_slots=3)
    assert_same(off, on)
    assert spec.accepted > 0


@pytest.mark.parametrize("kw", [
    dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(temperature=0.7, top_p=0.8),
    dict(temperature=0.5, top_k=20, top_p=0.9)])
def test_seeded_sampling_is_identical(ck, kw):
    cases = [(p, dict(max_new_tokens=60, seed=10 + i, **kw)) for i, p in enumerate(PROMPTS[:6])]
    off, on, spec = run_both(ck, cases)
    assert_same(off, on)
    assert spec.accepted > 0


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.3), dict(presence_penalty=0.6, frequency_penalty=0.4),
    dict(logit_bias={198: -5.0, 11: 3.0}), dict(min_tokens=30, stop_token_ids=[198, 11]),
    dict(stop_token_ids=[0, 13]), dict(repetition_penalty=1.1, temperature=0.9, seed=3)])
def test_penalties_bias_min_tokens_and_stop_ids_stay_exact(ck, kw):
    cases = [(p, dict({"max_new_tokens": 60, "temperature": 0} | kw)) for p in PROMPTS[:5]]
    off, on, spec = run_both(ck, cases)
    assert_same(off, on)
    assert spec.proposed > 0


def test_max_new_tokens_and_eos_cut_a_verified_run(ck):
    # short limits land inside accepted runs; the bundled model's text ends at <|endoftext|> sometimes
    cases = [(p, dict(max_new_tokens=n, temperature=0)) for p in PROMPTS for n in (2, 3, 7)]
    off, on, _ = run_both(ck, cases, n_slots=4)
    assert_same(off, on)
    assert all(len(v["tokens"]) <= 7 for v in on.values())


@pytest.mark.parametrize("case", ["eos", "stop_id", "stop_id_at_min_tokens", "ignore_eos", "max_tokens"])
def test_verification_draws_nothing_after_the_token_that_ends_a_request(ck, case):
    """Proposals that are the request's own tokens (those of a run without speculation, so all accepted), then
    filler past its end: a row stops at the token that ends it (EOS, a stop id once min_tokens are out), so the
    sampler draws each of the request's tokens once and nothing after; the accepted counter (and generated_tokens)
    count only the tokens emitted. A request that ignores EOS goes on past it. The positions of the first '.' and
    '\n' come from the bundled model's greedy text (today "ly, I am not so.\n\nROMEO:...": '.' its 7th token, '\n'
    its 8th)."""
    tok = ck.tokenizer
    (dot,), (nl,) = tok.encode("."), tok.encode("\n")
    prompt = tok.encode(PROMPTS[0])
    greedy = flat(drive(make_core(ck, "off", n_slots=1), [EngineRequest(
        "a", prompt, SamplingParams(max_new_tokens=40, temperature=0, stop_at_eos=False), seed=0)]))["a"]["tokens"]
    at_dot, at_nl = greedy.index(dot) + 1, greedy.index(nl) + 1  # 1-based
    assert at_nl > 1  # min_tokens below must be positive
    eos, params, finish = tok.eot_id, dict(max_new_tokens=40, temperature=0), FinishReason.LENGTH
    if case == "eos":
        eos, finish = dot, FinishReason.EOS
    elif case == "stop_id":
        params["stop_token_ids"], finish = [dot], FinishReason.STOP
    elif case == "stop_id_at_min_tokens":  # min_tokens one below the first '\n' lets it end the request
        params |= dict(stop_token_ids=[nl], min_tokens=at_nl - 1)
        finish = FinishReason.STOP
    elif case == "ignore_eos":
        eos, params["stop_at_eos"] = dot, False
    else:
        params["max_new_tokens"] = 12

    def request():
        return [EngineRequest("a", prompt, SamplingParams(**params), seed=0)]

    off = flat(drive(make_core(ck, "off", n_slots=1, eos_id=eos), request()))
    script = off["a"]["tokens"]
    assert off["a"]["finish"] == finish and len(script) == {"eos": at_dot, "stop_id": at_dot,
                                                            "stop_id_at_min_tokens": at_nl, "ignore_eos": 40,
                                                            "max_tokens": 12}[case]
    core = make_core(ck, "ngram", n_slots=1, eos_id=eos)
    spec = core.speculator

    def propose(ids, limits, fill=None):  # the script from the request's next token on, then filler, within limits
        return [(script[len(spec.tokens[rid]) - len(prompt):] + [0] * lim)[:lim] for rid, lim in zip(ids, limits)]

    recorded, state = [], core.sampler.state
    record, record_runs = state.record, state.record_runs

    def count(rows, index, token, first=True):  # a step's draws, position by position
        recorded.append(len(index))
        return record(rows, index, token, first)

    def count_runs(slots, tokens):  # a verification's kept draws, drawn in one go (Sampler.draw_ahead)
        recorded.append(sum(map(len, tokens)))
        return record_runs(slots, tokens)

    spec.propose, state.record, state.record_runs = propose, count, count_runs
    on = flat(drive(core, request()))
    assert_same(off, on)
    n = len(script)
    assert sum(recorded) == n  # every draw recorded is emitted: none after the last token
    assert spec.accepted == n - 1 - core.decode_steps > 0  # the tokens beyond the prefill's and one per step
    assert core.stats()["generated_tokens"] == n


def test_stop_strings_through_the_library(ck):
    tok = ck.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    params = SamplingParams(max_new_tokens=80, temperature=0, stop=["\n\n", "the "])
    off = generate(ck.model, tok, prompts, params)
    on = generate(ck.model, tok, prompts, params, speculative=parse_speculative("ngram"))
    assert [s.text for s in off] == [s.text for s in on]
    assert [s.tokens for s in off] == [s.tokens for s in on]
    assert [s.finish_reason for s in off] == [s.finish_reason for s in on]


def test_grammar_masks_stay_exact(ck):
    specs = [StructuredSpec("regex", r"([a-z]+ ){3,30}[a-z]+\."), StructuredSpec("choice", json.dumps(
        ["to be or not to be, to be or not to be", "Romeo Romeo Romeo Romeo Romeo Romeo"])),
        StructuredSpec("regex", r"(the ){2,40}end")]

    def build(spec_name):
        core = make_core(ck, spec_name, tokenizer=ck.tokenizer)
        rs = [EngineRequest(str(i), ck.tokenizer.encode("the the the the " + p), SamplingParams(
            max_new_tokens=60, temperature=t), seed=i, structured=s, top_n=1)
            for i, (p, s, t) in enumerate([(p, s, t) for p in PROMPTS[:2] for s in specs for t in (0, 0.8)])]
        return core, flat(drive(core, rs))

    _, off = build("off")
    core, on = build("ngram")
    assert_same(off, on)
    assert core.speculator.accepted > 0


def kv_matches_recompute(core: EngineCore, model, slot: int, tokens: list[int]) -> None:
    """The slot holds exactly len(tokens) entries, equal to a fresh prefill of those tokens."""
    n = core.cache.lengths[slot]
    assert n == len(tokens)
    ref = EngineCore(model, n_slots=1, vocab_size=core.vocab_size, pad_vocab=False)
    with torch.inference_mode():
        model.forward_cached(torch.tensor([tokens]), ref.cache, [0])
    for layer in range(len(core.cache.k)):
        torch.testing.assert_close(core.cache.k[layer][slot, :, :n], ref.cache.k[layer][0, :, :n], atol=1e-4, rtol=0)
        torch.testing.assert_close(core.cache.v[layer][slot, :, :n], ref.cache.v[layer][0, :, :n], atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_cache_after_rejections_equals_a_full_recompute(ck, prefix_cache):
    core = make_core(ck, "ngram", n_slots=3, prefix_cache=prefix_cache, min_prefix=4)
    rs = reqs(ck, [(p, dict(max_new_tokens=70, temperature=0)) for p in PROMPTS[:3]])
    checked = []

    def check(core, out):
        if core.speculator.steps == 0 or core.scheduler._ops:  # (slot moves still to be applied)
            return
        for r in core.scheduler.decoding:  # every decoding slot: prompt + output but the newest token
            toks = [t for o in out[r.id] for t in o.token_ids]
            kv_matches_recompute(core, ck.model, r.slot, r.request.prompt + toks[:-1])
            checked.append(r.id)

    drive(core, rs, check)
    spec = core.speculator
    assert spec.accepted > 10 and spec.proposed - spec.accepted > 3 and len(checked) > 20


def test_an_abort_after_a_verified_step_leaves_a_reusable_prefix(ck):
    """With prefix caching, a request aborted right after a step that accepted proposals (a stop string) leaves
    its slot idle; a new request whose prompt extends what it generated reuses those entries and gets the tokens
    of a run without speculation or caching."""
    core = make_core(ck, "ngram", n_slots=2, prefix_cache=True, min_prefix=4)
    prompt = ck.tokenizer.encode(PROMPTS[0])
    core.add(EngineRequest("a", prompt, SamplingParams(max_new_tokens=100, temperature=0), seed=0))
    got: list[int] = []
    while True:
        outs = core.step()
        got += [t for o in outs for t in o.token_ids]
        if any(len(o.token_ids) > 1 for o in outs) and len(got) > 20:
            break
    core.abort(["a"])
    slot = core.scheduler.prefix.tokens.index(max(core.scheduler.prefix.tokens, key=len))
    assert core.cache.lengths[slot] >= len(prompt) + len(got) - 1
    kv_matches_recompute(core, ck.model, slot, (prompt + got)[:core.cache.lengths[slot]])
    follow = prompt + got[:-3]
    on = flat(drive(core, [EngineRequest("b", follow, SamplingParams(max_new_tokens=40, temperature=0), seed=0)]))
    assert core.scheduler.hit_tokens >= len(follow) - 1 - 16
    off = flat(drive(make_core(ck, "off", n_slots=1),
                     [EngineRequest("b", follow, SamplingParams(max_new_tokens=40, temperature=0), seed=0)]))
    assert on["b"]["tokens"] == off["b"]["tokens"]


def test_speculation_turns_off_above_the_batch_limit(ck):
    # two requests end early: the other two go on as a batch of two
    cases = [(p, dict(max_new_tokens=n, temperature=0)) for p, n in zip(PROMPTS[:4], (8, 12, 50, 60))]
    core = make_core(ck, "ngram", n_slots=4, spec_kw=dict(max_batch=2))
    batches = []
    propose = core.speculator.propose

    def spy(ids, limits, fill=None):
        batches.append(len(ids))
        return propose(ids, limits, fill)

    core.speculator.propose = spy
    off = flat(drive(make_core(ck, "off"), reqs(ck, cases)))
    on = flat(drive(core, reqs(ck, cases)))
    assert_same(off, on)
    # proposals asked for (and verified) only once two or fewer requests were left
    assert batches and max(batches) <= 2 and core.speculator.steps > 0


def test_a_draft_model_gives_the_same_tokens(ck):
    """Drafts: the target itself (nearly all accepted) and a random model of another shape (nearly none)."""
    tok = ck.tokenizer
    cases = [(p, dict(max_new_tokens=40, temperature=t, seed=5)) for p in PROMPTS[:4] for t in (0, 0.9)]
    off = flat(drive(make_core(ck, "off"), reqs(ck, cases)))
    other = tiny_model(1, vocab_size=tok.vocab_size, block_size=ck.config.block_size)
    for draft in (load_checkpoint(REPO / "checkpoints" / "shakespeare").model, other):
        core = make_core(ck, "draft:x", draft_model=draft, spec_kw=dict(draft_p_min=0.0))  # every draft token
        on = flat(drive(core, reqs(ck, cases)))
        assert_same(off, on)
        assert core.speculator.proposed > 0
        assert not core.speculator.draft.slot  # every request's draft slot was given back
    assert core.speculator.accepted < core.speculator.proposed


def test_a_draft_of_the_target_itself_accepts_greedy_proposals(ck):
    draft = load_checkpoint(REPO / "checkpoints" / "shakespeare").model
    proposed = []
    for p_min in (0.0, 0.5):  # with a floor, fewer proposals, all still accepted
        core = make_core(ck, "draft:x", n_slots=1, draft_model=draft, spec_kw=dict(draft_p_min=p_min))
        drive(core, reqs(ck, [(PROMPTS[1], dict(max_new_tokens=60, temperature=0))]))
        s = core.speculator
        assert s.accepted >= 0.9 * s.proposed > 0
        proposed.append(s.proposed)
    assert proposed[0] > 30 and proposed[1] < proposed[0]


def test_a_batch_shares_the_verification_positions(ck):
    """n decoding rows propose at most VERIFY_POSITIONS // n - 1 tokens each (at least 1)."""
    from engine.spec_decode.config import VERIFY_POSITIONS

    core = make_core(ck, "ngram", n_slots=4, spec_kw=dict(k=8))
    seen = []
    propose = core.speculator.propose

    def spy(ids, limits, fill=None):
        seen.append((len(ids), max(limits)))
        return propose(ids, limits, fill)

    core.speculator.propose = spy
    drive(core, reqs(ck, [(p, dict(max_new_tokens=40, temperature=0)) for p in PROMPTS[:4]]))
    assert 4 in {n for n, _ in seen}
    assert all(lim <= max(1, VERIFY_POSITIONS // n - 1) for n, lim in seen)
    assert max(lim for n, lim in seen if n == 4) == 3


class _Priced:
    """StepCosts at a fixed price: what the core times into it, and the price of every pass."""

    def __init__(self, extra: float) -> None:
        self.price, self.timed = extra, []

    def plain(self, n, seconds):
        self.timed.append(("plain", n))

    def verify(self, n, positions, seconds):
        self.timed.append(("verify", n, positions))

    def extra(self, n, positions):
        return self.price

    def as_dict(self):
        return {}


@pytest.mark.parametrize("price, pays", [(0.2, True), (3.0, False)])
def test_a_row_speculates_while_what_it_accepts_pays_for_its_passes(ck, price, pays):
    """The core times its plain and speculative steps (engine.spec_decode.costs) and each row hears its pass's cost
    beyond a plain step: proposals that all hold (2 tokens a pass, k = 2) pay for a pass priced at 0.2 steps more
    and speculate throughout; at 3 steps more they lose, so the row pauses (probing again after each pause), and
    decodes mostly plain steps. The tokens are those without speculation either way."""
    prompt = ck.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=60, temperature=0)
    script = flat(drive(make_core(ck, "off", n_slots=1), [EngineRequest("a", prompt, params, seed=0)]))["a"]["tokens"]
    core = make_core(ck, "ngram", n_slots=1, spec_kw=dict(k=2))
    spec = core.speculator
    spec.costs = _Priced(price)
    spec.ngram.propose = lambda tokens, k: script[len(tokens) - len(prompt):][:k]  # its own next: all hold
    on = flat(drive(core, [EngineRequest("a", prompt, params, seed=0)]))
    assert on["a"]["tokens"] == script
    verified = [t for t in spec.costs.timed if t[0] == "verify"]
    # one row, its last token and 2 proposed (1 where only 2 tokens are left to generate)
    assert (1, 3) in {t[1:] for t in verified} <= {(1, 3), (1, 2)}
    assert ("plain", 1) in spec.costs.timed or pays  # (speculating throughout, a row decodes no plain step)
    assert spec.accepted == spec.proposed >= 2 * len(verified) - 1  # (the last may hold 1)
    if pays:
        assert len(verified) >= 18  # ~59 tokens, 3 a step
    else:
        assert len(verified) <= 5 and core.decode_steps > 40  # probes: after 8, 16, 32 steps
