"""engine/output_processor.py: the front's loop over the engine's outputs, with no core and no HTTP.

`RequestOutput`s are built by hand and handed to `OutputProcessor.process`; the tests read what lands on each
request's queue. Detokenizing and stop strings on one `Sequence` (no processor) are in tests/test_tokenizer.py;
the routes that stream these items are in tests/test_app*.py.

The byte tokenizer (tests/conftest.py): ids 0-255 are the bytes, 256 "th", 257 "he", 258 " t", 259 "the",
260 <|endoftext|>.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.output_processor import (
    DISCONNECTED,
    Failed,
    OutputProcessor,
    PromptOut,
    RequestState,
    TokenOut,
)
from engine.params import SamplingParams
from engine.request import ErrorKind, PromptLogprobs, RequestOutput
from engine.stopping import FinishReason

THE, EOT = 259, 260


class Front:
    """An OutputProcessor with recording hooks, and requests whose `abort` is recorded instead of sent."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.tokens: list[tuple[str, bool]] = []  # (request id, first token) per on_token call
        self.ends: list[tuple[str, object]] = []  # (request id, outcome) per on_end call
        self.aborted: list[str] = []
        self.proc = OutputProcessor(tok, on_token=lambda st, first, now, queue_s: self.tokens.append((st.id, first)),
                                    on_end=lambda st, outcome: self.ends.append((st.id, outcome)))

    def add(self, rid: str = "r", prompt: list[int] = (104, 105), top_n: int = 0, **params) -> RequestState:
        st = RequestState(rid, list(prompt), SamplingParams(seed=7, **params), self.tok, top_n=top_n,
                          timeout_s=30.0, abort=self.aborted.append)
        self.proc.add(st)
        return st


def out(rid: str, ids: list[int], finish: FinishReason | None = None, **kw) -> RequestOutput:
    return RequestOutput(rid, list(ids), [-0.25 * (k + 1) for k in range(len(ids))], finish=finish, **kw)


def drain(st: RequestState) -> list:
    items = []
    while not st.queue.empty():
        items.append(st.queue.get_nowait())
    return items


def texts(items: list) -> list[str]:
    return [i.text for i in items if isinstance(i, TokenOut)]


@pytest.fixture
def front(byte_tokenizer) -> Front:
    return Front(byte_tokenizer)


def test_a_character_split_across_tokens_is_released_whole_by_the_token_that_completes_it(front):
    st = front.add()
    ids = list("é€".encode())  # 2 + 3 bytes, one token each
    for t in ids:
        assert front.proc.process([out("r", [t])]) == []
    items = drain(st)
    assert texts(items) == ["", "é", "", "", "€"]
    assert [i.index for i in items] == [1, 2, 3, 4, 5] and [i.id for i in items] == ids
    assert all(i.finished is None for i in items) and len(front.proc) == 1


def test_tokens_of_one_output_are_indexed_in_order_and_the_last_carries_the_finish(front):
    """Several tokens in one output (speculation verified proposals): one TokenOut each, the finish on the last."""
    st = front.add(max_new_tokens=4)
    front.proc.process([out("r", [THE, 32], cached_tokens=1)])
    front.proc.process([out("r", [THE, 33], FinishReason.LENGTH)])
    items = drain(st)
    assert texts(items) == ["the", " ", "the", "!"]
    assert [i.logprob for i in items] == [-0.25, -0.5, -0.25, -0.5]
    assert [i.finished is None for i in items] == [True, True, True, False]
    fin = items[-1].finished
    assert (fin.finish_reason, fin.generated_tokens, fin.text) == (FinishReason.LENGTH, 4, "the the!")
    assert (fin.seed, fin.prompt_tokens, fin.cached_tokens) == (7, 2, 1)
    assert front.tokens == [("r", True), ("r", False), ("r", False), ("r", False)]
    assert front.ends == [("r", FinishReason.LENGTH)] and len(front.proc) == 0 and st.closed


def test_a_stop_string_across_tokens_is_held_back_then_cut_and_its_id_returned_to_abort(front):
    st = front.add(stop=["the end"])
    assert front.proc.process([out("r", list(b"so"))]) == []
    assert front.proc.process([out("r", [THE])]) == []  # "the" could start "the end": held back
    assert front.proc.process([out("r", list(b" e"))]) == []
    assert front.proc.process([out("r", list(b"nd!"))]) == ["r"]  # the core has not ended it: abort it there
    items = drain(st)
    assert texts(items) == ["s", "o", "", "", "", "", ""]  # "!" after the stop never reaches a TokenOut
    fin = items[-1].finished
    assert fin.finish_reason == FinishReason.STOP and fin.text == "so" and fin.generated_tokens == 7
    assert front.ends == [("r", FinishReason.STOP)] and len(front.proc) == 0


def test_held_back_text_that_turns_out_not_to_be_a_stop_string_is_released(front):
    st = front.add(stop=["the end"])
    front.proc.process([out("r", [THE])])
    front.proc.process([out("r", list(b" eX"))])
    front.proc.process([out("r", [258], FinishReason.LENGTH)])  # merged " t": "t" could start the stop; the finish
    items = drain(st)                                            # releases it with its token
    assert texts(items) == ["", "", "", "the eX", " t"]
    assert items[-1].finished.finish_reason == FinishReason.LENGTH and items[-1].finished.text == "the eX t"


def test_eos_releases_held_text_on_its_special_token(front):
    st = front.add(stop=["the end"])
    assert front.proc.process([out("r", [THE, EOT], FinishReason.EOS)]) == []  # the core already ended it
    a, b = drain(st)
    assert (a.text, a.special, b.id, b.text, b.special) == ("", False, EOT, "the", True)
    assert b.finished.finish_reason == FinishReason.EOS and b.finished.generated_tokens == 2


def test_the_whole_text_at_eos_includes_what_a_stop_string_held_back(front):  # the EOS event carries it
    st = front.add(stop=["the end"])
    front.proc.process([out("r", [THE, EOT], FinishReason.EOS)])
    assert drain(st)[-1].finished.text == "the"


def test_a_stop_inside_an_output_ends_it_there_and_leaves_later_tokens_out(front):
    st = front.add(stop=["he"])
    assert front.proc.process([out("r", [115, THE, 120, 121])]) == ["r"]
    items = drain(st)
    assert texts(items) == ["s", "t"] and items[-1].finished.finish_reason == FinishReason.STOP
    assert items[-1].finished.generated_tokens == 2 and len(front.tokens) == 2
    # the same output with the core's own finish on it: the finish reason is still STOP, but nothing to abort
    again = front.add("again", stop=["he"])
    assert front.proc.process([out("again", [115, THE, 120], FinishReason.LENGTH)]) == []
    assert drain(again)[-1].finished.finish_reason == FinishReason.STOP


def test_top_alternatives_are_decoded_and_cut_to_the_requests_top_n(front):
    st = front.add(top_n=2)
    plain = front.add("p")  # top_n 0: the core's alternatives are not passed on
    top = [[(THE, -0.1), (97, -1.0), (98, -2.0)]]
    front.proc.process([out("r", [THE], top=top), out("p", [THE], top=top)])
    (item,) = drain(st)
    assert item.top == [(THE, "the", -0.1), (97, "a", -1.0)]
    assert drain(plain)[0].top is None


def test_an_error_output_ends_the_request_with_failed(front):
    st = front.add()
    front.proc.process([out("r", [97])])
    front.proc.process([RequestOutput("r", [], [], error=ErrorKind.FAILED, message="out of memory")])
    items = drain(st)
    assert texts(items) == ["a"] and items[-1] == Failed(ErrorKind.FAILED, "out of memory")
    assert front.ends == [("r", ErrorKind.FAILED)] and len(front.proc) == 0 and st.closed


def test_outputs_of_a_dropped_request_are_ignored(front):
    st, other = front.add(), front.add("o")
    assert front.proc.drop("r") is st and front.proc.drop("r") is None
    assert front.proc.process([out("r", [97]), out("o", [98])]) == []
    assert drain(st) == [] and texts(drain(other)) == ["b"]
    assert front.ends == [("r", "cancelled")]


def test_fail_all_gives_every_request_in_flight_its_last_item(front):
    a, b = front.add("a"), front.add("b")
    front.proc.fail_all(ErrorKind.SHUTDOWN, "bye")
    assert drain(a) == drain(b) == [Failed(ErrorKind.SHUTDOWN, "bye")]
    assert front.ends == [("a", ErrorKind.SHUTDOWN), ("b", ErrorKind.SHUTDOWN)] and len(front.proc) == 0


def test_prompt_tokens_texts_add_up_to_the_prompt_with_alternatives_decoded(front):
    prompt = [THE, *"é".encode(), 33]
    scores = PromptLogprobs([None, -1.0, -2.0, -3.0], [None, 1, 4, 2], [[], [(97, -0.5)], [], [(THE, -0.2)]])
    toks = front.proc.prompt_tokens(prompt, scores)
    assert [t.text for t in toks] == ["the", "", "é", "!"]
    assert [t.logprob for t in toks] == [None, -1.0, -2.0, -3.0] and [t.rank for t in toks] == [None, 1, 4, 2]
    assert [t.top for t in toks] == [[], [(97, "a", -0.5)], [], [(THE, "the", -0.2)]]
    # a prompt that ends inside a character: its last token gets the rest, as a full decode shows it
    cut = front.proc.prompt_tokens([97, 0xC3], PromptLogprobs([None, -1.0], [None, 1]))
    assert [t.text for t in cut] == ["a", "\ufffd"]


def test_prompt_logprobs_come_first_then_the_tokens(front):
    st = front.add(prompt=[THE, 33])
    scores = PromptLogprobs([None, -1.5], [None, 3])
    front.proc.process([out("r", [97], prompt_logprobs=scores)])
    first, tok = drain(st)
    assert isinstance(first, PromptOut) and first.finished is None
    assert [(t.id, t.text, t.logprob, t.top) for t in first.tokens] == [(THE, "the", None, None), (33, "!", -1.5, None)]
    assert tok.text == "a"


def test_a_prompt_only_scored_ends_with_its_prompt_out(front):
    st = front.add(prompt=[97, 98], max_new_tokens=0)
    front.proc.process([out("r", [], FinishReason.LENGTH, prompt_logprobs=PromptLogprobs([None, -0.5], [None, 1]))])
    (item,) = drain(st)
    assert isinstance(item, PromptOut) and [t.text for t in item.tokens] == ["a", "b"]
    fin = item.finished
    assert (fin.finish_reason, fin.generated_tokens, fin.prompt_tokens, fin.text) == (FinishReason.LENGTH, 0, 2, "")
    assert front.ends == [("r", FinishReason.LENGTH)] and front.tokens == [] and len(front.proc) == 0


def test_events_end_after_the_finished_token_and_at_a_disconnect(front):
    async def collect(st):
        return [i async for i in st.events()]

    st = front.add(max_new_tokens=2)
    front.proc.process([out("r", [97])])
    front.proc.process([out("r", [98], FinishReason.LENGTH)])
    st.queue.put_nowait(TokenOut(9, 99, "late", 0.0, False))  # never read: the stream ended before it
    assert texts(asyncio.run(collect(st))) == ["a", "b"]

    other = front.add("o")
    front.proc.process([out("o", [97])])
    other.disconnect()
    assert texts(asyncio.run(collect(other))) == ["a"]
    assert front.aborted == ["o"] and other.closed
    other.disconnect()  # a second disconnect does not abort again
    assert front.aborted == ["o"] and drain(other)[-1] is DISCONNECTED


def test_events_past_the_deadline_cancel_and_yield_a_timeout(front):
    st = front.add()
    st.deadline -= 31.0  # already past; the grace is 0 below

    async def collect():
        return [i async for i in st.events(grace_s=0.0)]

    (item,) = asyncio.run(collect())
    assert item.kind == ErrorKind.TIMEOUT and "30 s" in item.message
    assert front.aborted == ["r"] and st.closed
