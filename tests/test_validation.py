"""The one validation pass (app/validation.py): request models → Plan, or an ApiError naming the field."""

from __future__ import annotations

import json

import pytest

from app.chat_template import load_chat_template
from app.errors import ApiError
from app.protocol.openai import ChatCompletionRequest, CompletionRequest
from app.protocol.tgi import TGIRequest
from app.validation import Limits, plan_chat, plan_completion, plan_tgi

LIMITS = Limits(block_size=64, max_prompt_tokens=63, max_new_tokens=40, default_max_new_tokens=20,
                max_stop_sequences=2, max_stop_length=8, max_top_n_tokens=3, vocab_size=261, max_choices=6)


def refused(fn, field: str) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn()
    assert e.value.status == 422 and e.value.param == field and e.value.message.startswith(field + ":"), e.value
    return e.value


def test_tgi_plan(byte_tokenizer):
    p = plan_tgi(TGIRequest.model_validate({"inputs": "hello", "parameters": {"temperature": 0.5, "seed": 3}}),
                 byte_tokenizer, LIMITS)
    assert p.sampling and p.params.temperature == 0.5 and p.params.max_new_tokens == 20 and p.params.seed == 3
    greedy = plan_tgi(TGIRequest.model_validate({"inputs": "hello", "parameters": {"temperature": 1e-9}}),
                      byte_tokenizer, LIMITS)
    assert not greedy.sampling and greedy.params.greedy
    refused(lambda: plan_tgi(TGIRequest.model_validate({"inputs": "a" * 70}), byte_tokenizer, LIMITS), "inputs")
    refused(lambda: plan_tgi(TGIRequest.model_validate({"inputs": "a", "parameters": {"stop": ["a", "b", "c"]}}),
                             byte_tokenizer, LIMITS), "parameters.stop")
    refused(lambda: plan_tgi(TGIRequest.model_validate({"inputs": "a" * 30, "parameters": {"max_new_tokens": 40}}),
                             byte_tokenizer, LIMITS), "parameters.max_new_tokens")


def test_completion_choices_are_numbered_and_seeded(byte_tokenizer):
    req = CompletionRequest.model_validate({"prompt": ["ab", "cd"], "n": 3, "seed": 10, "max_tokens": 4})
    plan = plan_completion(req, byte_tokenizer, LIMITS)
    choices = plan.choices()
    assert [i for i, _, _ in choices] == [0, 1, 2, 3, 4, 5]
    assert [p.text for _, p, _ in choices] == ["ab"] * 3 + ["cd"] * 3
    assert [s.seed for _, _, s in choices] == [10, 11, 12] * 2
    unseeded = plan_completion(CompletionRequest.model_validate({"prompt": "ab", "n": 2}), byte_tokenizer, LIMITS)
    seeds = [s.seed for _, _, s in unseeded.choices()]
    assert seeds[1] == seeds[0] + 1 and unseeded.params.max_new_tokens == 16  # OpenAI's default
    refused(lambda: plan_completion(CompletionRequest.model_validate({"prompt": ["a"] * 4, "n": 2}),
                                    byte_tokenizer, LIMITS), "n")  # 8 choices > 6 the server holds
    refused(lambda: plan_completion(CompletionRequest.model_validate({"prompt": [[1, 2], [3, 999]]}),
                                    byte_tokenizer, LIMITS), "prompt.1.1")
    refused(lambda: plan_completion(CompletionRequest.model_validate({"prompt": "a", "echo": True, "logprobs": 1}),
                                    byte_tokenizer, LIMITS), "echo")


def test_chat_plan(byte_tokenizer, tmp_path):
    template = load_chat_template(tmp_path)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    plan = plan_chat(ChatCompletionRequest.model_validate({"messages": msgs, "stop": "x", "logprobs": True,
                                                           "top_logprobs": 2}), byte_tokenizer, LIMITS, template)
    assert plan.prompt_text == "You: hi there\nModel:" and plan.params.stop == ["x", "\nYou:"]
    assert plan.top_n == 2 and plan.details
    no_lp = plan_chat(ChatCompletionRequest.model_validate({"messages": msgs, "top_logprobs": 2}), byte_tokenizer,
                      LIMITS, template)
    assert no_lp.top_n == 0 and not no_lp.details
    both = ChatCompletionRequest.model_validate({"messages": msgs, "max_tokens": 5, "max_completion_tokens": 7})
    assert plan_chat(both, byte_tokenizer, LIMITS, template).params.max_new_tokens == 7
    refused(lambda: plan_chat(ChatCompletionRequest.model_validate({"messages": msgs, "top_logprobs": 4}),
                              byte_tokenizer, LIMITS, template), "top_logprobs")
    refused(lambda: plan_chat(ChatCompletionRequest.model_validate({"messages": msgs, "max_tokens": 41,
                                                                     "max_completion_tokens": 5}),
                              byte_tokenizer, LIMITS, template), "max_tokens")
    long = [{"role": "user", "content": "a" * 70}]
    refused(lambda: plan_chat(ChatCompletionRequest.model_validate({"messages": long}), byte_tokenizer, LIMITS,
                              template), "messages")


# ---------------------------------------------------------------------------------------------- structured output
def test_structured_output_plans_and_refusals(byte_tokenizer, tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    template = load_chat_template(tmp_path)
    chat = lambda body: plan_chat(ChatCompletionRequest.model_validate(  # noqa: E731
        {"messages": [{"role": "user", "content": "hi"}], **body}), byte_tokenizer, LIMITS, template)
    p = chat({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert p.structured.kind == "json_schema" and json.loads(p.structured.value) == schema
    assert chat({"response_format": {"type": "json_object"}}).structured.kind == "json_object"
    assert chat({"response_format": {"type": "text"}}).structured is None
    comp = lambda body: plan_completion(CompletionRequest.model_validate({"prompt": "hi", **body}),  # noqa: E731
                                        byte_tokenizer, LIMITS)
    assert comp({"structured_outputs": {"choice": ["a", "b"]}}).structured.kind == "choice"
    assert comp({"structured_outputs": {"json": json.dumps(schema)}}).structured.kind == "json_schema"
    assert comp({"structured_outputs": {"grammar": 'root ::= "a"'}}).structured.kind == "grammar"
    tgi = lambda g: plan_tgi(TGIRequest.model_validate({"inputs": "hi", "parameters": {"grammar": g}}),  # noqa: E731
                             byte_tokenizer, LIMITS)
    assert tgi({"type": "regex", "value": "a+"}).structured.value == "a+"
    assert json.loads(tgi({"type": "json", "value": schema}).structured.value) == schema

    e = refused(lambda: chat({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}}),
        "response_format.json_schema.schema")
    assert "unclosed group" in e.message
    refused(lambda: chat({"response_format": {"type": "json_schema"}}), "response_format.json_schema")
    refused(lambda: chat({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
            "structured_outputs")
    refused(lambda: comp({"structured_outputs": {"regex": "[z-a]"}}), "structured_outputs.regex")
    refused(lambda: comp({"structured_outputs": {"json": "{nope"}}), "structured_outputs.json")
    refused(lambda: comp({"structured_outputs": {}}), "structured_outputs")
    refused(lambda: comp({"structured_outputs": {"grammar": "start: b"}}), "structured_outputs.grammar")
    refused(lambda: tgi({"type": "regex", "value": "(("}), "parameters.grammar")
    refused(lambda: tgi({"type": "json", "value": {"$ref": "#/none"}}), "parameters.grammar")
