"""The parts of engine/spec_decode on their own: settings parsing (one-line errors), prompt lookup, the adaptive
proposal length, the speculator's bookkeeping and the draft model's checks. Exactness inside the core is
tests/test_engine_core_speculative.py."""

from __future__ import annotations

import pytest

from engine.request import RequestOutput
from engine.spec_decode import SpecError, Speculator, parse_speculative
from engine.spec_decode.adaptive import FIRST_BACKOFF, PATIENCE, START_K, AdaptiveK
from engine.spec_decode.draft import DraftError, check_draft
from engine.spec_decode.ngram import NgramProposer
from engine.stopping import FinishReason


@pytest.mark.parametrize("value, method, draft", [
    (None, "off", None), ("", "off", None), ("off", "off", None), ("ngram", "ngram", None), (" NGRAM ", "ngram", None),
    ("draft:checkpoints/small", "draft", "checkpoints/small")])
def test_methods_parse(value, method, draft):
    c = parse_speculative(value)
    assert (c.method, c.draft) == (method, draft)
    assert c.enabled == (method != "off")


@pytest.mark.parametrize("value, kw, words", [
    ("medusa", {}, "unknown speculative method 'medusa'"), ("ngram:5", {}, "unknown speculative method"),
    ("draft", {}, "needs a checkpoint"), ("draft:", {}, "needs a checkpoint"),
    ("ngram", dict(k=0), "must be >= 1, got 0"), ("ngram", dict(ngram_min=3, ngram_max=2), "min <= max"),
    ("ngram", dict(ngram_min=0), "min <= max"), ("ngram", dict(max_batch=0), "batch limit"),
    ("draft:x", dict(draft_p_min=1.0), "probability floor")])
def test_bad_settings_are_one_line_errors(value, kw, words):
    with pytest.raises(SpecError, match=words) as e:
        parse_speculative(value, **kw)
    assert "\n" not in str(e.value)


def test_prompt_lookup_proposes_what_followed_the_longest_recent_match():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # "2 3" seen before: 4 5 9 followed
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], 10) == [4, 5, 9, 2, 3]  # up to the sequence's end
    assert p.propose([7, 1, 8, 2, 1, 9, 2, 1], 2) == [9, 2]  # the longest match (2 1) beats the latest 1
    assert p.propose([5, 1, 6, 1, 7, 1], 1) == [7]  # the most recent earlier occurrence
    assert p.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose([1, 2], 0) == []
    assert NgramProposer(2, 3).propose([4, 1, 5, 1], 2) == []  # only a 1-gram matches: below min
    # ids are packed as 4-byte words: a match straddling two ids is not a match
    assert p.propose([0x0100, 0x0002, 0x0201, 0x0201], 1) == [0x0201]
    assert p.propose([256, 1, 2, 65536 + 2], 2) == []


def test_adaptive_k_shrinks_pauses_and_recovers():
    a = AdaptiveK(4)
    assert a.budget() == START_K == 2  # a short first probe
    a.observe(2, 2)
    assert a.budget() == 4  # it held: doubles up to k
    a.observe(4, 3)
    assert a.budget() == 4  # the run that held, and one more
    a.observe(4, 1)
    assert a.budget() == 2
    a.observe(2, 2)
    assert a.budget() == 4  # all held: doubles back up
    for _ in range(PATIENCE):
        if a.paused:
            break
        a.observe(a.budget(), 0)
    assert [a.budget() for _ in range(FIRST_BACKOFF)] == [0] * FIRST_BACKOFF  # paused
    k = a.budget()
    assert k == 1
    a.observe(k, 0)  # the probe fails: a longer pause
    assert [a.budget() for _ in range(2 * FIRST_BACKOFF)] == [0] * (2 * FIRST_BACKOFF)
    a.observe(0, 0)  # a draft that came back with nothing (it cost a pass) is a miss too
    assert a.paused and a.budget() == 0  # (right after a failed probe: it pauses again)
    a.paused = 0
    for _ in range(4):  # hits lift the rate back: no pause, and the next pause starts short again
        a.observe(a.budget(), a.budget())
    assert not a.paused and a.backoff == FIRST_BACKOFF and a.budget() == 4


def test_a_low_acceptance_rate_pauses_even_without_a_miss_streak():
    a = AdaptiveK(4)
    steps = 0
    while not a.paused and steps < 20:  # 1 of 5 proposals held, every time: never 3 misses in a row
        a.observe(4, 1 if steps % 2 == 0 else 0)
        steps += 1
    assert a.paused and steps < 10 and a.misses < PATIENCE


def test_the_speculator_follows_its_requests_and_counts():
    s = Speculator(parse_speculative("ngram", k=3, ngram_min=2))
    s.add("a", [1, 2, 3, 1, 2])
    assert s.propose(["a", "b"], [5, 5]) == [[3, 1], []]  # b does not speculate; a's first proposal: START_K
    s.control["a"].k = 3
    assert s.propose(["a", "b"], [5, 5]) == [[3, 1, 2], []]
    assert s.propose(["a"], [1]) == [[3]]  # the limit (room, tokens left) caps it
    s.observe("a", 3, 2)
    s.record([RequestOutput("a", [3, 1], [0.0, 0.0])])
    assert list(s.tokens["a"]) == [1, 2, 3, 1, 2, 3, 1]
    st = s.stats()
    assert (st["proposed_tokens"], st["accepted_tokens"], st["acceptance_rate"]) == (3, 2, 0.6667)
    s.record([RequestOutput("a", [2], [0.0], finish=FinishReason.LENGTH)])
    assert "a" not in s and not s.control


def test_a_draft_needs_the_targets_tokenizer(byte_tokenizer, tmp_path):
    from model.tokenizer import Tokenizer
    from tests.helpers import write_byte_ranks

    check_draft(byte_tokenizer, byte_tokenizer)
    other = Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "o.tiktoken", [b"th", b"he", b" t", b"an"]))
    smaller = Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "s.tiktoken", [b"th"]))
    with pytest.raises(DraftError, match="another tokenizer"):
        check_draft(byte_tokenizer, other)
    with pytest.raises(DraftError, match="vocabulary of"):
        check_draft(byte_tokenizer, smaller)


def test_a_pass_that_costs_more_than_a_row_accepts_pauses_it():
    """AdaptiveK with the pass's measured extra cost (in plain steps): a row accepting 1 token a pass keeps
    proposing where a pass costs 0.5 steps more than a plain one, and pauses where it costs 1.85 more (a compiled
    pass and its draws on a CPU); unmeasured, a proposed token is priced at RATE_FLOOR (the eager rule)."""
    cheap, dear = AdaptiveK(2), AdaptiveK(2)
    for _ in range(12):
        cheap.observe(cheap.budget() or 2, 1, extra=0.5)
    assert not cheap.paused
    steps = 0
    while not dear.paused and steps < 12:
        dear.observe(2, 1, extra=1.85)
        steps += 1
    assert dear.paused and steps < 6 and dear.misses < PATIENCE
    default = AdaptiveK(4)  # 1 of 4 accepted: exactly RATE_FLOOR's share, and below it once it is 1 of 5
    for _ in range(12):
        default.observe(4, 1)
    assert not default.paused
    for _ in range(12):
        default.observe(5, 1)
    assert default.paused


def test_step_costs_price_a_pass_in_plain_steps_of_its_batch():
    from engine.spec_decode.costs import SPIKE_CAP, StepCosts

    c = StepCosts()
    assert c.extra(1, 3) is None  # nothing timed
    c.verify(1, 3, 0.5)  # each kind's first step is not counted (a package's first run)
    c.verify(1, 3, 0.003)
    assert c.extra(1, 3) is None  # no plain step of one row yet
    for n, seconds in ((1, 0.2), (1, 0.001), (2, 0.3), (2, 0.0015)):
        c.plain(n, seconds)
    assert c.extra(1, 3) == pytest.approx(2.0) and c.extra(2, 3) is None and c.extra(1, 5) is None
    for _ in range(200):  # the moving average follows the machine
        c.verify(1, 3, 0.0015)
    assert c.extra(1, 3) == pytest.approx(0.5, abs=1e-3)
    c.plain(1, 1.0)  # a preemption counts as SPIKE_CAP times the average, not its own length
    assert c.extra(1, 3) == pytest.approx(0.0015 / (0.001 + 0.1 * (SPIKE_CAP - 1) * 0.001) - 1, abs=1e-3)
    c.verify(2, 2, 0.0006)
    c.verify(2, 2, 0.0006)  # cheaper than a plain step (a measurement's noise): no negative price
    assert c.extra(2, 2) == 0.0
    assert set(c.as_dict()) == {"1x3", "2x2"}


def test_proposals_fill_the_pass_they_are_verified_in():
    s = Speculator(parse_speculative("ngram", k=8, ngram_min=1))
    s.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1])
    assert s.propose(["a"], [8]) == [[2, 3]]  # START_K
    assert s.propose(["a"], [8], fill=lambda k: 2 * k) == [[2, 3, 4, 5]]
    assert s.propose(["a"], [3], fill=lambda k: 2 * k) == [[2, 3, 4]]  # within the limit
