"""The one validation pass (app/validation.py): request models → Plan, or an ApiError naming the field."""

from __future__ import annotations

import json

import pytest

from app.errors import ApiError
from app.protocol.openai import ChatCompletionRequest, CompletionRequest
from app.protocol.tgi import TGIRequest
from app.validation import Limits, plan_chat, plan_completion, plan_tgi
from model.chat_template import load_chat_template

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


def completion(body: dict, tok):
    return plan_completion(CompletionRequest.model_validate(body), tok, LIMITS)


def test_echo_logprobs_and_scoring_plans(byte_tokenizer):
    lm_eval = completion({"prompt": [[5, 6, 7]], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
                         byte_tokenizer)  # what lm-evaluation-harness sends for a loglikelihood
    assert lm_eval.prompt_logprobs == 1 and lm_eval.echo_logprobs and lm_eval.top_n == 1
    score = completion({"prompt": "abc", "echo": True, "max_tokens": 0}, byte_tokenizer)
    assert score.params.max_new_tokens == 0 and score.prompt_logprobs is None and not score.echo_logprobs
    vllm = completion({"prompt": "abc", "prompt_logprobs": 2, "logprobs": 1, "echo": True}, byte_tokenizer)
    assert vllm.prompt_logprobs == 2 and vllm.vllm_prompt_logprobs == 2 and vllm.top_n == 1
    plain = completion({"prompt": "abc", "logprobs": 2}, byte_tokenizer)  # no echo: the prompt is not scored
    assert plain.prompt_logprobs is None and plain.vllm_prompt_logprobs is None
    refused(lambda: completion({"prompt": "a", "max_tokens": 0}, byte_tokenizer), "max_tokens")
    refused(lambda: completion({"prompt": "a", "prompt_logprobs": 4}, byte_tokenizer), "prompt_logprobs")
    tgi = plan_tgi(TGIRequest.model_validate({"inputs": "ab", "parameters": {"decoder_input_details": True}}),
                   byte_tokenizer, LIMITS)
    assert tgi.prompt_logprobs == 0 and tgi.details and tgi.decoder_input_details
    refused(lambda: plan_tgi(TGIRequest.model_validate({"inputs": "ab", "parameters": {"decoder_input_details": True}}),
                             byte_tokenizer, LIMITS, stream=True), "parameters.decoder_input_details")


def test_logit_bias_min_tokens_stop_token_ids_ignore_eos(byte_tokenizer, tmp_path):
    p = completion({"prompt": "a", "max_tokens": 5, "logit_bias": {"7": -100, "260": 2.5}, "min_tokens": 3,
                    "stop_token_ids": [4, 9], "ignore_eos": True}, byte_tokenizer).params
    assert p.logit_bias == {7: -100.0, 260: 2.5} and p.min_tokens == 3 and p.stop_token_ids == [4, 9]
    assert not p.stop_at_eos and completion({"prompt": "a"}, byte_tokenizer).params.stop_at_eos
    refused(lambda: completion({"prompt": "a", "logit_bias": {"261": 1}}, byte_tokenizer), "logit_bias.261")
    refused(lambda: completion({"prompt": "a", "logit_bias": {"0x1": 1}}, byte_tokenizer), "logit_bias.0x1")
    refused(lambda: completion({"prompt": "a", "stop_token_ids": [1, 300]}, byte_tokenizer), "stop_token_ids.1")
    refused(lambda: completion({"prompt": "a", "logit_bias": {"07": 1}}, byte_tokenizer), "logit_bias.07")
    # min_tokens beyond max_tokens: no stop before max_tokens (vLLM refuses it; no JSON schema can say so)
    assert completion({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, byte_tokenizer).params.min_tokens == 2
    # the chat API has them too (vLLM's chat request does)
    template = load_chat_template(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    chat = plan_chat(ChatCompletionRequest.model_validate({"messages": msgs, "logit_bias": {"3": 1}, "min_tokens": 2,
                                                           "max_completion_tokens": 4}),
                     byte_tokenizer, LIMITS, template)
    assert chat.params.logit_bias == {3: 1.0} and chat.params.min_tokens == 2


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
