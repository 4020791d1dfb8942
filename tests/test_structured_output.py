"""Structured output (engine/structured_output.py) through the engine core: every sampled output follows its grammar
(JSON schemas validated with `jsonschema`, regexes `fullmatch`, JSON objects parse), with the bundled Shakespeare
model and with a random GPT-2-vocabulary model; requests end when their grammar is complete; constrained rows
leave the unconstrained ones of their batch untouched; seeded requests stay reproducible; bad specs are refused
with the library's reason. A handful of samples here; 200 per schema under the slow marker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from bench.structured import SCHEMAS
from engine.core import EngineCore
from engine.params import SamplingParams
from engine.request import EngineRequest, ErrorKind, StructuredSpec
from engine.stopping import FinishReason
from engine.structured_output import GrammarError, Grammars, Matchers, grammar_text
from model.checkpoint import load_checkpoint
from tests.helpers import tiny_model

REPO = Path(__file__).resolve().parents[1]
# [0-9], not \d: the library's \d is any Unicode decimal digit of a newer Unicode than Python 3.11's `re` knows
# (a sampled U+1E4F7, NAG MUNDARI DIGIT SEVEN, matched the grammar and failed re.fullmatch)
REGEX = r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]) [A-Z][a-z]{2,12}"
MAX_NEW = 200


# ---------------------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def shakespeare():
    ck = load_checkpoint(REPO / "checkpoints" / "shakespeare")
    return ck.model, ck.tokenizer


def json_prone_gpt2(tokenizer):
    """A random GPT-2-vocabulary model (tiny preset, seed 0) that closes what it opens.

    A random model is near-uniform over the ~50k tokens, so inside a JSON string or number it would pick a
    closing token (`"`, `,`, `}`, ...) once in hundreds of steps, and an unbounded string never ends within
    max_tokens. So, as bench/stack.py pins <|endoftext|>, every token holding one of `"`, `,`, `}`, `]` gets a
    fixed logit of +7 (ln_f's bias 1 and the token's tied embedding row all 7 / n_embd: the LayerNorm part
    sums to zero); the rest stays random. The grammar still decides which of them may come."""
    model = tiny_model(0, vocab_size=tokenizer.vocab_size, block_size=256)
    closers = [i for i in range(tokenizer.vocab_size - 1) if any(c in tokenizer.token_bytes(i) for c in b'",}]')]
    with torch.no_grad():
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[closers] = 7.0 / model.config.n_embd
    return model


@pytest.fixture(scope="module")
def gpt2(gpt2_tokenizer):
    return json_prone_gpt2(gpt2_tokenizer), gpt2_tokenizer


def specs() -> dict[str, StructuredSpec]:
    out = {name: StructuredSpec("json_schema", json.dumps(schema)) for name, (schema, _) in SCHEMAS.items()}
    out["json_object"] = StructuredSpec("json_object")
    out["regex"] = StructuredSpec("regex", REGEX)
    out["choice"] = StructuredSpec("choice", json.dumps(["to be", "not to be", "Ophelia"]))
    out["grammar"] = StructuredSpec("grammar", 'root ::= "(" [0-9] (" + " [0-9])? (" + " [0-9])? ")"')  # GBNF
    return out


def check(name: str, spec: StructuredSpec, text: str) -> None:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMAS[name][0])
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    elif spec.kind == "choice":
        assert text in json.loads(spec.value)
    else:
        assert re.fullmatch(r"\([0-9]( \+ [0-9]){0,2}\)", text), text


def run(model, tok, reqs: list[EngineRequest], n_slots: int = 16, **kw) -> dict[str, list]:
    core = EngineCore(model, n_slots=n_slots, vocab_size=tok.vocab_size, eos_id=tok.eot_id, tokenizer=tok,
                      cuda_graphs=False, pad_vocab=False, **kw)
    for r in reqs:
        core.add(r)
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    while core.has_work():
        for o in core.step():
            assert o.error is None, o.message
            out[o.request_id].append(o)
    return out


def text_of(tok, outs) -> str:
    return tok.decode([t for o in outs for t in o.token_ids if t != tok.eot_id])


def sample_all(model, tok, names: list[str], n: int, temperature: float = 1.0, seed0: int = 0, **kw) -> None:
    """n samples of each spec in one engine (the specs mix in its batches); every output follows its grammar."""
    sp = specs()
    prompt = tok.encode("JSON:\n")
    reqs = [EngineRequest(f"{name}/{i}", prompt, SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature,
                                                                **kw), seed=seed0 + i, structured=sp[name])
            for name in names for i in range(n)]
    got = run(model, tok, reqs, n_slots=min(64, len(reqs)))
    for rid, outs in got.items():
        name = rid.split("/")[0]
        text = text_of(tok, outs)
        assert outs[-1].finish in (FinishReason.STOP, FinishReason.EOS), (rid, outs[-1].finish, text)
        check(name, sp[name], text)


# ---------------------------------------------------------------------------------------------- outputs
SHAKESPEARE_SPECS = [*SCHEMAS, "regex", "choice", "grammar"]  # its keys and strings are prose: no json_object
GPT2_SPECS = [*SCHEMAS, "json_object", "regex", "choice", "grammar"]


def test_shakespeare_outputs_follow_their_grammar(shakespeare):
    sample_all(*shakespeare, SHAKESPEARE_SPECS, n=1)


def test_gpt2_vocabulary_outputs_follow_their_grammar(gpt2):
    sample_all(*gpt2, GPT2_SPECS, n=2, top_p=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["shakespeare", "gpt2"])
def test_200_samples_per_schema(which, request):
    model, tok = request.getfixturevalue(which)
    names = SHAKESPEARE_SPECS if which == "shakespeare" else GPT2_SPECS
    for name in names:
        sample_all(model, tok, [name], n=200, seed0=1000)


def test_greedy_top_k_and_penalties_stay_within_the_grammar(shakespeare):
    model, tok = shakespeare
    sp = specs()
    prompt = tok.encode("JSON:\n")
    params = [dict(temperature=0), dict(temperature=0.8, top_k=5), dict(temperature=1.3, top_p=0.5),
              dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0)]
    reqs = [EngineRequest(str(i), prompt, SamplingParams(max_new_tokens=MAX_NEW, **p), seed=i, structured=sp["nested"])
            for i, p in enumerate(params)]
    for outs in run(model, tok, reqs).values():
        check("nested", sp["nested"], text_of(tok, outs))


# ---------------------------------------------------------------------------------------------- ending
def test_a_complete_grammar_finishes_with_stop_and_length_cuts_it_short(shakespeare):
    model, tok = shakespeare
    prompt = tok.encode("JSON:\n")
    done = run(model, tok, [EngineRequest("c", prompt, SamplingParams(max_new_tokens=50, temperature=1.0), seed=1,
                                          structured=StructuredSpec("choice", '["Ophelia"]'))])["c"]
    assert text_of(tok, done) == "Ophelia"
    assert done[-1].finish == FinishReason.STOP  # nothing can follow: it ends without sampling <|endoftext|>
    assert tok.eot_id not in [t for o in done for t in o.token_ids]
    cut = run(model, tok, [EngineRequest("r", prompt, SamplingParams(max_new_tokens=3, temperature=1.0), seed=1,
                                         structured=StructuredSpec("json_schema", json.dumps(SCHEMAS["record"][0])))])
    assert cut["r"][-1].finish == FinishReason.LENGTH and len(cut["r"]) == 3  # incomplete JSON, as OpenAI's


def test_eos_is_allowed_exactly_where_the_grammar_may_end(gpt2):
    """`a+` may end after any a: its requests end with <|endoftext|> (EOS), never before an a. EOS half a logit
    likelier: each of these seeded requests ends on it (after 1 to 11 a-tokens)."""
    model, tok = gpt2
    spec = StructuredSpec("regex", "a+")
    reqs = [EngineRequest(str(i), tok.encode("x"), SamplingParams(max_new_tokens=40, temperature=1.0,
                                                                  logit_bias={tok.eot_id: 0.5}),
                          seed=i, structured=spec) for i in range(8)]
    for outs in run(model, tok, reqs).values():
        ids = [t for o in outs for t in o.token_ids]
        assert outs[-1].finish == FinishReason.EOS, ids
        assert ids[-1] == tok.eot_id and tok.eot_id not in ids[:-1]
        assert re.fullmatch("a+", tok.decode(ids[:-1]))


def test_abort_and_finish_drop_the_matchers(shakespeare):
    model, tok = shakespeare
    core = EngineCore(model, n_slots=2, vocab_size=tok.vocab_size, eos_id=tok.eot_id, tokenizer=tok,
                      cuda_graphs=False, pad_vocab=False)
    spec = StructuredSpec("regex", "[a-z]{1,30}")
    for rid in "ab":
        core.add(EngineRequest(rid, tok.encode("x"), SamplingParams(max_new_tokens=30), seed=0, structured=spec))
    core.step()
    core.abort(["a"])
    assert "a" not in core.matchers and "b" in core.matchers
    while core.has_work():
        core.step()
    assert len(core.matchers) == 0


def test_a_grammar_that_fails_while_decoding_ends_the_request_with_an_error(shakespeare):
    # `a{1000000}` compiles and gives its first mask, then the library's lexer hits its limit on the first `a`
    # ("too many expressions constructed"): the request ends with an error naming it, not as a complete grammar
    # (FinishReason.STOP) with the refused token in its text; the request beside it is untouched
    model, tok = shakespeare
    core = EngineCore(model, n_slots=2, vocab_size=tok.vocab_size, eos_id=tok.eot_id, tokenizer=tok,
                      cuda_graphs=False, pad_vocab=False)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    core.add(EngineRequest("big", tok.encode("x"), params, seed=0, structured=StructuredSpec("regex", "a{1000000}")))
    core.add(EngineRequest("ok", tok.encode("x"), params, seed=0, structured=StructuredSpec("regex", "a{1,10}")))
    outs: dict[str, list] = {"big": [], "ok": []}
    while core.has_work():
        for o in core.step():
            outs[o.request_id].append(o)
    last = outs["big"][-1]
    assert last.error == ErrorKind.INVALID and last.finish is None and not last.token_ids
    assert "structured output" in last.message and "too many expressions" in last.message
    assert [t for o in outs["big"] for t in o.token_ids] == []
    assert text_of(tok, outs["ok"]) == "aaaaa" and outs["ok"][-1].finish == FinishReason.LENGTH
    assert len(core.matchers) == 0
    assert last.message.endswith("lexer error: too many expressions constructed")  # not the parser's state dump
    # the same grammar again fails the same way: the failure does not leave later copies of the compiled grammar
    # failed from the start (they allowed only <|endoftext|>: an empty text, finish STOP, no error)
    core.add(EngineRequest("again", tok.encode("x"), params, seed=0, structured=StructuredSpec("regex", "a{1000000}")))
    again = [o for _ in range(3) if core.has_work() for o in core.step()]
    assert again[-1].error == ErrorKind.INVALID and "too many expressions" in again[-1].message


# ---------------------------------------------------------------------------------------------- batches
def test_unconstrained_requests_give_the_same_tokens_beside_constrained_ones(gpt2):
    model, tok = gpt2
    sp = specs()
    prompt = tok.encode("The quick brown fox")
    free = [EngineRequest(f"free{i}", prompt, SamplingParams(max_new_tokens=20, **p), seed=i, top_n=2)
            for i, p in enumerate([dict(temperature=0), dict(temperature=0.9), dict(temperature=1.0, top_p=0.8),
                                   dict(temperature=0.7, top_k=20)])]
    alone = run(model, tok, free)
    bound = [EngineRequest(f"c{i}", prompt, SamplingParams(max_new_tokens=20, temperature=1.0), seed=i,
                           structured=sp[name]) for i, name in enumerate(["record", "regex", "json_object"])]
    mixed = run(model, tok, [bound[0], *free[:2], bound[1], *free[2:], bound[2]])
    for r in free:
        a, m = alone[r.request_id], mixed[r.request_id]
        assert [o.token_ids for o in m] == [o.token_ids for o in a]
        assert [o.logprobs for o in m] == [o.logprobs for o in a]
        assert [o.top for o in m] == [o.top for o in a]


def test_seeded_constrained_requests_are_reproducible_alone_or_batched(gpt2):
    model, tok = gpt2
    sp = specs()
    prompt = tok.encode("JSON:\n")
    mk = lambda i, name: EngineRequest(f"{name}{i}", prompt, SamplingParams(max_new_tokens=30, temperature=1.0),  # noqa: E731
                                       seed=7 + i, structured=sp[name])
    batch = run(model, tok, [mk(i, n) for i in range(2) for n in ("nested", "regex")], n_slots=3)
    for i in range(2):
        for n in ("nested", "regex"):
            solo = run(model, tok, [mk(i, n)], n_slots=1)[f"{n}{i}"]
            assert [o.token_ids for o in solo] == [o.token_ids for o in batch[f"{n}{i}"]]


def test_logprobs_are_under_the_raw_distribution(gpt2):
    """A constrained token's logprob and top-n are the model's own, as without the grammar."""
    model, tok = gpt2
    prompt = tok.encode("JSON:\n")
    spec = StructuredSpec("json_schema", json.dumps(SCHEMAS["enum"][0]))
    outs = run(model, tok, [EngineRequest("c", prompt, SamplingParams(max_new_tokens=30, temperature=0), seed=0,
                                          top_n=3, structured=spec)])["c"]
    ids = [o.token_ids[0] for o in outs]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids]), targets=torch.tensor([prompt + ids]))[0][0]  # every position
    lp = torch.log_softmax(logits.float(), -1)
    for j, (o, t) in enumerate(zip(outs, ids)):
        row = lp[len(prompt) - 1 + j]
        assert o.logprobs[0] == pytest.approx(row[t].item(), abs=1e-4)
        assert [i for i, _ in o.top[0]] == row.topk(3).indices.tolist()  # unmasked: mostly not even allowed


# ---------------------------------------------------------------------------------------------- compiling
def test_the_parallel_fill_gives_the_rows_of_the_serial_one(shakespeare):
    """With cores to spare (threads >= 4) Matchers fills through llguidance's thread pool: the same rows, in the
    order asked, as the one-thread loop, with the requests' grammars in different states."""
    _, tok = shakespeare
    g = Grammars.for_tokenizer(tok)
    serial, par = Matchers(g, 8, threads=1), Matchers(g, 8, threads=4)
    assert serial._executor is None and par._executor is not None
    ids = [f"r{i}" for i in range(5)]
    for rid, name in zip(ids, ["object", "regex", "json_object", "nested", "grammar"]):
        serial.add(rid, specs()[name])
        par.add(rid, specs()[name])
    for step in range(4):
        order = ids if step % 2 == 0 else ids[::-1]
        rows = serial.fill(order).clone()
        assert torch.equal(par.fill(order), rows)
        for rid, row in zip(order, rows.tolist()):  # each takes its lowest allowed token
            j = next(j for j, w in enumerate(row) if w)
            token = 32 * j + ((row[j] & -row[j]).bit_length() - 1)
            assert serial.accept(rid, token)[0] and par.accept(rid, token)[0]


def test_compiled_grammars_are_cached_by_spec(gpt2_tokenizer):
    g = Grammars.for_tokenizer(gpt2_tokenizer)
    assert Grammars.for_tokenizer(gpt2_tokenizer) is g
    spec = StructuredSpec("json_schema", json.dumps({"type": "object", "properties": {"zz": {"type": "integer"}}}))
    before = g.compiles
    g.compile(spec)
    g.compile(StructuredSpec(spec.kind, spec.value))
    g.matcher(spec)
    assert g.compiles == before + 1


@pytest.mark.parametrize("kind,value,reason", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("json_schema", '{"type": "foo"}', "foo"),
    ("json_schema", '{"$ref": "#/nowhere"}', "nowhere"),
    ("json_schema", '{"type": "string", "pattern": "(("}', "unclosed group"),
    ("regex", "((", "unclosed group"),
    ("regex", "a{2,1}", "repetition"),
    ("regex", "", "must not be empty"),
    ("grammar", 'start: "a" | b', 'unknown name: "b"'),
    ("choice", "[]", "non-empty list"),
    ("choice", '["a", 3]', "non-empty list"),
    ("xml", "<a/>", "unknown kind"),
])
def test_bad_specs_are_refused_with_the_library_reason(gpt2_tokenizer, kind, value, reason):
    with pytest.raises(GrammarError, match=re.escape(reason)):
        Grammars.for_tokenizer(gpt2_tokenizer).compile(StructuredSpec(kind, value))


def test_the_engine_refuses_a_bad_spec_and_a_grammar_without_a_tokenizer(shakespeare):
    model, tok = shakespeare
    core = EngineCore(model, n_slots=1, vocab_size=tok.vocab_size, eos_id=tok.eot_id, tokenizer=tok,
                      cuda_graphs=False, pad_vocab=False)
    with pytest.raises(ValueError, match="unclosed group"):
        core.add(EngineRequest("a", [1], SamplingParams(), seed=0, structured=StructuredSpec("regex", "((")))
    assert not core.has_work()
    bare = EngineCore(model, n_slots=1, vocab_size=tok.vocab_size, eos_id=tok.eot_id, cuda_graphs=False,
                      pad_vocab=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.add(EngineRequest("a", [1], SamplingParams(), seed=0, structured=StructuredSpec("regex", "a")))


def test_grammar_text_needs_no_tokenizer():
    assert grammar_text(StructuredSpec("grammar", 'root ::= "yes" | "no"'))
    assert grammar_text(StructuredSpec("grammar", 'start: "yes" | "no"'))
