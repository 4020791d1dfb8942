"""GET /live: the liveness probe (Kubernetes livenessProbe, deploy/k8s). It fails only when the engine thread is
dead -- loading, warming up and draining are healthy states for a liveness check (only /health turns 503)."""

from __future__ import annotations

import threading
import time

import pytest

from app.engine import Engine
from tests.test_app_support import app_client, make_app, tiny_ckpt  # noqa: F401


def engine_of(client):
    return client.app.service.engine


def test_live_is_200_when_ready_and_while_draining(tiny_ckpt):  # noqa: F811
    with app_client(tiny_ckpt) as c:
        r = c.get("/live")
        assert r.status_code == 200 and r.json() == {"status": "alive"}
        c.app.service.begin_drain()
        assert c.get("/health").status_code == 503
        r = c.get("/live")
        assert r.status_code == 200 and r.json() == {"status": "alive"}


def test_live_is_200_while_warming_up(tiny_ckpt, monkeypatch):  # noqa: F811
    from fastapi.testclient import TestClient

    gate = threading.Event()
    original = Engine._warmup

    def slow_warmup(self):
        gate.wait(10)
        original(self)

    monkeypatch.setattr(Engine, "_warmup", slow_warmup)
    with TestClient(make_app(tiny_ckpt)) as c:
        try:
            assert c.get("/health").status_code == 503
            r = c.get("/live")
            assert r.status_code == 200 and r.json() == {"status": "alive"}
        finally:
            gate.set()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread we end
def test_live_is_503_when_the_engine_thread_died(tiny_ckpt):  # noqa: F811
    with app_client(tiny_ckpt) as c:
        engine = engine_of(c)

        def die():
            raise SystemExit  # ends the worker thread quietly (threading ignores SystemExit)

        engine._expire_waiting = die  # called at the top of every loop iteration, outside the step's try
        with engine._cv:
            engine._cv.notify()
        end = time.monotonic() + 10
        while engine.alive and time.monotonic() < end:
            time.sleep(0.01)
        assert not engine.alive
        r = c.get("/live")
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["error_type"] == "unavailable" and "engine" in body["error"] and body["status"] == "dead"
        assert c.get("/health").status_code == 503  # readiness fails too
        del engine._expire_waiting  # so the lifespan shutdown's stop() finds nothing odd
