"""The HTTP API in-process (fastapi TestClient): every route, both stream formats, validation,
limits, auth, CORS, metrics, health while loading / draining."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tests.app_helpers import (
    app_client,
    make_app,
    reference_generate,
    slow_model,
    sse_events,
    wait_ready,
    wait_until,
)
from tests.helpers import BLOCK

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

METRIC_NAMES = ["gpt_requests_total", "gpt_prompt_tokens_total", "gpt_generated_tokens_total", "gpt_queue_size",
                "gpt_batch_size", "gpt_queue_time_seconds", "gpt_time_to_first_token_seconds",
                "gpt_inter_token_latency_seconds", "gpt_request_latency_seconds"]


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        yield c


def engine_of(client):
    return client.app.state.service.engine


def assert_error(r, status: int | None = None, field: str | None = None, error_type: str | None = None):
    """A 4xx in the route's own shape: TGI's {"error", "error_type"}, or on /v1/* OpenAI's
    {"error": {"message", "type", "param", "code"}} (where a 422 becomes OpenAI's 400), naming `field`."""
    assert r.status_code != 500, r.text
    openai = r.request.url.path.startswith(("/v1/", "/tokenize", "/detokenize"))
    if openai and status == 422:
        status = 400
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text)
    else:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    if openai:
        err = body.get("error")
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, body
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
        message, kind = err["message"], err["code"]
        if field is not None and field != "body" and err["code"] == "validation":
            assert err["param"] == field or (err["param"] or "").startswith(field + "."), body
    else:
        message, kind = body.get("error"), body.get("error_type")
        assert isinstance(message, str) and message, body
        assert isinstance(kind, str) and kind, body
    if field is not None:
        assert message.startswith(field) or f"{field}" in message, body
    if error_type is not None:
        assert kind == error_type, body
    return body


# ------------------------------------------------------------------------------------------- operations
def test_health_info_models_metrics(client, tiny_ckpt):
    assert client.get("/health").json() == {"status": "ready"}
    info = client.get("/info").json()
    assert info["checkpoint"] == str(tiny_ckpt) and info["metadata"]["note"] == "app tests"
    assert info["config"]["block_size"] == BLOCK and info["config"]["n_layer"] == 2
    assert (info["device"], info["dtype"]) == ("cpu", "fp32")
    assert info["max_total_tokens"] == BLOCK and info["max_prompt_tokens"] == BLOCK - 1
    assert info["max_batch_size"] == 8 and info["version"] and info["model_id"] == "tiny"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in r.text or f"# TYPE {name.removesuffix('_total')} " in r.text, name
    spec = client.get("/openapi.json").json()  # /docs documents the hand-parsed bodies too
    assert spec["paths"]["/generate"]["post"]["requestBody"] and "TGIParameters" in spec["components"]["schemas"]


def test_index_and_static(client, tiny_ckpt, tmp_path, monkeypatch):
    import app.routes.ops as ops_routes

    r = client.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"] and "<html" in r.text.lower()
    if (ops_routes.STATIC_DIR / "index.html").is_file():
        assert client.get("/static/index.html").text == r.text
    assert_error(client.get("/static/no-such-file.js"), 404)
    monkeypatch.setattr(ops_routes, "STATIC_DIR", tmp_path / "nothing-here")
    with app_client(tiny_ckpt) as c:  # no playground installed: a minimal page, and /static still answers
        page = c.get("/")
        assert page.status_code == 200 and "/docs" in page.text and "tiny" in page.text
        assert_error(c.get("/static/index.html"), 404)


def test_unknown_route_and_method_are_json(client):
    assert_error(client.get("/nope"), 404, error_type="not_found")
    assert_error(client.get("/generate"), 405, error_type="method_not_allowed")


# ------------------------------------------------------------------------------------------- TGI routes
def test_generate_greedy_equals_reference_on_every_route(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=12, temperature=0)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 12, "details": True}}
    for route in ("/generate", "/"):
        out = client.post(route, json=body).json()
        if route == "/":  # TGI's compatibility route answers with a list of one result
            assert isinstance(out, list) and len(out) == 1
            out = out[0]
        assert out["generated_text"] == ref.text
        d = out["details"]
        assert d["finish_reason"] == "length" and d["generated_tokens"] == 12 and d["seed"] is None
        assert d["prompt_tokens"] == len(ref.prompt)
        assert [t["id"] for t in d["tokens"]] == ref.tokens
        assert [t["logprob"] for t in d["tokens"]] == pytest.approx([e.logprob for e in ref.events], abs=1e-4)
        assert all(set(t) == {"id", "text", "logprob", "special"} for t in d["tokens"])
    plain = client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 12}}).json()
    assert plain == {"generated_text": ref.text}


@pytest.mark.parametrize("route,body_stream", [("/generate_stream", None), ("/generate", True), ("/", True)])
def test_tgi_stream_format(client, tiny_ckpt, route, body_stream):
    ref = reference_generate(tiny_ckpt, "abc", max_new_tokens=6, temperature=0.8, seed=7)
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 6, "temperature": 0.8, "seed": 7, "details": True}}
    if body_stream is not None:
        body["stream"] = body_stream
    r = client.post(route, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data:") for line in r.text.split("\n\n") if line.strip())
    events = sse_events(r.text)
    assert [e["index"] for e in events] == list(range(1, 7))
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None
        assert set(e["token"]) == {"id", "text", "logprob", "special"}
    last = events[-1]
    assert last["generated_text"] == ref.text == "".join(e["token"]["text"] for e in events)
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 6, "seed": 7,
                               "input_length": 3, "prompt_tokens": 3}
    assert [e["token"]["id"] for e in events] == ref.tokens


def test_stream_without_details_has_no_details(client):
    events = sse_events(client.post("/generate_stream", json={"inputs": "abc",
                                                               "parameters": {"max_new_tokens": 3}}).text)
    assert events[-1]["details"] is None and isinstance(events[-1]["generated_text"], str)


def test_tgi_sampling_rules(client, tiny_ckpt):
    def gen(**params):
        return client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 16, "details": True,
                                                                             **params}}).json()

    greedy = reference_generate(tiny_ckpt, "hi", max_new_tokens=16, temperature=0).text
    assert gen()["generated_text"] == greedy  # TGI: no sampling parameter → greedy
    assert gen(do_sample=False, seed=3)["generated_text"] == greedy
    assert gen(temperature=0, do_sample=True)["generated_text"] == greedy  # temperature 0 is greedy here
    assert gen(top_p=1.0)["generated_text"] == greedy  # accepted (TGI refuses 1.0), and neutral
    sampled = gen(do_sample=True, seed=11)
    assert sampled["details"]["seed"] == 11
    assert sampled["generated_text"] == reference_generate(tiny_ckpt, "hi", max_new_tokens=16, temperature=1.0,
                                                           seed=11).text
    warm = gen(temperature=0.9)  # a warper alone turns sampling on, with a fresh seed reported
    seed = warm["details"]["seed"]
    assert isinstance(seed, int) and gen(temperature=0.9, seed=seed)["generated_text"] == warm["generated_text"]


def test_stop_sequences_and_full_text(client):
    base = client.post("/generate", json={"inputs": "once", "parameters": {
        "max_new_tokens": 40, "do_sample": True, "seed": 5}}).json()["generated_text"]
    stop = base[10:12]
    cut = base[:base.find(stop)]
    out = client.post("/generate", json={"inputs": "once", "parameters": {
        "max_new_tokens": 40, "do_sample": True, "seed": 5, "stop": [stop, "\x00never"], "details": True}}).json()
    assert out["generated_text"] == cut and out["details"]["finish_reason"] == "stop_sequence"
    full = client.post("/generate", json={"inputs": "once", "parameters": {
        "max_new_tokens": 40, "do_sample": True, "seed": 5, "return_full_text": True}}).json()
    assert full["generated_text"] == "once" + base


def test_top_n_tokens_and_truncate(client):
    out = client.post("/generate", json={"inputs": "hello", "parameters": {
        "max_new_tokens": 3, "details": True, "top_n_tokens": 2}}).json()
    tops = out["details"]["top_tokens"]
    assert len(tops) == 3 and all(len(t) == 2 for t in tops)
    assert [t[0]["id"] for t in tops] == [t["id"] for t in out["details"]["tokens"]]  # greedy picks the best
    # truncate keeps the last N prompt tokens
    long = client.post("/generate", json={"inputs": "x" * 200 + "hello", "parameters": {
        "max_new_tokens": 5, "truncate": 5, "details": True}}).json()
    short = client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 5}}).json()
    assert long["generated_text"] == short["generated_text"] and long["details"]["prompt_tokens"] == 5


def test_context_limits(client):
    assert_error(client.post("/generate", json={"inputs": "a" * 200}), 422, "inputs")
    assert_error(client.post("/generate", json={"inputs": "a" * 100, "parameters": {"max_new_tokens": 50}}),
                 422, "parameters.max_new_tokens")
    assert_error(client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": BLOCK}}),
                 422, "parameters.max_new_tokens")
    # without max_new_tokens the default is lowered to what fits
    out = client.post("/generate", json={"inputs": "a" * 120, "parameters": {"details": True}}).json()
    assert out["details"]["generated_tokens"] == BLOCK - 120
    out = client.post("/generate", json={"inputs": "a" * 27, "parameters": {"max_new_tokens": BLOCK - 27}})
    assert out.status_code == 200


# ------------------------------------------------------------------------------------------- OpenAI
def test_completions(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=8, temperature=0)
    r = client.post("/v1/completions", json={"model": "whatever", "prompt": "hello", "max_tokens": 8,
                                             "temperature": 0, "logprobs": 2})
    out = r.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] == "length" and choice["index"] == 0
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == ref.text and len(lp["token_logprobs"]) == 8
    assert lp["text_offset"][0] == 0 and all(len(t) == 2 for t in lp["top_logprobs"])
    n = len(ref.prompt)
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 8, "total_tokens": n + 8,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    # a list of one string, token ids, echo; default max_tokens is 16 (OpenAI's)
    same = client.post("/v1/completions", json={"prompt": ["hello"], "max_tokens": 8, "temperature": 0}).json()
    ids = client.post("/v1/completions", json={"prompt": ref.prompt, "max_tokens": 8, "temperature": 0}).json()
    echo = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                                "echo": True}).json()
    assert same["choices"][0]["text"] == ids["choices"][0]["text"] == ref.text
    assert echo["choices"][0]["text"] == "hello" + ref.text and same["choices"][0]["logprobs"] is None
    dflt = client.post("/v1/completions", json={"prompt": "hello", "temperature": 0}).json()
    assert dflt["usage"]["completion_tokens"] == 16
    seeded = [client.post("/v1/completions", json={"prompt": "hi", "seed": 3, "max_tokens": 10}).json()
              for _ in range(2)]
    assert seeded[0]["choices"][0]["text"] == seeded[1]["choices"][0]["text"]


def test_completions_stream(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=5, temperature=0)
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0, "stream": True,
                                             "logprobs": 1, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert all(c["object"] == "text_completion" and c["choices"][0]["logprobs"]["tokens"] for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------------------------------- scoring
SCORED = "the king is dead, long live the king! the then there; " * 2  # 60+ tokens: more than one prefill chunk


def reference_prompt_logprobs(ckpt, prompt_ids: list[int]) -> list[float]:
    """log P(token i | tokens < i) from one full forward pass (fp32)."""
    from model.checkpoint import load_checkpoint

    c = load_checkpoint(ckpt)
    with torch.inference_mode():
        logits, _ = c.model(torch.tensor([prompt_ids]))
    lsm = torch.log_softmax(logits[0, :, :c.tokenizer.vocab_size].float(), -1)
    return [lsm[i - 1, t].item() for i, t in enumerate(prompt_ids) if i]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, tiny_ckpt):
    ids = client.post("/tokenize", json={"prompt": SCORED, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) > 32  # the server's prefill chunk
    expected = reference_prompt_logprobs(tiny_ckpt, ids)
    # lm-evaluation-harness' loglikelihood request, as local-completions sends it
    body = {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = client.post("/v1/completions", json=body).json()
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(expected, abs=1e-5)
    assert "".join(lp["tokens"][:n]) == SCORED and choice["text"].startswith(SCORED)
    assert lp["text_offset"][:n] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    assert lp["text_offset"][n] == len(SCORED)  # the generated token follows the echoed prompt
    for tok, top, lpv in zip(lp["tokens"][1:n], lp["top_logprobs"][1:n], lp["token_logprobs"][1:n]):
        assert top[tok] == lpv and 1 <= len(top) <= 2  # the token itself and the most likely one
        assert max(top.values()) >= lpv
    # lm-eval's greediness test (token logprob == the best in top_logprobs) agrees with the model's argmax
    from model.checkpoint import load_checkpoint

    with torch.inference_mode():
        argmax = load_checkpoint(tiny_ckpt).model(torch.tensor([ids]))[0][0, :-1].argmax(-1).tolist()
    greedy = [lpv == max(top.values()) for top, lpv in zip(lp["top_logprobs"][1:n], lp["token_logprobs"][1:n])]
    assert greedy == [a == t for a, t in zip(argmax, ids[1:])]
    assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == 1
    # scoring only: max_tokens 0 with echo ends after the prefill, finish_reason length, nothing generated
    score = client.post("/v1/completions", json={**body, "max_tokens": 0}).json()
    (only,) = score["choices"]
    assert only["text"] == SCORED and only["finish_reason"] == "length"
    assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert score["usage"]["completion_tokens"] == 0
    # vLLM's prompt_logprobs field: token id → logprob, rank, decoded token
    v = client.post("/v1/completions", json={"prompt": SCORED, "max_tokens": 0, "echo": True,
                                             "prompt_logprobs": 2}).json()["choices"][0]
    assert v["logprobs"] is None and v["prompt_logprobs"][0] is None and len(v["prompt_logprobs"]) == n
    for i, entry in enumerate(v["prompt_logprobs"][1:], 1):
        assert entry[str(ids[i])]["logprob"] == pytest.approx(expected[i - 1], abs=1e-5)
        assert 2 <= len(entry) <= 3 and entry[str(ids[i])]["rank"] >= 1
        best = [e for e in entry.values() if e["rank"] == 1]
        assert len(best) == 1 and best[0]["logprob"] >= entry[str(ids[i])]["logprob"]


def test_echo_logprobs_batched_and_streamed(client, tiny_ckpt):
    ids = client.post("/tokenize", json={"prompt": SCORED}).json()["tokens"]
    expected = reference_prompt_logprobs(tiny_ckpt, ids)
    short = client.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    body = {"prompt": [ids, short], "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    whole = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-5)
    assert whole["choices"][1]["logprobs"]["token_logprobs"][1:len(short)] == pytest.approx(
        reference_prompt_logprobs(tiny_ckpt, short), abs=1e-5)
    r = client.post("/v1/completions", json={**body, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    per_choice: dict[int, list] = {0: [], 1: []}
    for e in events[:-1]:
        (c,) = e["choices"]
        per_choice[c["index"]].append(c)
    for index, chunks in per_choice.items():
        first = chunks[0]  # the prompt's entries come first, in one chunk, with the prompt's text
        prompt_ids = ids if index == 0 else short
        assert first["logprobs"]["token_logprobs"][0] is None
        assert len(first["logprobs"]["tokens"]) == len(prompt_ids) and first["finish_reason"] is None
        assert "".join(c["text"] for c in chunks) == whole["choices"][index]["text"]
        lps = [x for c in chunks for x in c["logprobs"]["token_logprobs"]]
        assert lps == pytest.approx(whole["choices"][index]["logprobs"]["token_logprobs"], abs=1e-6)
        offsets = [x for c in chunks for x in c["logprobs"]["text_offset"]]
        assert offsets == whole["choices"][index]["logprobs"]["text_offset"]
        assert chunks[-1]["finish_reason"] == "length"
    # streamed scoring only: one chunk with the prompt and finish_reason, then [DONE]
    events = sse_events(client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 0, "echo": True,
                                                             "logprobs": 0, "stream": True}).text)
    assert len(events) == 2 and events[0]["choices"][0]["finish_reason"] == "length"
    assert events[0]["choices"][0]["text"] == "hello there"


def test_tgi_decoder_input_details_fills_prefill(client, tiny_ckpt):
    ids = client.post("/tokenize", json={"prompt": SCORED}).json()["tokens"]
    expected = reference_prompt_logprobs(tiny_ckpt, ids)
    for route in ("/generate", "/"):
        out = client.post(route, json={"inputs": SCORED, "parameters": {"max_new_tokens": 2,
                                                                        "decoder_input_details": True}}).json()
        details = (out[0] if route == "/" else out)["details"]  # decoder_input_details implies details (TGI)
        prefill = details["prefill"]
        assert [t["id"] for t in prefill] == ids and prefill[0]["logprob"] is None
        assert [t["logprob"] for t in prefill[1:]] == pytest.approx(expected, abs=1e-5)
        assert "".join(t["text"] for t in prefill) == SCORED and set(prefill[0]) == {"id", "text", "logprob"}
        assert len(details["tokens"]) == 2
    plain = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "details": True}})
    assert plain.json()["details"]["prefill"] == []


def test_tokenizer_info_and_tokenize_as_lm_eval_checks_them(client):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] == "<|endoftext|>"
    assert info["pad_token"] is None and info["chat_template"] and info["model_max_length"] == BLOCK
    assert info["tokenizer_class"] == "GPT2Tokenizer"
    # lm-eval's RemoteTokenizer: eos_token_id = tokenize(eos_token)[0]
    r = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert r["tokens"] == [info["eos_token_id"]]
    same = client.post("/tokenize", json={"prompt": "test", "add_special_tokens": True}).json()["tokens"]
    assert same == client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]


def test_logit_bias_min_tokens_stop_token_ids_over_http(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=6, temperature=0, stop_at_eos=False)
    banned = ref.tokens[0]
    out = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True, "logit_bias": {str(banned): -100}}).json()
    forced = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0.9, "seed": 1,
                                                  "logit_bias": {"120": 100}, "logprobs": 0}).json()
    assert "".join(forced["choices"][0]["logprobs"]["tokens"]) == "x" * 4  # token 120 is the byte "x"
    got = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True, "logprobs": 0}).json()
    assert got["choices"][0]["text"] == ref.text  # no bias: the model's own greedy choice
    assert out["choices"][0]["text"] != ref.text
    # stop_token_ids: the greedy reply ends at the third token (its text left out), finish_reason stop
    stop = ref.tokens[2]
    first = ref.tokens.index(stop)
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                             "stop_token_ids": [stop], "logprobs": 0}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and len(r["logprobs"]["tokens"]) == first + 1
    assert r["text"] == "".join(r["logprobs"]["tokens"][:first])
    # min_tokens past it: the stop token cannot come first
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                                                  "temperature": 0, "min_tokens": 6, "stop_token_ids": [stop],
                                                  "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 6


# ------------------------------------------------------------------------------------------- bad input
TGI_ROUTES = ["/generate", "/generate_stream", "/"]
BAD_TGI = [
    (b"", 400, None), (b"   ", 400, None), (b"not json", 400, None), (b"\xff\xfe{}", 400, None),
    (b'{"inputs": "a"', 400, None), (b'{"inputs": "a", "parameters": {"temperature": NaN}}', 400, None),
    (b'{"inputs": "a", "parameters": {"temperature": Infinity}}', 400, None),
    (b'{"inputs": "a", "parameters": {"max_new_tokens": ' + b"9" * 5000 + b"}}", 400, None),
    (b'{"inputs": "a", "parameters": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, None),
    (b"[1, 2]", 422, "body"), (b"null", 422, "body"), (b'"text"', 422, "body"), (b"42", 422, "body"),
    ({}, 422, "inputs"), ({"inputs": None}, 422, "inputs"), ({"inputs": 5}, 422, "inputs"),
    ({"inputs": ["a"]}, 422, "inputs"), ({"inputs": ""}, 422, "inputs"), ({"inputs": "a" * 5000}, 422, "inputs"),
    ({"inputs": "a", "parameters": 5}, 422, "parameters"), ({"inputs": "a", "parameters": []}, 422, "parameters"),
    ({"inputs": "a", "parameters": {"temperature": -1}}, 422, "parameters.temperature"),
    ({"inputs": "a", "parameters": {"temperature": "hot"}}, 422, "parameters.temperature"),
    ({"inputs": "a", "parameters": {"temperature": 1e308 * 10}}, 400, None),
    ({"inputs": "a", "parameters": {"temperature": 1000}}, 422, "parameters.temperature"),
    ({"inputs": "a", "parameters": {"top_p": 0}}, 422, "parameters.top_p"),
    ({"inputs": "a", "parameters": {"top_p": 1.5}}, 422, "parameters.top_p"),
    ({"inputs": "a", "parameters": {"top_k": -1}}, 422, "parameters.top_k"),
    ({"inputs": "a", "parameters": {"top_k": 2.5}}, 422, "parameters.top_k"),
    ({"inputs": "a", "parameters": {"top_k": True}}, 422, "parameters.top_k"),
    ({"inputs": "a", "parameters": {"top_k": 10**40}}, 422, "parameters.top_k"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 0}}, 422, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"max_new_tokens": -5}}, 422, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 10**30}}, 422, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"max_new_tokens": "10"}}, 422, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 10.5}}, 422, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"max_new_tokens": None, "temperature": None}}, 200, None),
    ({"inputs": "a", "parameters": {"repetition_penalty": 0}}, 422, "parameters.repetition_penalty"),
    ({"inputs": "a", "parameters": {"seed": -1}}, 422, "parameters.seed"),
    ({"inputs": "a", "parameters": {"seed": 2**64}}, 422, "parameters.seed"),
    ({"inputs": "a", "parameters": {"seed": "x"}}, 422, "parameters.seed"),
    ({"inputs": "a", "parameters": {"stop": "x"}}, 422, "parameters.stop"),
    ({"inputs": "a", "parameters": {"stop": [1]}}, 422, "parameters.stop.0"),
    ({"inputs": "a", "parameters": {"stop": [""]}}, 422, "parameters.stop.0"),
    ({"inputs": "a", "parameters": {"stop": ["a" * 300]}}, 422, "parameters.stop.0"),
    ({"inputs": "a", "parameters": {"stop": ["a"] * 17}}, 422, "parameters.stop"),
    ({"inputs": "a", "parameters": {"do_sample": "yes"}}, 422, "parameters.do_sample"),
    ({"inputs": "a", "parameters": {"details": 1}}, 422, "parameters.details"),
    ({"inputs": "a", "parameters": {"best_of": 2}}, 422, "parameters.best_of"),
    ({"inputs": "a", "parameters": {"typical_p": 0.5}}, 422, "parameters.typical_p"),
    ({"inputs": "a", "parameters": {"watermark": True}}, 422, "parameters.watermark"),
    ({"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": "(("}}}, 422, "parameters.grammar"),
    ({"inputs": "a", "stream": True, "parameters": {"decoder_input_details": True}}, 422,
     "parameters.decoder_input_details"),  # TGI refuses it when streaming
    ({"inputs": "a", "parameters": {"decoder_input_details": "yes"}}, 422, "parameters.decoder_input_details"),
    ({"inputs": "a", "parameters": {"top_n_tokens": 100}}, 422, "parameters.top_n_tokens"),
    ({"inputs": "a", "parameters": {"truncate": 0}}, 422, "parameters.truncate"),
    ({"inputs": "a", "stream": "yes"}, 422, "stream"),
    ({"inputs": "\ud800 lone surrogate", "parameters": {"max_new_tokens": 2, "stop": ["\udfff"]}}, 200, None),
    ({"inputs": "a", "parameters": {"max_new_tokens": 2}, "unknown": 1}, 200, None),
]
BAD_OPENAI = [
    (b"{", 400, None), (b"[]", 422, "body"),
    ({}, 422, "prompt"), ({"prompt": 5}, 422, "prompt"), ({"prompt": []}, 422, "prompt"),
    ({"prompt": ["a", "b"], "max_tokens": 2}, 200, None), ({"prompt": [1, 2**40]}, 422, "prompt"),
    ({"prompt": [-1]}, 422, "prompt"), ({"prompt": [True]}, 422, "prompt"),
    ({"prompt": [[1, 2], [3]], "max_tokens": 2}, 200, None), ({"prompt": [[1, 2], [3, 9999]]}, 422, "prompt.1.1"),
    ({"prompt": ["a"] * 17}, 422, "prompt"), ({"prompt": ["a", ""]}, 422, "prompt"), ({"prompt": ""}, 422, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, 422, "max_tokens"), ({"prompt": "a", "max_tokens": "5"}, 422, "max_tokens"),
    ({"prompt": "a", "max_tokens": 500}, 422, "max_tokens"),
    ({"prompt": "a", "temperature": -0.1}, 422, "temperature"), ({"prompt": "a", "top_p": 2}, 422, "top_p"),
    ({"prompt": "a", "n": 2, "max_tokens": 2}, 200, None), ({"prompt": "a", "n": 17}, 422, "n"),
    ({"prompt": "a", "n": 0}, 422, "n"), ({"prompt": "a", "best_of": 3}, 422, "best_of"),
    ({"prompt": "a", "logprobs": 6}, 422, "logprobs"), ({"prompt": "a", "logprobs": -1}, 422, "logprobs"),
    ({"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 1}, 200, None),
    ({"prompt": "a", "stop": 5}, 422, "stop"),
    ({"prompt": "a", "echo": True, "max_tokens": 0}, 200, None), ({"prompt": "a", "max_tokens": -1}, 422, "max_tokens"),
    ({"prompt": "a", "prompt_logprobs": 6}, 422, "prompt_logprobs"),
    ({"prompt": "a", "prompt_logprobs": -1}, 422, "prompt_logprobs"),
    ({"prompt": "a", "stop": [1]}, 422, "stop.0"), ({"prompt": "a", "stop": ["a"] * 17}, 422, "stop"),
    ({"prompt": "a", "presence_penalty": 2.5}, 422, "presence_penalty"),
    ({"prompt": "a", "presence_penalty": 1, "frequency_penalty": -0.5, "max_tokens": 2}, 200, None),
    ({"prompt": "a", "frequency_penalty": 5}, 422, "frequency_penalty"),
    ({"prompt": "a", "logit_bias": {"1": 5}, "max_tokens": 2}, 200, None),
    ({"prompt": "a", "suffix": "x"}, 422, "suffix"),
    ({"prompt": "a", "logit_bias": {"x": 5}}, 422, "logit_bias.x"),
    ({"prompt": "a", "logit_bias": {"-1": 5}}, 422, "logit_bias.-1"),
    ({"prompt": "a", "logit_bias": {"99999": 5}}, 422, "logit_bias.99999"),
    ({"prompt": "a", "logit_bias": {"1": 100.5}}, 422, "logit_bias.1"),
    ({"prompt": "a", "logit_bias": {"1": "up"}}, 422, "logit_bias.1"),
    ({"prompt": "a", "logit_bias": 5}, 422, "logit_bias"),
    ({"prompt": "a", "min_tokens": -1}, 422, "min_tokens"),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, 200, None), ({"prompt": "a", "logit_bias": {"01": 1}}, 422,
                                                                     "logit_bias.01"),
    ({"prompt": "a", "stop_token_ids": [9999]}, 422, "stop_token_ids.0"),
    ({"prompt": "a", "stop_token_ids": "x"}, 422, "stop_token_ids"),
    ({"prompt": "a", "ignore_eos": "y"}, 422, "ignore_eos"),
    ({"prompt": "a", "ignore_eos": True, "min_tokens": 1, "stop_token_ids": [5], "max_tokens": 2}, 200, None),
    ({"prompt": "a", "stream": "true"}, 422, "stream"), ({"prompt": "a", "stream_options": 5}, 422, "stream_options"),
    ({"prompt": "a", "seed": -3}, 422, "seed"), ({"prompt": "a", "model": 5}, 422, "model"),
    ({"prompt": "a", "max_tokens": 2, "stop": "x", "user": "u", "n": 1, "logit_bias": {}}, 200, None),
]
CASES = [(route, body, status, field) for route in TGI_ROUTES for body, status, field in BAD_TGI]
CASES += [("/v1/completions", body, status, field) for body, status, field in BAD_OPENAI]


@pytest.mark.parametrize("route,body,status,field", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_4xx_naming_the_problem(client, route, body, status, field):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(route, content=content, headers={"Content-Type": "application/json"})
    if route.startswith("/v1/") and status == 422:
        status = 400  # OpenAI's status for an invalid parameter
    assert r.status_code == status, (r.status_code, r.text[:300])
    if status >= 400:
        assert_error(r, status, field)


def test_body_size_limit(tiny_ckpt):
    with app_client(tiny_ckpt, max_body_bytes=2048) as c:
        assert_error(c.post("/generate", json={"inputs": "a" * 5000}), 413, error_type="payload_too_large")

        def chunks():  # no Content-Length: counted while reading
            for _ in range(10):
                yield b" " * 1000

        assert_error(c.post("/generate", content=chunks()), 413)
        assert c.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 2}}).status_code == 200


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data",
                                          None])
def test_non_json_content_type_is_415(client, route, content_type):
    """A simple cross-site POST (form or text/plain: no CORS preflight) must not reach the model."""
    body = b'{"inputs": "a", "prompt": "a", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}'
    headers = {"Content-Type": content_type} if content_type else {}
    before = engine_of(client).stats
    r = client.post(route, content=body, headers=headers)
    assert_error(r, 415, error_type=None)
    assert "application/json" in r.text
    assert engine_of(client).stats["prefill_chunks"] == before["prefill_chunks"]  # nothing reached the engine
    ok = client.post(route, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------------- auth, CORS
CHAT = [{"role": "user", "content": "hi"}]
# every route that generates, as (path, body): each documents 401 and 504 (the table test below checks that)
GENERATING = [
    ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 2}}),
    ("/generate_stream", {"inputs": "a", "parameters": {"max_new_tokens": 2}}),
    ("/", {"inputs": "a", "parameters": {"max_new_tokens": 2}}),
    ("/", {"inputs": "a", "parameters": {"max_new_tokens": 2}, "stream": True}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}),
]
# every route behind the API key, as (method, path, body, the status with the key)
GUARDED = [("POST", path, body, 200) for path, body in GENERATING] + [
    ("GET", "/v1/models", None, 200), ("GET", "/tokenizer_info", None, 200),
    ("POST", "/tokenize", {"prompt": "a"}, 200), ("POST", "/detokenize", {"tokens": [97]}, 200),
    ("POST", "/classify", {"inputs": "a"}, 404),  # past the key, the tiny checkpoint's "no task head"
]


def is_stream(path: str, body: dict | None) -> bool:
    return path == "/generate_stream" or bool((body or {}).get("stream"))


def route_id(*case) -> str:
    path, body = next((c, case[i + 1]) for i, c in enumerate(case) if isinstance(c, str) and c.startswith("/"))
    return path + (" stream" if is_stream(path, body) else "")


def metric(client, series: str) -> float:
    """One series' value from /metrics (0 before its first count)."""
    line = next((x for x in client.get("/metrics").text.splitlines() if x.startswith(series + " ")), None)
    return 0.0 if line is None else float(line.split()[-1])


@pytest.fixture(scope="module")
def keyed(tiny_ckpt):
    with app_client(tiny_ckpt, api_key="s3cret") as c:
        yield c


@pytest.mark.parametrize("method,path,body,ok", GUARDED, ids=[route_id(*c) for c in GUARDED])
def test_every_guarded_route_refuses_a_missing_or_wrong_key_with_401(keyed, method, path, body, ok):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
        assert_error(keyed.request(method, path, json=body, headers=headers), 401, error_type="unauthorized")
    assert keyed.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == ok


def test_operations_routes_stay_open_with_a_key_set(keyed):
    for route in ("/health", "/live", "/info", "/metrics", "/"):
        assert keyed.get(route).status_code == 200, route
    assert keyed.get("/info").json()["api_key_required"] is True


def test_the_refusal_tables_are_every_route_that_documents_the_refusal(client):
    """GUARDED and GENERATING above are the routes whose OpenAPI entry lists 401 / 504: a new route that can
    refuse joins the parametrised tests or this fails."""
    paths = client.app.openapi()["paths"]

    def documented(status: str) -> set:
        return {(method.upper(), path) for path, ops in paths.items() for method, op in ops.items()
                if status in op["responses"]}

    assert documented("401") == {(method, path) for method, path, _, _ in GUARDED}
    assert documented("504") == {("POST", path) for path, _ in GENERATING}


def test_cors(tiny_ckpt, client):
    pre = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type,authorization"}
    with app_client(tiny_ckpt, cors_origins="https://ui.example,https://other.example") as c:
        r = c.options("/generate", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
        r = c.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}},
                   headers={"Origin": "https://ui.example"})
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        assert "access-control-allow-origin" not in c.options("/generate", headers={**pre, "Origin": "https://evil"}
                                                              ).headers
    assert "access-control-allow-origin" not in client.options("/generate", headers=pre).headers


# ------------------------------------------------------------------------------------------- load, time
def test_admission_takes_slots_plus_queue_then_gives_429(tiny_ckpt):
    # a burst on an idle server: slots (2) + queue (2) requests are all served, one more gets 429
    with app_client(tiny_ckpt, max_batch_size=2, max_queue=2) as c:
        engine = engine_of(c)
        engine.pause()  # the whole burst arrives before the worker admits anything
        results = {}
        threads = [threading.Thread(target=lambda i=i: results.setdefault(
            i, c.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 3}}))) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: engine.n_queued == 4, timeout=60)  # the bound only ends a hang
        r = c.post("/generate", json={"inputs": "b", "parameters": {"max_new_tokens": 3}})
        assert_error(r, 429, error_type="overloaded")
        assert r.headers["retry-after"] == "1"
        engine.resume()
        for t in threads:
            t.join(10)
        assert [results[i].status_code for i in range(4)] == [200] * 4
        assert 'gpt_requests_total{finish_reason="rejected",status="429"} 1.0' in c.get("/metrics").text


def test_a_request_of_several_choices_is_refused_whole_when_they_do_not_all_fit(tiny_ckpt):
    # slots (2) + queue (2) = 4; 3 held, a request of n=2 does not fit: 429, and no choice of it was admitted,
    # so none of it is counted as a cancelled request (it was, part of it admitted and then cancelled)
    with app_client(tiny_ckpt, max_batch_size=2, max_queue=2) as c:
        engine = engine_of(c)
        engine.pause()
        held = {}
        t = threading.Thread(target=lambda: held.setdefault("r", c.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 3, "n": 3})))
        t.start()
        wait_until(lambda: engine.n_queued == 3, timeout=60)  # the bound only ends a hang
        r = c.post("/v1/completions", json={"prompt": "b", "max_tokens": 3, "n": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        assert engine.n_in_flight == 3
        engine.resume()
        t.join(10)
        assert held["r"].status_code == 200
        text = c.get("/metrics").text
        assert 'gpt_requests_total{finish_reason="rejected",status="429"} 1.0' in text
        assert "cancelled" not in text


def test_time_limit_ends_with_an_error(tiny_ckpt):
    with app_client(tiny_ckpt, request_timeout_s=0.3) as c:
        engine = engine_of(c)
        engine.pause()  # stuck in the queue: only the time limit ends it (the test's timeout ends a hang)
        assert_error(c.post("/generate", json={"inputs": "a"}), 504, error_type="timeout")
        engine.resume()
        restore = slow_model(engine, 0.02)  # too slow to finish 100 tokens in 0.3 s: the stream ends in an error
        events = sse_events(c.post("/generate_stream", json={"inputs": "a",
                                                              "parameters": {"max_new_tokens": 100}}).text)
        restore()
        assert "token" in events[0] and events[-1]["error_type"] == "timeout" and "error" in events[-1]
        text = c.get("/metrics").text
        assert 'gpt_requests_total{finish_reason="timeout",status="504"} 2.0' in text
        # the engine ended both: neither is also a refusal (a non-streaming one was counted twice)
        assert 'finish_reason="rejected"' not in text


@pytest.fixture(scope="module")
def stalled(tiny_ckpt):
    """A server whose engine admits nothing: every request waits in the queue until its 0.3 s time limit."""
    with app_client(tiny_ckpt, request_timeout_s=0.3) as c:
        engine_of(c).pause()
        yield c


@pytest.mark.parametrize("path,body", GENERATING, ids=[route_id(*c) for c in GENERATING])
def test_every_generating_route_ends_a_request_past_its_time_limit_with_504(stalled, path, body):
    series = 'gpt_requests_total{finish_reason="timeout",status="504"}'
    before = metric(stalled, series)
    r = stalled.post(path, json=body)
    if is_stream(path, body):  # the stream's head is sent at once: its last event is the error
        assert r.status_code == 200, r.text
        events = [e for e in sse_events(r.text) if e != "[DONE]"]
        last = events[-1]
        if path == "/v1/responses":  # an `error` event with our code, then response.failed (OpenAI's codes)
            assert last["type"] == "response.failed" and events[-2]["type"] == "error", events[-2:]
            last = {"error": events[-2]}
        assert (last["error"]["code"] if path.startswith("/v1/") else last["error_type"]) == "timeout", last
    else:
        assert_error(r, 504, error_type="timeout")
    assert metric(stalled, series) == before + 1


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": [97, 10**6]}, "tokens.1"),
])
def test_the_tokenizer_routes_refuse_bad_bodies_naming_the_field(client, path, body, field):
    assert_error(client.post(path, json=body), 400, field=field, error_type="validation")


def test_metrics_count_requests_and_tokens(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        for _ in range(2):
            c.post("/generate", json={"inputs": "hey", "parameters": {"max_new_tokens": 4}})
        c.post("/generate", json={"inputs": ""})
        assert c.post("/v1/completions", json={"prompt": ""}).status_code == 400
        text = c.get("/metrics").text
        assert 'gpt_requests_total{finish_reason="length",status="200"} 2.0' in text
        # each refusal under the status its client got: 422 on TGI's routes, 400 on OpenAI's
        assert 'gpt_requests_total{finish_reason="rejected",status="422"} 1.0' in text
        assert 'gpt_requests_total{finish_reason="rejected",status="400"} 1.0' in text
        n_prompt = len(c.app.state.service.tokenizer.encode("hey"))
        assert f"gpt_prompt_tokens_total {2 * n_prompt}.0" in text and "gpt_generated_tokens_total 8.0" in text
        assert "gpt_time_to_first_token_seconds_count 2.0" in text
        assert "gpt_inter_token_latency_seconds_count 6.0" in text
        assert "gpt_queue_time_seconds_count 2.0" in text and "gpt_request_latency_seconds_count 2.0" in text
        assert "gpt_queue_size 0.0" in text and "gpt_batch_size 0.0" in text


def test_a_next_turn_reuses_the_cached_prefix_and_says_so(tiny_ckpt):
    """Prefix caching through the API: usage reports the reused tokens, the metrics count them exactly, and the
    text (stop strings included) is what a server without the cache gives."""
    turn1 = "ROMEO: But soft, what light through yonder window breaks? "
    bodies = [{"prompt": turn1, "max_tokens": 12, "temperature": 0, "stop": ["zz"]},
              {"prompt": turn1 + "It is the east. ", "max_tokens": 12, "temperature": 0.9, "seed": 3, "stop": ["e"],
               "logprobs": 2}]
    outs = {}
    for on in (True, False):
        with app_client(tiny_ckpt, prefix_cache=on) as c:
            outs[on] = [c.post("/v1/completions", json=b).json() for b in bodies]
            text = c.get("/metrics").text
            engine = c.get("/info").json()["engine"]
        n1, n2 = outs[on][0]["usage"]["prompt_tokens"], outs[on][1]["usage"]["prompt_tokens"]
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs[on]]
        if on:
            assert cached[0] == 0 and n1 - 16 < cached[1] <= n1 + 11  # turn 1's prompt (block-matched) at least
            assert f"gpt_prefix_cache_hit_tokens_total {cached[1]}.0" in text
            assert f"gpt_prompt_tokens_total {n1 + n2 - cached[1]}.0" in text
            assert engine["prefix_cache"] is True and engine["prefix_hit_tokens"] == cached[1]
        else:
            assert cached == [0, 0] and "gpt_prefix_cache_hit_tokens_total 0.0" in text
    for a, b in zip(outs[True], outs[False]):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
        if "logprobs" in a["choices"][0] and a["choices"][0]["logprobs"]:
            assert a["choices"][0]["logprobs"]["tokens"] == b["choices"][0]["logprobs"]["tokens"]


def test_health_is_503_while_warming_up_and_requests_wait(tiny_ckpt, monkeypatch):
    from fastapi.testclient import TestClient

    from engine.core import EngineCore

    gate = threading.Event()
    original = EngineCore.warmup

    def slow_warmup(self):
        gate.wait(10)
        original(self)

    monkeypatch.setattr(EngineCore, "warmup", slow_warmup)
    with TestClient(make_app(tiny_ckpt)) as c:
        r = c.get("/health")
        assert_error(r, 503, error_type="unavailable")
        assert r.json()["status"] == "loading"
        r = c.get("/live")  # liveness stays 200: warming up is healthy, only readiness waits
        assert r.status_code == 200 and r.json() == {"status": "alive"}
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", c.post("/generate", json={
            "inputs": "a", "parameters": {"max_new_tokens": 2}})))
        t.start()
        time.sleep(0.1)
        assert "r" not in out  # queued behind the warm-up, not refused
        gate.set()
        t.join(10)
        assert out["r"].status_code == 200
        wait_ready(c.get)


def test_draining_refuses_new_work(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        c.app.state.service.begin_drain()
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert_error(c.post("/generate", json={"inputs": "a"}), 503, error_type="unavailable")
        assert c.get("/info").status_code == 200


def test_two_apps_in_one_process_have_separate_metrics(tiny_ckpt):
    with app_client(tiny_ckpt) as a, app_client(tiny_ckpt) as b:
        a.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 2}})
        assert "gpt_generated_tokens_total 2.0" in a.get("/metrics").text
        assert "gpt_generated_tokens_total 0.0" in b.get("/metrics").text


def test_startup_failure_is_one_line(tmp_path):
    import asyncio

    from app.service import Service, StartupError
    from tests.app_helpers import make_settings

    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    for path, needle in [(tmp_path / "missing", "not found"), (bad, "not valid JSON")]:
        with pytest.raises(StartupError) as e:
            asyncio.run(Service(make_settings(path)).startup())
        assert "cannot load checkpoint" in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------- settings
def test_settings_env_and_cli(monkeypatch):
    from app.__main__ import parse_args
    from app.config import SettingsError, load_settings

    monkeypatch.setenv("GPT_PORT", "1234")
    monkeypatch.setenv("GPT_CORS_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("GPT_API_KEY", "k")
    monkeypatch.setenv("GPT_MAX_BATCH_SIZE", "3")
    s = load_settings()
    assert (s.port, s.cors_origins, s.api_key.get_secret_value(), s.max_batch_size) == (
        1234, ["https://a.example", "https://b.example"], "k", 3)
    args = parse_args(["--port", "999", "--checkpoint", "x", "--dtype", "bf16", "--max-batch-size", "5"])
    s = load_settings(**{k: v for k, v in vars(args).items() if v is not None})
    assert (s.port, str(s.checkpoint), s.dtype, s.max_batch_size) == (999, "x", "bf16", 5)  # flags win
    monkeypatch.setenv("GPT_PORT", "not-a-port")
    with pytest.raises(SettingsError, match="GPT_PORT"):
        load_settings()
    monkeypatch.setenv("GPT_PORT", "80")
    with pytest.raises(SettingsError, match="device"):
        load_settings(device="tpu")


# ------------------------------------------------------------------------------------------- liveness
def test_live_is_200_when_ready_and_while_draining(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        r = c.get("/live")
        assert r.status_code == 200 and r.json() == {"status": "alive"}
        c.app.state.service.begin_drain()
        assert c.get("/health").status_code == 503
        r = c.get("/live")
        assert r.status_code == 200 and r.json() == {"status": "alive"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread we end
def test_live_is_503_when_the_engine_thread_died(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        engine = engine_of(c)

        def die(client, msg):
            raise SystemExit  # ends the core loop's thread, outside any step's try

        engine.core_loop.handle = die
        engine.resume()  # any message reaches handle()
        wait_until(lambda: not engine.alive, timeout=60)  # the bound only ends a hang
        r = c.get("/live")
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["error_type"] == "unavailable" and "engine" in body["error"] and body["status"] == "dead"
        assert c.get("/health").status_code == 503  # readiness fails too
