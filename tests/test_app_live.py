"""Against a live uvicorn on 127.0.0.1: real concurrency (batching), client disconnects, unmodified
clients (openai SDK, huggingface_hub InferenceClient), graceful drain, and the real entry points
(`python -m app`, `uvicorn app.main:app`) as subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.app_helpers import (
    LiveServer,
    free_port,
    hang_up_when,
    make_app,
    reference_generate,
    slow_core_env,
    slow_model,
    sse_events,
    start_app_process,
    wait_until,
)
from tests.helpers import REPO

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def live(tiny_ckpt):
    with LiveServer(make_app(tiny_ckpt, max_batch_size=8, max_queue=32)) as server:
        yield server


BODIES = [
    {"inputs": "hello", "parameters": {"max_new_tokens": 20}},
    {"inputs": "The king is dead", "parameters": {"max_new_tokens": 9}},
    {"inputs": "abc", "parameters": {"max_new_tokens": 31, "repetition_penalty": 1.3}},
    {"inputs": "x", "parameters": {"max_new_tokens": 14, "stop": ["xyz"]}},
    {"inputs": "to be or not to be", "parameters": {"max_new_tokens": 25, "do_sample": True, "seed": 1}},
    {"inputs": "q", "parameters": {"max_new_tokens": 40, "temperature": 1.0, "top_k": 5, "seed": 2}},
    {"inputs": "once upon a time", "parameters": {"max_new_tokens": 12, "temperature": 1.2, "top_p": 0.8,
                                                  "seed": 3}},
    {"inputs": "the the", "parameters": {"max_new_tokens": 33, "temperature": 0.7, "top_k": 20, "top_p": 0.9,
                                         "seed": 4}},
]


def essentials(out: dict):
    d = out["details"]
    return out["generated_text"], [t["id"] for t in d["tokens"]], d["finish_reason"], d["seed"]


def test_eight_concurrent_requests_get_their_solo_results_and_run_batched(live):
    bodies = [{**b, "parameters": {**b["parameters"], "details": True}} for b in BODIES]
    solo = [httpx.post(live.url + "/generate", json=b, timeout=30).json() for b in bodies]
    engine = live.engine
    engine.max_batch_seen = 0

    async def fire():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            engine.pause()  # all eight are queued before the first step: one batch of eight
            tasks = [asyncio.create_task(client.post("/generate", json=b)) for b in bodies]
            while engine.n_queued < len(bodies):
                await asyncio.sleep(0.005)
            engine.resume()
            return [r.json() for r in await asyncio.gather(*tasks)]

    together = asyncio.run(fire())
    assert [essentials(o) for o in together] == [essentials(o) for o in solo]
    for a, b in zip(together, solo):
        assert [t["logprob"] for t in a["details"]["tokens"]] == pytest.approx(
            [t["logprob"] for t in b["details"]["tokens"]], abs=1e-4)
    assert engine.stats["max_batch_seen"] == 8
    # and the greedy ones are the model's own solo generation
    ref = reference_generate(live.app.state.service.checkpoint_path, "hello", max_new_tokens=20, temperature=0)
    assert solo[0]["generated_text"] == ref.text


def test_concurrent_streams_interleave(live):
    """Streams that overlap in time all complete correctly while sharing the batch."""
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 30, "do_sample": True, "seed": 9}}
    solo = sse_events(httpx.post(live.url + "/generate_stream", json=body, timeout=30).text)[-1]["generated_text"]

    async def one(client):
        async with client.stream("POST", "/generate_stream", json=body) as r:
            return sse_events((await r.aread()).decode())[-1]["generated_text"]

    async def fire():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            return await asyncio.gather(*(one(client) for _ in range(6)))

    assert asyncio.run(fire()) == [solo] * 6


TGI_LONG = {"inputs": "a", "parameters": {"max_new_tokens": 100}}  # greedy: no EOS within its 100 tokens
OPENAI_LONG = {"max_tokens": 100, "ignore_eos": True}
LONG = [
    ("/generate", TGI_LONG),
    ("/generate_stream", TGI_LONG),
    ("/", TGI_LONG),
    ("/", {**TGI_LONG, "stream": True}),
    ("/v1/completions", {"prompt": "a", **OPENAI_LONG}),
    ("/v1/completions", {"prompt": "a", **OPENAI_LONG, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], **OPENAI_LONG}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], **OPENAI_LONG, "stream": True}),
]


@pytest.mark.parametrize("path,body", LONG, ids=[p + (" stream" if p == "/generate_stream" or b.get("stream") else "")
                                                 for p, b in LONG])
def test_a_client_disconnect_on_any_generating_route_cancels_the_request(live, path, body):
    """The client hangs up once its request runs (plain or streamed): the slot is freed, the request is counted
    cancelled (499) and the engine stops generating for it well before its 100 tokens (10 ms a step)."""
    engine = live.engine
    series = 'gpt_requests_total{finish_reason="cancelled",status="499"}'

    def cancelled() -> float:
        line = next((x for x in httpx.get(live.url + "/metrics").text.splitlines() if x.startswith(series + " ")),
                    None)
        return 0.0 if line is None else float(line.split()[-1])

    before, generated = cancelled(), engine.stats["generated_tokens"]
    restore = slow_model(engine, 0.01)
    try:
        hang_up_when(live.url, path, body, lambda: engine.stats["generated_tokens"] > generated)
        wait_until(lambda: engine.n_running == 0)
        assert engine.stats["generated_tokens"] - generated < 100
        wait_until(lambda: cancelled() == before + 1)
    finally:
        restore()
    assert httpx.post(live.url + "/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 3}}
                      ).status_code == 200


def test_openai_sdk(live):
    openai = pytest.importorskip("openai")
    ref = reference_generate(live.app.state.service.checkpoint_path, "hello", max_new_tokens=8, temperature=0)
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    c = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, logprobs=2)
    assert c.choices[0].text == ref.text and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens == len(ref.prompt)
    assert len(c.choices[0].logprobs.token_logprobs) == 8 and len(c.choices[0].logprobs.top_logprobs[0]) == 2
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == 8
    seeded = [client.completions.create(model="tiny", prompt="hi", max_tokens=10, seed=5).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert client.models.list().data[0].id == "tiny"
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's error object: the SDK exposes message and param
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert "max_tokens: must be >= 1" in e.value.message and e.value.param == "max_tokens"
    assert e.value.code == "validation" and e.value.type == "invalid_request_error"


def test_huggingface_inference_client(live):
    hub = pytest.importorskip("huggingface_hub")
    path = live.app.state.service.checkpoint_path
    ref = reference_generate(path, "hello", max_new_tokens=8, temperature=0)
    hf = hub.InferenceClient(base_url=live.url)
    assert hf.text_generation("hello", max_new_tokens=8) == ref.text  # no sampling parameter: greedy (TGI)
    out = hf.text_generation("hello", max_new_tokens=8, details=True)
    assert out.generated_text == ref.text and out.details.finish_reason == "length"
    assert [t.id for t in out.details.tokens] == ref.tokens and out.details.generated_tokens == 8
    assert "".join(hf.text_generation("hello", max_new_tokens=8, stream=True)) == ref.text
    events = list(hf.text_generation("hello", max_new_tokens=8, stream=True, details=True))
    assert [e.token.id for e in events] == ref.tokens
    assert events[-1].generated_text == ref.text and events[-1].details.finish_reason == "length"
    assert events[-1].details.generated_tokens == 8 and events[0].details is None
    seeded = reference_generate(path, "hi", max_new_tokens=10, temperature=1.0, seed=4)
    assert hf.text_generation("hi", max_new_tokens=10, do_sample=True, seed=4) == seeded.text
    with pytest.raises(Exception) as e:
        hf.text_generation("hi", max_new_tokens=10, top_k=-3)
    assert type(e.value).__name__ == "ValidationError" and "parameters.top_k" in str(e.value)


def test_sigterm_drains_in_flight_requests(tiny_ckpt):
    from app.serve import DrainingServer

    app = make_app(tiny_ckpt, shutdown_timeout_s=10)
    with LiveServer(app, DrainingServer) as s:
        restore = slow_model(s.engine, 0.01)
        result = {}

        def stream():
            r = httpx.post(s.url + "/generate_stream", json={"inputs": "a", "parameters": {"max_new_tokens": 60}},
                           timeout=30)
            result["events"] = sse_events(r.text)

        t = threading.Thread(target=stream)
        t.start()
        wait_until(lambda: s.engine.n_running == 1)
        s.server.handle_exit(signal.SIGTERM, None)
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(s.url + "/generate", json={"inputs": "b"})
        assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
        t.join(20)
        restore()
        events = result["events"]
        assert len(events) == 60 and events[-1]["generated_text"] is not None  # finished, not cut off
        s.thread.join(15)
        assert not s.thread.is_alive()  # and then the server stopped by itself


def test_drain_timeout_ends_each_open_stream_with_an_error_event(tiny_ckpt, caplog):
    """Past GPT_SHUTDOWN_TIMEOUT_S the drain ends what still runs: every open stream gets a final error event in
    its API's shape (OpenAI streams then `[DONE]`), closes cleanly, and nothing logs a traceback."""
    from app.serve import DrainingServer

    app = make_app(tiny_ckpt, shutdown_timeout_s=0.3)
    results: dict[str, str] = {}
    with LiveServer(app, DrainingServer) as s:
        restore = slow_model(s.engine, 0.05)  # 100 tokens would take 5 s
        # The OpenAI routes sample with a fresh seed, and the tiny model samples <|endoftext|> early in ~1 of 4
        # requests (measured): ignore_eos keeps every stream open until the drain ends it (CI flaked on this)
        bodies = {"/generate_stream": {"inputs": "a", "parameters": {"max_new_tokens": 100}},
                  "/v1/completions": {"prompt": "a", "max_tokens": 100, "stream": True, "ignore_eos": True},
                  "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 100,
                                           "stream": True, "ignore_eos": True}}

        def stream(route: str) -> None:
            results[route] = httpx.post(s.url + route, json=bodies[route], timeout=30).text

        threads = [threading.Thread(target=stream, args=(route,)) for route in bodies]
        for t in threads:
            t.start()
        wait_until(lambda: s.engine.n_running == 3)
        with caplog.at_level("WARNING"):
            s.server.handle_exit(signal.SIGTERM, None)
            for t in threads:
                t.join(20)
            s.thread.join(15)
        restore()
    assert not s.thread.is_alive()
    tgi = sse_events(results["/generate_stream"])
    assert tgi[-1]["error_type"] == "unavailable" and "shut down" in tgi[-1]["error"] and len(tgi) < 100
    for route in ("/v1/completions", "/v1/chat/completions"):
        events = sse_events(results[route])
        assert events[-1] == "[DONE]", route
        assert "error" in events[-2], (route, events[-3:])
        err = events[-2]["error"]
        assert err["code"] == "unavailable" and err["type"] == "server_error" and "shut down" in err["message"]
    assert "drain timed out" in caplog.text
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()], caplog.text


# ------------------------------------------------------------------------------------- real entry points
def run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_python_m_app_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    p = run([sys.executable, "-m", "app", "--checkpoint", str(tmp_path / "nope"), "--port", str(free_port())])
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load checkpoint:") and "not found" in lines[0]


def test_uvicorn_app_main_fails_in_lifespan_with_a_clear_line(tmp_path):
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text('{"n_layer": 2, "block_size": 64, "bogus": 1}')
    p = run([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(free_port())],
            env={"GPT_CHECKPOINT": str(bad)})
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert any("cannot load checkpoint" in line and "bogus" in line for line in p.stderr.splitlines()), p.stderr


def test_python_m_app_serves_matches_model_sample_and_exits_0_on_sigterm(tiny_ckpt):
    proc, url = start_app_process(tiny_ckpt)
    try:
        text = httpx.post(url + "/generate", json={"inputs": "To be", "parameters": {"max_new_tokens": 20,
                                                                                       "temperature": 0}}).json()
        cli = run([sys.executable, "-m", "engine.sample", "--checkpoint", str(tiny_ckpt), "--prompt", "To be",
                   "--max-new-tokens", "20", "--temperature", "0"])
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout in (text["generated_text"], text["generated_text"] + "\n")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _parent(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_the_http_front_never_loads_torch(tiny_ckpt):
    """`python -m app`'s own process is the HTTP front: it reads the checkpoint's config and tokenizer, validates,
    compiles grammars, detokenizes and streams, while the engine core's process holds torch. Loading torch there
    too cost GPT-2's start 0.3 s on 2 cores (both imports at once) and ~200 MB a front (docs/performance.md)."""
    proc, url = start_app_process(tiny_ckpt)
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code == 200, r.text
        with httpx.stream("POST", url + "/generate_stream", json={"inputs": "To be", "parameters": {
                "max_new_tokens": 8, "stop": ["xyz"], "seed": 2, "do_sample": True}}) as s:
            assert s.status_code == 200 and sum(1 for line in s.iter_lines() if line.startswith("data:")) >= 1
        assert httpx.post(url + "/generate", json={"inputs": "to be " * 2000}).status_code == 422  # past the context
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps, [m for m in maps.splitlines() if "libtorch" in m][:3]
        children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid]
        assert any("libtorch" in Path(f"/proc/{c}/maps").read_text() for c in children)  # the check sees torch
    finally:
        proc.kill()
        proc.wait()


def test_second_sigterm_exits_at_once_with_status_0(tiny_ckpt, tmp_path):
    """A second signal during the drain exits at once, status 0, with a log line (was SIGABRT: 'terminate
    called without an active exception' while the engine thread was inside torch)."""
    # a TMPDIR of its own: another process's server (a benchmark, a parallel test) cannot add a core directory here;
    # a slowed core (50 ms a step): the drain of the queue would take minutes, so only exiting at once ends it
    proc, url = start_app_process(tiny_ckpt, "--max-batch-size", "1",
                                  env={"GPT_SHUTDOWN_TIMEOUT_S": "600", "TMPDIR": str(tmp_path),
                                       **slow_core_env(0.05)})
    results = []
    try:
        async def load() -> None:  # one slot, 40 long requests
            async with httpx.AsyncClient(timeout=None) as c:
                results.extend(await asyncio.gather(*[c.post(url + "/generate", json={"inputs": "a", "parameters": {
                    "max_new_tokens": 120, "do_sample": True, "seed": i}}) for i in range(40)],
                    return_exceptions=True))

        loader = threading.Thread(target=lambda: asyncio.run(load()), daemon=True)
        loader.start()
        # the bounds below only end a hang
        wait_until(lambda: httpx.get(url + "/info").json()["engine"]["queued"] > 10, timeout=60, step=0.05)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(url + "/health").status_code == 503, timeout=60, step=0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        loader.join(60)
        # the requests still queued were cut off, not drained (a drain would answer each)
        assert sum(isinstance(r, httpx.TransportError) for r in results) >= 10, results
        err = proc.stderr.read()
        assert "second signal" in err and "exiting now" in err
        assert "terminate called" not in err and "Traceback" not in err, err
        assert not list(tmp_path.glob("gpt-core-*"))  # the core's socket directory is removed even on the way out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
