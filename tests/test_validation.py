"""The one validation pass (app/validation.py): request models → Plan, or an ApiError naming the field."""

from __future__ import annotations

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
