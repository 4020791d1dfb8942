"""Unmodified real client libraries against a live uvicorn on 127.0.0.1: the openai SDK (chat and
completions, streaming and not), huggingface_hub's InferenceClient (chat_completion, text_generation) and
TGI's own `text_generation` client (sync and async). Each reply is checked against what the model produces
alone (`reference_generate`): greedy requests give the model's greedy tokens, seeded ones are reproducible,
and the counts (tokens, choices, log-probabilities) are right. Bad parameters surface as each library's own
exception, carrying the field at fault."""

from __future__ import annotations

import asyncio
import functools
from typing import Literal

import httpx
import pydantic
import pytest

from engine.stopping import FinishReason
from tests.app_helpers import LiveServer, make_app, reference_generate

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(90),
              # text_generation 0.7.0 calls pydantic's deprecated .dict(): its warning, not ours
              pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")]

CHAT_STOP = ["\nYou:"]  # the default (You: / Model:) template's stop string
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(tiny_ckpt):
    with LiveServer(make_app(tiny_ckpt, max_batch_size=8, max_queue=32)) as server:
        yield server


@pytest.fixture(scope="module")
def ref(live):
    """reference_generate for this server's checkpoint, memoised: ref(prompt, **params)."""
    path = live.app.state.service.checkpoint_path

    @functools.cache
    def cached(prompt: str, items: tuple):
        return reference_generate(path, prompt, **{k: list(v) if isinstance(v, tuple) else v for k, v in items})

    def call(prompt: str, **params):
        return cached(prompt, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                           for k, v in params.items())))

    return call


@pytest.fixture(scope="module")
def chat_prompt(live):
    """The rendered chat prompt for MESSAGES, as the server sees it: (text, token ids), via /tokenize."""
    r = httpx.post(live.url + "/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert r.json()["count"] == len(ids) > 0
    text = httpx.post(live.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "You: hi\nModel:"  # the default transcript template, cued with "Model:"
    return text, ids


def chat_ref(ref, chat_prompt, max_new: int, **params):
    """What the model produces for the rendered chat prompt (the chat stop string applied)."""
    text, ids = chat_prompt
    out = ref(text, max_new_tokens=max_new, stop=CHAT_STOP, **params)
    assert out.prompt == ids  # the prompt the reference ran is the one the server rendered
    return out


@pytest.fixture(scope="module")
def oai(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)


# ------------------------------------------------------------------------------------------ openai SDK: chat
def test_openai_chat_greedy_equals_the_model(oai, ref, chat_prompt):
    expected = chat_ref(ref, chat_prompt, 12, temperature=0)
    c = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert len(c.choices) == 1 and c.choices[0].index == 0
    msg = c.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == expected.text.lstrip()  # the transcript's reply drops the space after "Model:"
    assert c.choices[0].finish_reason == ("length" if expected.finish_reason == FinishReason.LENGTH else "stop")
    assert c.usage.prompt_tokens == len(chat_prompt[1])
    assert c.usage.completion_tokens == len(expected.tokens)
    assert c.usage.total_tokens == len(chat_prompt[1]) + len(expected.tokens)
    assert c.object == "chat.completion" and c.id.startswith("chatcmpl-")


def test_openai_chat_finish_reason_length(oai, ref, chat_prompt):
    expected = chat_ref(ref, chat_prompt, 4, temperature=0)
    assert expected.finish_reason == FinishReason.LENGTH  # 4 tokens: the model cannot finish earlier here
    c = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=4, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 4
    assert c.choices[0].message.content == expected.text.lstrip()


def test_openai_chat_stream_with_usage(oai, ref, chat_prompt):
    expected = chat_ref(ref, chat_prompt, 12, temperature=0)
    stream = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(ch.choices[0].index == 0 for ch in with_choices)
    assert "".join(ch.choices[0].delta.content or "" for ch in with_choices) == expected.text.lstrip()
    reasons = [ch.choices[0].finish_reason for ch in with_choices]
    assert reasons[-1] == ("length" if expected.finish_reason == FinishReason.LENGTH else "stop")
    assert all(r is None for r in reasons[:-1])
    last = chunks[-1]  # the usage chunk: no choices, the counts
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == len(expected.tokens)
    assert last.usage.prompt_tokens == len(chat_prompt[1])
    assert all(ch.usage is None for ch in chunks[:-1])
    assert {ch.id for ch in chunks} == {last.id} and all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_openai_chat_n2_seeded_is_reproducible(oai, ref, chat_prompt):
    def ask(**kw):
        c = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0, **kw)
        return c, [(ch.index, ch.message.content) for ch in c.choices]

    c, first = ask(n=2, seed=7)
    assert [i for i, _ in first] == [0, 1]
    assert ask(n=2, seed=7)[1] == first  # same seed, same choices
    # choice j is seeded seed + j: choice 0 is the model's own seed-7 sample, choice 1 a lone seed-8 request
    assert first[0][1] == chat_ref(ref, chat_prompt, 10, temperature=1.0, seed=7).text.lstrip()
    assert first[1][1] == chat_ref(ref, chat_prompt, 10, temperature=1.0, seed=8).text.lstrip()
    assert ask(seed=8)[1] == [(0, first[1][1])]
    assert c.usage.prompt_tokens == len(chat_prompt[1])  # the prompt counted once, the completions summed
    assert c.usage.completion_tokens == sum(
        len(chat_ref(ref, chat_prompt, 10, temperature=1.0, seed=s).tokens) for s in (7, 8))


def test_openai_chat_stop_sequence(oai, ref, chat_prompt):
    text = chat_prompt[0]
    expected = ref(text, max_new_tokens=10, temperature=1.0, seed=8, stop=["#", *CHAT_STOP])
    assert expected.finish_reason == FinishReason.STOP and expected.text  # stops part-way, after some text
    c = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=8, stop=["#"])
    assert c.choices[0].message.content == expected.text.lstrip() and c.choices[0].finish_reason == "stop"
    assert c.usage.completion_tokens == len(expected.tokens) < 10
    chunks = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=8, stop="#",
                                              stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_chat_logprobs(oai, ref, chat_prompt):
    expected = chat_ref(ref, chat_prompt, 8, temperature=0)
    c = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens == len(expected.tokens)
    assert "".join(t.token for t in content).lstrip() == c.choices[0].message.content
    for t, ev in zip(content, expected.events):
        assert len(t.top_logprobs) == 2
        assert t.logprob == pytest.approx(ev.logprob, abs=1e-4)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
        assert t.bytes == list(t.token.encode())


def test_openai_chat_bad_parameters_raise_bad_request(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1, max_tokens=4)
    assert e.value.status_code == 400
    assert "temperature: must be >= 0" in e.value.message and e.value.param == "temperature"
    assert e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0)
    assert "max_tokens: must be >= 1" in e.value.message and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # at most 5 alternatives by default
        oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=6)
    assert "top_logprobs: must be <= 5" in e.value.message and e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:  # streaming: refused before the stream starts
        oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=125, stream=True)
    assert "max_tokens" in e.value.message and "context length" in e.value.message
    assert e.value.param == "max_tokens"


# ----------------------------------------------------------------------------------- openai SDK: completions
PROMPTS = ["hello", "The king is dead"]


def test_openai_completions_list_of_prompts_n2(oai, ref):
    c = oai.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=6, temperature=0, logprobs=2)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]  # prompt i, choice j → i * n + j
    refs = [ref(p, max_new_tokens=6, temperature=0) for p in PROMPTS]
    for ch in c.choices:
        expected = refs[ch.index // 2]
        assert ch.text == expected.text
        assert ch.finish_reason == ("length" if expected.finish_reason == FinishReason.LENGTH else "stop")
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(expected.tokens)
        assert "".join(lp.tokens) == expected.text
        assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.events], abs=1e-4)
        assert all(len(top) <= 2 for top in lp.top_logprobs)  # alternatives with equal text merge
        assert lp.text_offset[0] == 0
    assert c.usage.prompt_tokens == sum(len(r.prompt) for r in refs)  # each prompt once
    assert c.usage.completion_tokens == 2 * sum(len(r.tokens) for r in refs)  # every choice


def test_openai_completions_seeded_n2_and_stream(oai, ref):
    c = oai.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=8, seed=11)
    texts = [(ch.index, ch.text) for ch in c.choices]
    assert [i for i, _ in texts] == [0, 1, 2, 3]
    again = oai.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=8, seed=11)
    assert [(ch.index, ch.text) for ch in again.choices] == texts
    for index, text in texts:  # choice j of each prompt is that prompt sampled alone with seed 11 + j
        assert text == ref(PROMPTS[index // 2], max_new_tokens=8, temperature=1.0, seed=11 + index % 2).text
    stream = oai.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=8, seed=11, stream=True,
                                    stream_options={"include_usage": True})
    got: dict[int, str] = {}
    chunks = list(stream)
    for ch in chunks[:-1]:
        for choice in ch.choices:
            got[choice.index] = got.get(choice.index, "") + choice.text
    assert sorted(got.items()) == texts
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == c.usage.total_tokens


def test_openai_completions_token_id_prompts(oai, ref):
    refs = [ref(p, max_new_tokens=5, temperature=0) for p in PROMPTS]
    c = oai.completions.create(model="tiny", prompt=[r.prompt for r in refs], max_tokens=5, temperature=0,
                               echo=True)
    assert [(ch.index, ch.text) for ch in c.choices] == [(i, p + r.text) for i, (p, r) in enumerate(zip(PROMPTS, refs))]


def test_openai_completions_echo_logprobs_and_vllm_extensions(oai, ref):
    """What lm-evaluation-harness and benchmark clients send through the SDK: echo + logprobs (the prompt scored,
    the first entry null), max_tokens 0 (scoring only), and vLLM's fields in extra_body."""
    r = ref(PROMPTS[1], max_new_tokens=3, temperature=0)
    c = oai.completions.create(model="tiny", prompt=[r.prompt], max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == len(r.prompt) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) in (1, 2) for t in lp.top_logprobs[1:])
    assert c.choices[0].text == PROMPTS[1] + r.text[:len(c.choices[0].text) - len(PROMPTS[1])]
    score = oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=0, logprobs=0, echo=True)
    assert score.choices[0].finish_reason == "length" and score.usage.completion_tokens == 0
    assert score.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    forced = oai.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0,
                                    logit_bias={"120": 100}, extra_body={"ignore_eos": True, "min_tokens": 4})
    assert forced.choices[0].text == "xxxx"
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=2, logit_bias={"nope": 1})
    assert e.value.param == "logit_bias.nope"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [10**6]})
    assert e.value.param == "stop_token_ids.0" and "out of range" in e.value.message


def test_openai_completions_bad_parameter(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt=PROMPTS, max_tokens=0)
    assert "max_tokens: must be >= 1" in e.value.message and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=2, n=0)
    assert "n: must be >= 1" in e.value.message and e.value.param == "n"


# ---------------------------------------------------------------------------------- huggingface_hub
@pytest.fixture(scope="module")
def hf(live):
    hub = pytest.importorskip("huggingface_hub")
    # base_url: InferenceClient appends /v1/chat/completions for chat, and posts text_generation to the URL
    return hub.InferenceClient(base_url=live.url, timeout=30)


def test_hf_chat_completion(hf, ref, chat_prompt):
    expected = chat_ref(ref, chat_prompt, 10, temperature=0)
    out = hf.chat_completion(MESSAGES, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == expected.text.lstrip()
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == ("length" if expected.finish_reason == FinishReason.LENGTH else "stop")
    assert out.usage.completion_tokens == len(expected.tokens)
    assert out.usage.prompt_tokens == len(chat_prompt[1])
    seeded = [hf.chat_completion(MESSAGES, max_tokens=10, seed=3).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1] == chat_ref(ref, chat_prompt, 10, temperature=1.0, seed=3).text.lstrip()


def test_hf_chat_completion_stream(hf, ref, chat_prompt):
    expected = chat_ref(ref, chat_prompt, 10, temperature=0)
    chunks = list(hf.chat_completion(MESSAGES, max_tokens=10, temperature=0, stream=True))
    with_choices = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in with_choices) == expected.text.lstrip()
    assert with_choices[-1].choices[0].finish_reason == (
        "length" if expected.finish_reason == FinishReason.LENGTH else "stop")
    usage = list(hf.chat_completion(MESSAGES, max_tokens=10, temperature=0, stream=True,
                                    stream_options={"include_usage": True}))[-1].usage
    assert usage.completion_tokens == len(expected.tokens) and usage.prompt_tokens == len(chat_prompt[1])


def test_hf_text_generation(hf, ref):
    expected = ref("hello", max_new_tokens=8, temperature=0)
    assert hf.text_generation("hello", max_new_tokens=8) == expected.text  # no sampling parameter: greedy
    out = hf.text_generation("hello", max_new_tokens=8, details=True)
    assert out.generated_text == expected.text and out.details.finish_reason == expected.finish_reason.value
    assert [t.id for t in out.details.tokens] == expected.tokens
    assert out.details.generated_tokens == len(expected.tokens)
    assert [t.logprob for t in out.details.tokens] == pytest.approx([e.logprob for e in expected.events], abs=1e-4)


def test_hf_text_generation_stream(hf, ref):
    expected = ref("hello", max_new_tokens=8, temperature=0)
    assert "".join(hf.text_generation("hello", max_new_tokens=8, stream=True)) == expected.text
    events = list(hf.text_generation("hello", max_new_tokens=8, stream=True, details=True))
    assert [e.token.id for e in events] == expected.tokens
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == expected.text
    assert events[-1].details.finish_reason == expected.finish_reason.value
    assert events[-1].details.generated_tokens == len(expected.tokens)


# ------------------------------------------------------------------------------------- text_generation
@pytest.fixture(scope="module")
def tg():
    return pytest.importorskip("text_generation")


def test_text_generation_client_generate(live, tg, ref):
    expected = ref("hello", max_new_tokens=8, temperature=0)
    out = tg.Client(live.url, timeout=30).generate("hello", max_new_tokens=8)  # do_sample=False: greedy
    assert out.generated_text == expected.text
    d = out.details  # the client always asks for details
    assert d.finish_reason.value == expected.finish_reason.value and d.generated_tokens == len(expected.tokens)
    assert [t.id for t in d.tokens] == expected.tokens and d.seed is None
    assert [t.logprob for t in d.tokens] == pytest.approx([e.logprob for e in expected.events], abs=1e-4)
    full = tg.Client(live.url, timeout=30).generate("hello", max_new_tokens=8, return_full_text=True)
    assert full.generated_text == "hello" + expected.text
    seeded = ref("hi", max_new_tokens=10, temperature=1.0, seed=4)
    sampled = tg.Client(live.url, timeout=30).generate("hi", max_new_tokens=10, do_sample=True, seed=4)
    assert sampled.generated_text == seeded.text and sampled.details.seed == 4
    top = tg.Client(live.url, timeout=30).generate("hello", max_new_tokens=3, top_n_tokens=2)
    assert len(top.details.top_tokens) == 3 and all(len(t) == 2 for t in top.details.top_tokens)
    prefill = tg.Client(live.url, timeout=30).generate("hello", max_new_tokens=2, decoder_input_details=True)
    p = prefill.details.prefill  # PrefillToken(id, text, logprob): the prompt's tokens, the first without one
    assert [t.id for t in p] == expected.prompt and p[0].logprob is None and all(t.logprob < 0 for t in p[1:])
    assert "".join(t.text for t in p) == "hello"


def test_text_generation_client_generate_stream(live, tg, ref):
    expected = ref("hello", max_new_tokens=8, temperature=0)
    events = list(tg.Client(live.url, timeout=30).generate_stream("hello", max_new_tokens=8))
    assert "".join(e.token.text for e in events if not e.token.special) == expected.text
    assert [e.token.id for e in events] == expected.tokens
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == expected.text
    assert last.details.finish_reason.value == expected.finish_reason.value
    assert last.details.generated_tokens == len(expected.tokens)


def test_text_generation_async_client(live, tg, ref):
    expected = ref("The king is dead", max_new_tokens=7, temperature=0)

    async def go():
        client = tg.AsyncClient(live.url, timeout=30)
        out = await client.generate("The king is dead", max_new_tokens=7)
        events = [e async for e in client.generate_stream("The king is dead", max_new_tokens=7)]
        both = await asyncio.gather(*(client.generate("The king is dead", max_new_tokens=7) for _ in range(3)))
        return out, events, both

    out, events, both = asyncio.run(go())
    assert out.generated_text == expected.text and [t.id for t in out.details.tokens] == expected.tokens
    assert out.details.finish_reason.value == expected.finish_reason.value
    assert "".join(e.token.text for e in events if not e.token.special) == expected.text
    assert [e.token.id for e in events] == expected.tokens
    assert events[-1].generated_text == expected.text
    assert events[-1].details.generated_tokens == len(expected.tokens)
    assert [o.generated_text for o in both] == [expected.text] * 3  # concurrent: batched, same result


def test_text_generation_bad_request_raises_validation_error(live, tg):
    from text_generation.errors import ValidationError

    client = tg.Client(live.url, timeout=30)
    with pytest.raises(ValidationError) as e:  # 422 {"error", "error_type": "validation"}
        client.generate("hello there", max_new_tokens=127)
    assert "parameters.max_new_tokens" in str(e.value) and "context length" in str(e.value)
    with pytest.raises(ValidationError) as e:
        list(client.generate_stream("hi", max_new_tokens=4, typical_p=0.5))
    assert "parameters.typical_p" in str(e.value)

    async def go():
        await tg.AsyncClient(live.url, timeout=30).generate("hi", max_new_tokens=4, watermark=True)

    with pytest.raises(ValidationError) as e:
        asyncio.run(go())
    assert "parameters.watermark" in str(e.value)


# ---------------------------------------------------------------------------------- structured output
class Pet(pydantic.BaseModel):
    """Bounded fields: the tiny random model has no reason to close a string or a number by itself."""

    name: str = pydantic.Field(max_length=6)
    kind: Literal["cat", "dog", "owl"]
    legs: int = pydantic.Field(ge=0, le=8)


def test_openai_parse_with_a_pydantic_model(oai):
    """The SDK's structured-output helper (a strict json_schema response_format) parses our reply."""
    for seed in (1, 2, 3):
        r = oai.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=80,
                                       seed=seed)
        assert isinstance(r.choices[0].message.parsed, Pet)
        assert r.choices[0].finish_reason == "stop"
    again = oai.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=80, seed=3)
    assert again.choices[0].message.parsed == r.choices[0].message.parsed  # seeded: reproducible


def test_openai_json_object_regex_and_choice(oai):
    import json
    import re

    r = oai.completions.create(model="tiny", prompt="hi", max_tokens=60, seed=1,
                               extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(model="tiny", prompt="hi", max_tokens=60, seed=1,
                               extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text)
    # any JSON object: the random model writes long keys, so a double quote is made 3 logits likelier (seed 6: the
    # object closes within 100 tokens); with the stream, the text is what arrived
    chunks = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, seed=6, stream=True,
                                              response_format={"type": "json_object"}, logit_bias={"34": 3.0}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict) and json.loads(text), text


def test_openai_bad_schemas_and_regexes_raise_bad_request(oai):
    import openai

    cases = [(dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
              "response_format.json_schema.schema", "foo"),
             (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "required"),
             (dict(extra_body={"structured_outputs": {"regex": "(("}}), "structured_outputs.regex", "unclosed group"),
             (dict(extra_body={"structured_outputs": {"grammar": 'start: "a" | b'}}), "structured_outputs.grammar",
              "unknown name"),
             (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs",
              "exactly one")]
    for kw, param, reason in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **kw)
        assert e.value.param == param and reason in e.value.message, (kw, e.value.message)
        body = {**kw.get("extra_body", {}), **({"response_format": kw["response_format"]} if "response_format" in kw
                                                else {})}  # the SDK's completions take it as an extra field
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="tiny", prompt="hi", max_tokens=5, extra_body=body)
        assert e.value.param == param


def test_hf_text_generation_with_a_grammar(hf):
    import json
    import re

    schema = Pet.model_json_schema()
    for seed in (1, 2):
        out = hf.text_generation("hello", max_new_tokens=80, seed=seed, details=True,
                                 grammar={"type": "json", "value": schema})
        Pet.model_validate(json.loads(out.generated_text))
        assert out.details.finish_reason == "stop_sequence"  # the grammar is complete
    text = hf.text_generation("hello", max_new_tokens=20, seed=1, grammar={"type": "regex", "value": "[a-c]{2,4}!"})
    assert re.fullmatch("[a-c]{2,4}!", text)
    streamed = "".join(hf.text_generation("hello", max_new_tokens=20, seed=1, stream=True,
                                          grammar={"type": "regex", "value": "[a-c]{2,4}!"}))
    assert streamed == text


def test_tgi_bad_grammars_are_422_naming_the_field(live):
    for grammar, reason in [({"type": "regex", "value": "(("}, "unclosed group"),
                            ({"type": "json", "value": {"type": "foo"}}, "foo"),
                            ({"type": "json", "value": "{nope"}, "not valid JSON"),
                            ({"type": "regex", "value": {"a": 1}}, "must be a string")]:
        r = httpx.post(live.url + "/generate", json={"inputs": "hi", "parameters": {"grammar": grammar}})
        assert r.status_code == 422, r.text
        assert r.json()["error"].startswith("parameters.grammar:") and reason in r.json()["error"], r.text
