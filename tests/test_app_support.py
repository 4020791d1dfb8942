"""Shared pieces for the app and engine tests (no tests here): a tiny checkpoint built once per session,
app factories, and a live uvicorn server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_model, write_byte_ranks

BLOCK = 128  # context of the test model


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The test model is tiny: one intra-op thread is fastest, and far faster on a busy shared machine
    (OpenMP threads spin while they wait for cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A 2-layer byte-level GPT (vocab 261, context 128) saved as a real checkpoint."""
    from model.checkpoint import save_checkpoint
    from model.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("ckpt")
    ranks = write_byte_ranks(d / "bytes.tiktoken", [b"th", b"he", b" t", b"the"])
    tok = Tokenizer.from_ranks_file(ranks)
    model = tiny_model(0, vocab_size=tok.vocab_size, block_size=BLOCK)
    return save_checkpoint(d / "tiny", model, tok, {"note": "app tests"}, tokenizer_file=ranks)


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

    def __init__(self, app, server_cls=None) -> None:
        import uvicorn

        self.app = app
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
        end = time.monotonic() + 15
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
    from engine.sampling import SamplingParams
    from model.checkpoint import load_checkpoint

    c = load_checkpoint(ckpt)
    with torch.inference_mode():
        return generate(c.model, c.tokenizer, [c.tokenizer.encode(prompt)], SamplingParams(**params))[0]
