"""Plain helpers for the app and engine tests (no tests and no fixtures here; the tiny checkpoint is a fixture in
tests/conftest.py): app factories, a live uvicorn server on 127.0.0.1 in a background thread, `python -m app` as a
subprocess, SSE parsing, the library's solo reference, and the error-shape check the test_app* files share."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tests.helpers import REPO


def make_settings(ckpt: Path, **overrides):
    from app.config import load_settings

    # the engine on a thread of the test process (tests reach into its model); tests/test_core_process.py and
    # the live tests run the core process, the server's default
    base = dict(checkpoint=ckpt, device="cpu", max_batch_size=8, max_queue=16, prefill_chunk=32,
                request_timeout_s=30, log_level="warning", engine="thread")
    return load_settings(**{**base, **overrides})


def make_app(ckpt: Path, **overrides):
    from app.server import create_app

    return create_app(make_settings(ckpt, **overrides))


def wait_ready(get, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if get("/health").status_code == 200:
            return
        time.sleep(0.01)
    raise AssertionError("server never became ready")


@contextlib.contextmanager
def app_client(ckpt: Path, **overrides):
    from fastapi.testclient import TestClient

    app = make_app(ckpt, **overrides)
    with TestClient(app) as client:
        wait_ready(client.get)
        yield client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving an app in a thread of this process (so tests can reach the engine)."""

    def __init__(self, app, server_cls=None, start_timeout: float = 60.0) -> None:
        import uvicorn

        self.app = app
        self.start_timeout = start_timeout  # loading a real checkpoint on a busy 2-core machine takes longer
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config) if server_cls is None else server_cls(config, app.state.service)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.service.engine

    def __enter__(self) -> LiveServer:
        import httpx

        self.thread.start()
        end = time.monotonic() + self.start_timeout  # only against a hang: a loaded host starts slowly
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise AssertionError("live server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def slow_model(engine, seconds: float):
    """Make every forward pass of the engine's model take at least `seconds` (a test-only slowdown)."""
    model = engine.model
    original = model.forward_cached

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    model.forward_cached = slow
    return lambda: model.__dict__.pop("forward_cached", None)


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON payloads ('[DONE]' kept as a string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def reference_generate(ckpt: Path, prompt: str, **params):
    """What engine.generate produces for one prompt alone (the solo reference)."""
    from engine.generate import generate
    from engine.params import SamplingParams
    from model.checkpoint import load_checkpoint

    c = load_checkpoint(ckpt)
    with torch.inference_mode():
        return generate(c.model, c.tokenizer, [c.tokenizer.encode(prompt)], SamplingParams(**params))[0]


def wait_until(cond, timeout=60.0, step=0.005) -> float:
    """Poll until `cond()` holds; the timeout only ends a hang (a loaded host is slow, never wrong)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(step)
    return time.monotonic() - t0


SLOW_CORE = REPO / "tests" / "slow_core"


def slow_core_env(seconds: float) -> dict:
    """The environment for `start_app_process` whose engine core sleeps `seconds` before each forward pass
    (tests/slow_core/sitecustomize.py): a request there outlasts the way of an abort from the front to the core."""
    path = os.pathsep.join(p for p in (str(SLOW_CORE), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "GPT_TEST_STEP_DELAY_S": str(seconds)}


def hang_up_when(url: str, path: str, body: dict, cond, timeout: float = 60.0) -> None:
    """POST `body` on a connection of its own, wait until `cond()` holds (the request is running), then close the
    connection without reading the reply: a client that goes away mid-request, at a moment the test chooses."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + data)
        wait_until(cond, timeout=timeout)


def start_app_process(ckpt: Path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m app` on a free port, waited for until /health is 200."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app", "--checkpoint", str(ckpt), "--port", str(port),
                             "--host", "127.0.0.1", "--device", "cpu", "--torch-threads", "1", *flags],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, proc.stderr.read()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, timeout=60, step=0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


# ------------------------------------------------------------------------------------------ the test_app* files
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
