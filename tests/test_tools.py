"""Tool calling (app/tools.py) with the unmodified openai SDK against a live server: `required` and a named
function give calls whose arguments follow the function's schema (jsonschema), streamed and not, with the bundled
Shakespeare model (transcript template) and a random GPT-2-vocabulary model carrying the SFT template (which
renders tools); `auto` parses Hermes calls; tool history renders; bad tools are 400s naming the field and leave
later requests unharmed. The readers are also checked alone: a stream's deltas add up to the whole reply."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from app.tools import ForcedCalls, HermesCalls, NamedCall
from model.chat_template import SFT_TEMPLATE, ChatTemplate
from tests.app_helpers import LiveServer, make_app
from tests.helpers import REPO, tiny_model

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

CHARACTER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                              "act": {"type": "integer", "minimum": 1, "maximum": 5}},
             "required": ["name", "act"], "additionalProperties": False}
SCENE = {"type": "object", "properties": {"place": {"type": "string", "enum": ["Verona", "Mantua", "Padua"]}},
         "required": ["place"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "find_character", "description": "look up a character",
                                           "parameters": CHARACTER}},
         {"type": "function", "function": {"name": "find_scene", "description": "look up a scene",
                                           "parameters": SCENE}}]
SCHEMA = {"find_character": CHARACTER, "find_scene": SCENE}
MESSAGES = [{"role": "user", "content": "Who is Romeo?"}]


# ------------------------------------------------------------------------------------------------ readers
def deltas_to_calls(deltas: list[dict]) -> list[dict]:
    """What a client assembles from streamed tool_calls deltas (the openai SDK's and LangChain's rule)."""
    calls: list[dict] = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            calls[tc["index"]]["arguments"] += tc["function"].get("arguments") or ""
    return calls


def read(reader, text: str, step: int | None) -> tuple[list[dict], list[dict]]:
    """Feed `text` whole (step None) or `step` characters at a time: (deltas, the reader's calls)."""
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    deltas = [d for p in pieces for d in reader.feed(p)] + reader.close()
    return deltas, [{"id": c["id"], **c["function"]} for c in reader.tool_calls]


@pytest.mark.parametrize("step", [None, 1, 3])
def test_forced_calls_read_as_they_arrive(step):
    args = [{"q": 'a}"]b{', "n": [1, {"x": "\\"}]}, {}]
    text = json.dumps([{"name": "f", "parameters": args[0]}, {"name": "g_2", "parameters": args[1]}])
    deltas, calls = read(ForcedCalls(), text, step)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", args[0]), ("g_2", args[1])]
    assert deltas_to_calls(deltas) == calls  # the stream adds up to the whole
    assert all("content" not in d for d in deltas)


def test_a_named_call_is_the_whole_output_and_a_cut_one_is_kept():
    deltas, calls = read(NamedCall("f"), '{"a": 1}', 2)
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a": 1}')] and deltas_to_calls(deltas) == calls
    reader = ForcedCalls()
    _, calls = read(reader, '[{"name": "f", "parameters": {"a": "x', 4)  # max_tokens cut it
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a": "x')]
    reader = ForcedCalls()
    read(reader, '[{"na', None)
    assert reader.tool_calls == [] and reader.content == '[{"na'


@pytest.mark.parametrize("step", [None, 1, 5])
def test_hermes_calls_and_text(step):
    text = ('Let me look.\n<tool_call>{"name": "find_scene", "arguments": {"place": "Verona"}}</tool_call>\n'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call> x <tool_call>{"name": "find_scene", '
            '"arguments": {"place": "Padua"}}</tool_call>\n<tool_call>{"name": "find_scene", "arguments": {}}')
    reader = HermesCalls({"find_scene"})
    deltas, calls = read(reader, text, step)
    assert [json.loads(c["arguments"]) for c in calls] == [{"place": "Verona"}, {"place": "Padua"}, {}]
    assert deltas_to_calls(deltas) == calls
    # an unknown function stays text; a call cut off by max_tokens without its closing tag is still read
    text_part = 'Let me look.\n\n<tool_call>{"name": "nope", "arguments": {}}</tool_call> x \n'
    assert "".join(d.get("content", "") for d in deltas) == text_part
    assert reader.content == text_part.strip()  # with calls, the text around them trimmed


def test_hermes_holds_back_only_what_may_be_a_tag():
    reader = HermesCalls({"f"})
    assert reader.feed("a <tool_") == [{"content": "a "}]
    assert reader.feed("x> b") == [{"content": "<tool_x> b"}]
    assert reader.close() == [] and reader.content == "a <tool_x> b" and reader.tool_calls == []


def test_auto_needs_a_parser_and_the_setting_names_the_parsers(gpt2_tokenizer):
    from typing import get_args

    from app.config import Settings
    from app.errors import ApiError
    from app.protocol.openai import ChatCompletionRequest
    from app.tools import PARSERS
    from app.validation import plan_tools

    assert set(get_args(Settings.model_fields["tool_call_parser"].annotation)) == {*PARSERS, "none"}
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    template = ChatTemplate(SFT_TEMPLATE, "sft")
    plan, spec = plan_tools(req, gpt2_tokenizer, template, "hermes")
    assert plan.mode == "auto" and spec is None and isinstance(plan.calls(), HermesCalls)
    with pytest.raises(ApiError) as e:
        plan_tools(req, gpt2_tokenizer, template, "none")
    assert e.value.param == "tool_choice" and "GPT_TOOL_CALL_PARSER=none" in e.value.message


# ----------------------------------------------------------------------------------------------- template
def test_the_sft_template_renders_tools_calls_and_results():
    t = ChatTemplate(SFT_TEMPLATE, "sft", eos_token="<|endoftext|>")
    plain = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}]
    before = "<|system|>\nBe brief.<|endoftext|><|user|>\nhi<|endoftext|><|assistant|>\nhello<|endoftext|>"
    assert t.render(plain, add_generation_prompt=False) == before  # no tools: as the template always rendered
    assert t.render(plain, add_generation_prompt=False, tools=[]) == before
    call = {"id": "call_1", "type": "function", "function": {"name": "find_scene", "arguments": {"place": "<V&>"}}}
    history = [{"role": "user", "content": "where?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "a street", "tool_call_id": "call_1"}]
    text = t.render(history, tools=TOOLS)
    assert text.startswith("<|system|>\nYou may call these functions.")
    assert json.dumps(TOOLS[1]["function"]) in text  # each function's JSON on its own line
    assert ('<|assistant|>\n<tool_call>{"name": "find_scene", "arguments": {"place": "<V&>"}}</tool_call>'
            '<|endoftext|><|user|>\n<tool_response>\na street\n</tool_response><|endoftext|><|assistant|>\n') in text
    assert t.renders_tools and not ChatTemplate("{{ messages[0].content }}", "x").renders_tools


# ------------------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory, gpt2_tokenizer) -> Path:
    """A random GPT-2-vocabulary model with the SFT chat template (it renders tools)."""
    from model.checkpoint import save_checkpoint

    d = tmp_path_factory.mktemp("gpt2")
    model = tiny_model(0, vocab_size=gpt2_tokenizer.vocab_size, block_size=512)
    path = save_checkpoint(d / "gpt2", model, gpt2_tokenizer, {"note": "tool tests"})
    (path / "chat_template.jinja").write_text(SFT_TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=["shakespeare", "gpt2"])
def live(request):
    ckpt = REPO / "checkpoints" / "shakespeare" if request.param == "shakespeare" else request.getfixturevalue(
        "gpt2_ckpt")
    with LiveServer(make_app(ckpt, max_batch_size=4, max_queue=16, warmup=False), start_timeout=120) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_calls(calls, names=tuple(SCHEMA)) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    chunks = [ch for ch in stream if ch.choices]
    deltas = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    return deltas_to_calls(deltas), chunks[-1].choices[0].finish_reason, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "find_character"}}])
def test_forced_calls_follow_the_schema_streamed_or_not(oai, choice):
    names = ("find_character",) if isinstance(choice, dict) else tuple(SCHEMA)
    for seed in (1, 2, 3):
        kw = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=120, seed=seed)
        r = oai.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
        check_calls(msg.tool_calls, names)
        calls, reason, content = streamed_calls(oai.chat.completions.create(**kw, stream=True))
        assert reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls]  # seeded: the same call, in fragments


def test_required_with_parallel_calls(oai):
    for seed in (1, 2):
        r = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        max_tokens=200, seed=seed)
        calls = r.choices[0].message.tool_calls
        if r.choices[0].finish_reason == "tool_calls":
            check_calls(calls)
        else:  # max_tokens cut the list: the complete calls before the last still follow their schemas
            assert r.choices[0].finish_reason == "length"
            check_calls(calls[:-1]) if len(calls) > 1 else None
        assert len({c.id for c in calls}) == len(calls)


def test_langchain_bind_tools_parses_our_calls(live):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=live.url + "/v1", api_key="unused", model="m", max_retries=0, seed=2,
                        max_completion_tokens=120)
    for choice in ("required", "find_scene"):
        bound = llm.bind_tools(TOOLS, tool_choice=choice, parallel_tool_calls=False)
        msg = bound.invoke("Where does Romeo go?")
        assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls
        call = msg.tool_calls[0]
        assert call["id"].startswith("call_") and (choice == "required" or call["name"] == choice)
        jsonschema.validate(call["args"], SCHEMA[call["name"]])
        streamed = None
        for chunk in bound.stream("Where does Romeo go?"):
            streamed = chunk if streamed is None else streamed + chunk
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


def test_tool_choice_none_answers_in_text(oai):
    r = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8,
                                    seed=1)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


GOOD = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=120, seed=5)


def calls_of(r) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]


def test_bad_tools_are_400s_naming_the_field_and_harm_nothing(oai, live):
    import openai

    before = calls_of(oai.chat.completions.create(**GOOD))

    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"a": {"type": "foo"}}}}}]
    cases = [(dict(tools=bad, tool_choice="required"), "tools.0.function.parameters", "foo"),
             (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {"type": "string"}}}],
                   tool_choice="required"), "tools.1.function.parameters", "object"),
             (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "hamlet"}}),
              "tool_choice.function.name", "hamlet"),
             (dict(tools=TOOLS + TOOLS[:1], tool_choice="required"), "tools", "two functions"),
             (dict(tool_choice="required"), "tool_choice", "needs tools"),
             (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
              "response_format")]
    for kw, param, reason in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, **kw)
        assert e.value.param == param and reason in e.value.message, (kw, e.value.message)
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": [{"type": "function",
                   "function": {"name": "bad name!"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools"), r.text
    # a pattern no reply can meet within max_tokens (a million a's, unanchored): the call is cut, never closed
    huge = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "a{1000000}"}}, "required": ["a"]}}}]
    r = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, tools=huge, tool_choice="required",
                                    seed=1)
    cut = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length" and (not cut or not cut[0].function.arguments.endswith("}"))
    # none of it reached later requests: the seeded call is the one made before
    assert calls_of(oai.chat.completions.create(**GOOD)) == before


def test_auto_needs_a_template_that_shows_tools(oai, live):
    import openai

    if live.app.state.service.chat_template.renders_tools:
        pytest.skip("this checkpoint's template renders tools (test_auto_* below)")
    for kw in (dict(tools=TOOLS), dict(tools=TOOLS, tool_choice="auto")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, **kw)
        assert e.value.param == "tool_choice" and "You: / Model: transcript" in e.value.message
    history = MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "find_scene", "arguments": '{"place": "Verona"}'}}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                       "content": "a street"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=history, max_tokens=5, tools=TOOLS, tool_choice="required")
    assert e.value.param == "messages.1" and "cannot render tool calls" in e.value.message


HERMES = r'Aye\.\n<tool_call>\{"name": "find_scene", "arguments": \{"place": "(Verona|Mantua)"\}\}</tool_call>'


def test_auto_parses_hermes_calls_streamed_or_not(oai, live):
    """The random model cannot write a call by itself: a regex (structured_outputs) makes it write one in the
    Hermes form, and the parser does the rest, as for a model that learned the form."""
    if not live.app.state.service.chat_template.renders_tools:
        pytest.skip("this checkpoint's template cannot render tools")
    kw = dict(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=60, seed=1,
              extra_body={"structured_outputs": {"regex": HERMES}})
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Aye."
    check_calls(msg.tool_calls, ("find_scene",))
    calls, reason, content = streamed_calls(oai.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls" and content == "Aye.\n"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in msg.tool_calls]
    # without the regex: text, and the tools were shown to the model (the prompt is longer)
    plain = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, seed=1)
    r = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=4, seed=1)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_tool_history_renders_through_the_template(live):
    if not live.app.state.service.chat_template.renders_tools:
        pytest.skip("this checkpoint's template cannot render tools")
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "find_scene", "arguments": '{"place": "Verona"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "A public place."}]
    ids = httpx.post(live.url + "/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(live.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert ('<tool_call>{"name": "find_scene", "arguments": {"place": "Verona"}}</tool_call><|endoftext|><|user|>\n'
            "<tool_response>\nA public place.\n</tool_response>") in text
    bad = [history[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "find_scene", "arguments": "{nope"}}]}]
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": bad, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
