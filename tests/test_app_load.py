"""The HTTP API in-process under load and through its life: admission and 429, time limits, metrics, the prefix
cache across turns, warming up, draining, a failed start, liveness."""

from __future__ import annotations

import threading
import time

import pytest

from tests.app_helpers import (
    app_client,
    assert_error,
    engine_of,
    make_app,
    slow_model,
    sse_events,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


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
