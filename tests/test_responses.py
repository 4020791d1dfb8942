"""POST /v1/responses with the unmodified openai SDK (`responses.create`, `.stream`, `.parse`) against the bundled
Shakespeare model on a live server: a response is the chat reply to the same messages (instructions first), a
stream's events come in OpenAI's order and add up to the response, text.format json_schema and function tools
constrain the output, previous_response_id continues a stored conversation (a bounded store), and unsupported
fields are 400s naming them."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pydantic
import pytest

from app.responses import ResponseStore
from tests.app_helpers import LiveServer, make_app
from tests.helpers import REPO

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

BUNDLED = REPO / "checkpoints" / "shakespeare"
SCENE = {"type": "object", "properties": {"place": {"type": "string", "enum": ["Verona", "Mantua", "Padua"]}},
         "required": ["place"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "find_scene", "description": "look up a scene", "parameters": SCENE},
         {"type": "function", "name": "find_act", "parameters": {
             "type": "object", "properties": {"act": {"type": "integer", "minimum": 1, "maximum": 5}},
             "required": ["act"], "additionalProperties": False}}]


class Speaker(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties false: no keys of the model's own
    name: str = pydantic.Field(max_length=8)
    mood: Literal["glad", "sad"]


@pytest.fixture(scope="module")
def live():
    with LiveServer(make_app(BUNDLED, max_batch_size=4, max_queue=16, warmup=False, responses_store=3),
                    start_timeout=120) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_response_is_the_chat_reply_to_the_same_messages(oai):
    r = oai.responses.create(model="m", instructions="Speak as a Capulet.", input="Who is Romeo?",
                             max_output_tokens=12, extra_body={"seed": 3})
    chat = oai.chat.completions.create(model="m", messages=[{"role": "system", "content": "Speak as a Capulet."},
                                                            {"role": "user", "content": "Who is Romeo?"}],
                                       max_tokens=12, seed=3)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    item = r.output[0]
    assert len(r.output) == 1 and item.type == "message" and item.role == "assistant"
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    # input as messages (text parts) is the same request
    again = oai.responses.create(model="m", instructions="Speak as a Capulet.", max_output_tokens=12,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": "Who is Romeo?"}]}],
                                 extra_body={"seed": 3})
    assert again.output_text == r.output_text


def test_a_stream_sends_openais_events_in_order(oai):
    kw = dict(model="m", input="Who is Romeo?", max_output_tokens=10, extra_body={"seed": 4})
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    n = types.count("response.output_text.delta")
    assert n >= 1 and types[4:4 + n] == ["response.output_text.delta"] * n
    assert types[4 + n:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                             "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[4 + n].text
    last = events[-1].response
    assert last.id == events[0].response.id and last.output_text == text
    assert last.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema_and_parse(oai):
    schema = Speaker.model_json_schema()
    fmt = {"format": {"type": "json_schema", "name": "speaker", "schema": schema, "strict": True}}
    for seed in (1, 2):
        r = oai.responses.create(model="m", input="Who speaks?", text=fmt, max_output_tokens=120,
                                 extra_body={"seed": seed})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)
    with oai.responses.stream(model="m", input="Who speaks?", text=fmt, max_output_tokens=120,
                              extra_body={"seed": 1}) as stream:
        final = stream.get_final_response()  # the SDK's helper: needs response.completed
    jsonschema.validate(json.loads(final.output_text), schema)
    parsed = oai.responses.parse(model="m", input="Who speaks?", text_format=Speaker, max_output_tokens=120,
                                 extra_body={"seed": 2})
    assert isinstance(parsed.output_parsed, Speaker)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "find_act"}])
def test_function_tools_give_function_call_items(oai, choice):
    kw = dict(model="m", input="Where are we?", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
              max_output_tokens=120, extra_body={"seed": 1})
    r = oai.responses.create(**kw)
    assert r.status == "completed" and len(r.output) == 1
    call = r.output[0]
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    schema = {t["name"]: t["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    if isinstance(choice, dict):
        assert call.name == "find_act"
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments and final.output[0].name == call.name


def test_previous_response_id_continues_the_conversation(oai, live):
    first = oai.responses.create(model="m", input="Who is Romeo?", max_output_tokens=6, extra_body={"seed": 1})
    second = oai.responses.create(model="m", input="And Juliet?", previous_response_id=first.id,
                                  max_output_tokens=6, extra_body={"seed": 1})
    messages = [{"role": "user", "content": "Who is Romeo?"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And Juliet?"}]
    count = httpx.post(live.url + "/tokenize", json={"messages": messages}).json()["count"]
    assert second.usage.input_tokens == count and second.previous_response_id == first.id
    # store=false keeps nothing; the store holds the last 3 (GPT_RESPONSES_STORE here): older ids are refused
    import openai

    unstored = oai.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    for _ in range(3):
        oai.responses.create(model="m", input="hi", max_output_tokens=2)
    for gone in (unstored.id, first.id):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model="m", input="x", previous_response_id=gone, max_output_tokens=2)
        assert e.value.param == "previous_response_id" and "last 3 responses" in e.value.message


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [])
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") == []
    off = ResponseStore(0)
    off.put("a", [])
    assert off.get("a") is None


def test_unsupported_fields_are_400s_naming_them(oai, live):
    import openai

    cases = [(dict(tools=[{"type": "web_search"}]), "tools.0.type"),
             (dict(reasoning={"effort": "low"}), "reasoning"),
             (dict(background=True), "background"),
             (dict(truncation="auto"), "truncation"),
             (dict(include=["message.output_text.logprobs"]), "include"),
             (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
              "input.0.content.0"),
             (dict(input=[{"type": "reasoning", "summary": []}]), "input.0.type"),
             (dict(input=[{"type": "function_call", "call_id": "c", "name": "find_scene", "arguments": "{}"}]),
              "input"),  # the transcript template cannot render calls
             (dict(tools=TOOLS), "tool_choice"),  # auto, and the transcript template cannot show tools
             (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
             (dict(tools=[{**TOOLS[0], "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}],
                   tool_choice="required"), "tools.0.parameters"),
             (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}),
              "text.format.schema"),
             (dict(text={"format": {"type": "json_schema", "schema": {}}}), "text.format.name"),
             (dict(max_output_tokens=100_000), "max_output_tokens")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model="m", **{"input": "hi", "max_output_tokens": 3, **kw})
        assert e.value.param == param and f"{param}:" in e.value.message, (kw, e.value)
    r = httpx.post(live.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "conversation": "c"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation"
