"""The HTTP API in-process: what it refuses and how. Bad bodies and content types (a 4xx naming the problem, in
the route's own error shape), the API key, CORS, the time limit on every generating route."""

from __future__ import annotations

import json

import pytest

from tests.app_helpers import app_client, assert_error, engine_of, sse_events

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        yield c


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
