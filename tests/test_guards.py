"""What a request must be before a route sees it (app/guards.py): the abuse findings of issue 10, each
refused cleanly — deep nesting (was a 500 that reset the connection), non-JSON content types (were parsed
as JSON: a cross-site simple POST could spend the server's compute), CORS refusals (were plain text)."""

from __future__ import annotations

import json

import pytest

from app.errors import ApiError
from app.guards import MAX_DEPTH, clean, parse_json
from tests.app_helpers import app_client

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


# ------------------------------------------------------------------------------------------- parse_json
def test_parse_json_refuses_depth_without_recursion():
    ok = b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert isinstance(parse_json(ok)["a"], list)  # MAX_DEPTH levels in all: accepted
    for depth in (MAX_DEPTH + 1, 481, 958, 5000, 200_000):
        body = b'{"inputs": "a", "parameters": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(ApiError) as e:
            parse_json(body)
        assert e.value.status == 400 and "nested" in e.value.message


def test_parse_json_surrogates_and_constants():
    assert parse_json(b'{"a": "x\\ud800y", "\\udfff": ["\\ud800"]}') == {"a": "x\ufffdy", "\ufffd": ["\ufffd"]}
    for bad, why in [(b'{"t": NaN}', "NaN"), (b'{"t": -Infinity}', "Infinity"), (b"\xff", "UTF-8"),
                     (b'{"a": 1', "not valid JSON")]:
        with pytest.raises(ApiError, match=why):
            parse_json(bad)


def test_clean_is_iterative():
    deep: list = []
    node = deep
    for _ in range(100_000):  # far past the recursion limit: a recursive walk would raise RecursionError
        node.append([])
        node = node[0]
    with pytest.raises(ApiError, match="nested"):
        clean({"x": deep})


# ------------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def client(tiny_ckpt):
    with app_client(tiny_ckpt, cors_origins="https://ui.example") as c:
        yield c


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("depth", [481, 958, 2000])
def test_deeply_nested_body_is_400_and_keeps_the_connection(client, route, depth):
    body = b'{"inputs": "a", "prompt": "a", "stop": ' + b"[" * depth + b"]" * depth + b"}"
    r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested more than" in json.dumps(r.json())
    assert client.get("/health").status_code == 200


def _recv(sock) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the server closed the connection"
    return chunk


def _read_response(sock) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length")))
    while len(body) < length:
        body += _recv(sock)
    return int(head.split()[1]), body


def test_deep_nesting_keeps_the_keep_alive_connection(tiny_ckpt):
    """The old 500 came from a RecursionError that also reset the connection: the next request on the same
    socket must be answered."""
    import socket

    from tests.app_helpers import LiveServer, make_app

    body = b'{"inputs": "a", "stop": ' + b"[" * 958 + b"]" * 958 + b"}"
    with LiveServer(make_app(tiny_ckpt)) as live, socket.create_connection(("127.0.0.1", live.port), 10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        status, answer = _read_response(sock)
        assert status == 400 and b"nested more than" in answer
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # same connection
        status, answer = _read_response(sock)
        assert status == 200 and json.loads(answer) == {"status": "ready"}


def test_json_content_types_accepted(client):
    body = json.dumps({"inputs": "a", "parameters": {"max_new_tokens": 1}})
    for ct in ["application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"]:
        assert client.post("/generate", content=body, headers={"Content-Type": ct}).status_code == 200, ct


def test_simple_cross_site_post_is_refused_before_the_model(client):
    # what a form on another site can send without a CORS preflight
    before = client.app.state.service.engine.stats["prefill_chunks"]
    r = client.post("/generate", data={"inputs": "a"}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 415 and r.json()["error_type"] == "unsupported_media_type"
    r = client.post("/v1/completions", content=b'{"prompt": "a"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert client.app.state.service.engine.stats["prefill_chunks"] == before


@pytest.mark.parametrize("route,openai", [("/generate", False), ("/v1/chat/completions", True)])
def test_cors_refusal_is_json(client, route, openai):
    pre = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    r = client.options(route, headers=pre)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    message = body["error"]["message"] if openai else body["error"]
    assert "Disallowed CORS origin" in message and "evil.example" in message
    ok = client.options(route, headers={**pre, "Origin": "https://ui.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"


def test_body_limit_json_on_both_apis(tiny_ckpt):
    with app_client(tiny_ckpt, max_body_bytes=2048) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 5000}]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

        def chunks():  # no Content-Length: counted while reading
            for _ in range(10):
                yield b" " * 1000

        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        # both are refusals in gpt_requests_total (the one refused from its Content-Length, before any handler,
        # was not counted)
        assert 'gpt_requests_total{finish_reason="rejected",status="413"} 2.0' in c.get("/metrics").text


def test_docs_are_served_offline(client):
    page = client.get("/docs")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "/docs-assets/swagger-ui-bundle.js" in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        r = client.get(f"/docs-assets/{asset}")
        assert r.status_code == 200 and len(r.content) > 10_000, asset
    redoc = client.get("/redoc")
    assert redoc.status_code == 200 and "/docs-assets/redoc.standalone.js" in redoc.text
    assert "fonts.googleapis" not in redoc.text
