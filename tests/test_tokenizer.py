"""Tokenizers and streaming detokenization; stop strings across token boundaries."""

from __future__ import annotations

import pytest

from engine.params import SamplingParams
from engine.sequence import Sequence
from engine.stopping import FinishReason, StopMatcher
from model.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from tests.helpers import write_byte_ranks

TEXT = "naïve 東京 🙂 café — ½ done\n\tend"


@pytest.mark.parametrize("which", ["bytes", "gpt2"])
def test_streaming_detokenization_never_breaks_a_character(which, byte_tokenizer, request):
    tok = byte_tokenizer if which == "bytes" else request.getfixturevalue("gpt2_tokenizer")
    ids = tok.encode(TEXT)
    dec = tok.stream_decoder()
    pieces = [dec.feed(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some character really did span several tokens


def test_gpt2_encoding_and_eot(gpt2_tokenizer):
    assert gpt2_tokenizer.eot_id == 50256 and gpt2_tokenizer.vocab_size == 50257
    assert gpt2_tokenizer.encode("Hello world") == [15496, 995]
    assert gpt2_tokenizer.encode("<|endoftext|>") == [50256]
    assert gpt2_tokenizer.encode("<|endoftext|>", allow_special=False) != [50256]
    assert Tokenizer.load("gpt2").spec == {"type": "tiktoken", "name": "gpt2"}


def test_ranks_file_tokenizer(tmp_path):
    path = write_byte_ranks(tmp_path / "t.tiktoken", [b"ab"])
    tok = Tokenizer.from_ranks_file(path)
    assert tok.eot_id == 257 and tok.vocab_size == 258
    assert tok.encode("abc") == [256, ord("c")]
    assert load_tokenizer(tok.spec, tmp_path).encode("abc") == [256, ord("c")]


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        Tokenizer.named("cl100k_nope")
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_ranks_file(tmp_path / "missing.tiktoken")
    (tmp_path / "bad.tiktoken").write_text("this is not base64 ranks\n")
    with pytest.raises(TokenizerError, match="not a valid .tiktoken"):
        Tokenizer.from_ranks_file(tmp_path / "bad.tiktoken")
    with pytest.raises(TokenizerError, match="unknown tokenizer type"):
        load_tokenizer({"type": "sentencepiece"}, tmp_path)


def test_stop_matcher_across_boundaries():
    m = StopMatcher(["\n\n", "END"])
    assert m.feed("hello\n") == ("hello", False)  # "\n" could start "\n\n": held back
    assert m.feed("world E") == ("\nworld ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dgame") == ("", True)  # "END" completed across three pieces; not released
    m = StopMatcher(["abc"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("x") == ("abx", False)
    assert m.flush() == ""


def _run(tok: Tokenizer, text: str, params: SamplingParams) -> Sequence:
    """The reader's side of a request fed `text`'s tokens, with the core's finish decisions (EOS, length)."""
    seq = Sequence([0], params, tok, seed=0)
    for i in tok.encode(text):
        finish = (FinishReason.EOS if i == tok.eot_id and params.stop_at_eos
                  else FinishReason.LENGTH if len(seq.tokens) + 1 >= params.max_new_tokens else None)
        seq.append(i, -0.5, finish)
        if seq.done:
            break
    return seq


def test_sequence_stop_string_not_returned(byte_tokenizer):
    seq = _run(byte_tokenizer, "To be, or not to be", SamplingParams(max_new_tokens=100, stop=["or not"]))
    assert seq.text == "To be, " and seq.finish_reason == FinishReason.STOP


def test_sequence_finish_reasons(byte_tokenizer):
    seq = _run(byte_tokenizer, "abcdef", SamplingParams(max_new_tokens=3, stop=["cd"]))
    assert seq.text == "abc" and seq.finish_reason == FinishReason.LENGTH  # held "c" released at the end
    seq = _run(byte_tokenizer, "ab<|endoftext|>cd", SamplingParams(max_new_tokens=50))
    assert seq.text == "ab" and seq.finish_reason == FinishReason.EOS
    assert seq.events[-1].special and seq.tokens[-1] == byte_tokenizer.eot_id
    # the text of all events concatenated is the generated text, multi-byte characters included
    seq = _run(byte_tokenizer, TEXT, SamplingParams(max_new_tokens=500))
    assert "".join(e.text for e in seq.events) == seq.text == TEXT


def test_extra_special_tokens_round_trip_through_the_spec(tmp_path, gpt2_tokenizer):
    path = write_byte_ranks(tmp_path / "t.tiktoken", [b"ab"])
    tok = Tokenizer.from_ranks_file(path).with_special_tokens(["[Start]", "[Extract]"])
    assert tok.spec == {"type": "tiktoken_file", "file": "t.tiktoken", "special_tokens": {"[Start]": 258,
                                                                                         "[Extract]": 259}}
    assert tok.vocab_size == 260 and tok.eot_id == 257
    again = load_tokenizer(tok.spec, tmp_path)
    assert again.special_tokens == {"<|endoftext|>": 257, "[Start]": 258, "[Extract]": 259}
    assert again.decode([258, 256, 259]) == "[Start]ab[Extract]" and again.token_bytes(259) == b"[Extract]"
    # written in text they are plain text, whatever allow_special says; <|endoftext|> keeps its rule
    assert again.encode("[Start]ab") == again.encode("[Start]ab", allow_special=False) == [91, *b"Start", 93, 256]
    assert again.encode("<|endoftext|>") == [257]
    named = gpt2_tokenizer.with_special_tokens(["[Start]"])
    assert named.special_tokens["[Start]"] == 50257 and load_tokenizer(named.spec, tmp_path).vocab_size == 50258
    for bad in ({"[Start]": 100}, {"<|endoftext|>": 300}, {"[A]": 258, "[B]": 258}, ["[Start]"]):
        with pytest.raises(TokenizerError):
            load_tokenizer({**tok.spec, "special_tokens": bad}, tmp_path)


def test_a_stop_token_id_leaves_its_text_out_but_a_complete_grammar_keeps_it(tmp_path):
    """FinishReason.STOP from the core means a stop_token_id (no text, as vLLM) or a grammar that is complete (the
    token is part of the answer): the sequence tells them apart by the request's stop_token_ids."""
    tok = Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "t.tiktoken", []))
    ids = tok.encode("yes")
    for stop_ids, text in (([], "yes"), ([ids[-1]], "ye")):
        seq = Sequence([1], SamplingParams(max_new_tokens=8, stop_token_ids=stop_ids), tok, seed=0)
        for t in ids[:-1]:
            seq.append(t, -1.0)
        seq.append(ids[-1], -1.0, FinishReason.STOP)
        assert seq.text == text and seq.finish_reason == FinishReason.STOP
