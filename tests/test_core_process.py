"""The engine core in its own process (engine/core_process.py, the server's default): results equal the
library's and the thread mode's, a killed core ends every stream at once and the server exits non-zero, and
several HTTP fronts (GPT_API_SERVERS) share one core with metrics that add up."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from engine.build import CoreConfig, build_core
from engine.cpu_tuning import (
    CONTENDED_GAIN,
    THREAD_GAIN,
    KernelChoices,
    choose_threads,
    core_threads,
    thread_model_key,
)
from engine.heap import keep_freed_memory
from tests.app_helpers import (
    app_client,
    hang_up_when,
    reference_generate,
    slow_core_env,
    start_app_process,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)
# The aborts' tests slow the core by this much a forward pass: a request of 100 tokens then runs for seconds, so
# only an abort that reaches the core ends it early.
STEP_DELAY_S = 0.05

BODIES = [
    {"inputs": "hello", "parameters": {"max_new_tokens": 20, "temperature": 0}},
    {"inputs": "to be or not", "parameters": {"max_new_tokens": 25, "temperature": 0.9, "seed": 1}},
    {"inputs": "x", "parameters": {"max_new_tokens": 30, "temperature": 1.0, "top_k": 5, "seed": 2}},
    {"inputs": "once upon", "parameters": {"max_new_tokens": 12, "temperature": 1.2, "top_p": 0.8, "seed": 3}},
    {"inputs": "stop here", "parameters": {"max_new_tokens": 40, "temperature": 1.5, "seed": 5, "stop": ["e"]}},
    {"inputs": "abc", "parameters": {"max_new_tokens": 30, "temperature": 0, "repetition_penalty": 1.3}},
]


def core_dirs(tmp: Path) -> list[Path]:
    """The core socket directories under `tmp`: each test's server gets a TMPDIR of its own, so a server another
    process runs meanwhile (a benchmark, a parallel test) cannot show up here."""
    return list(tmp.glob("gpt-core-*"))


def stop(proc, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


def test_core_process_results_equal_the_library_and_the_thread_mode(tiny_ckpt, tmp_path):
    """Seeded and greedy requests, sent together, give each its solo library result through the core process;
    the thread mode gives the same tokens."""
    proc, url = start_app_process(tiny_ckpt, env={"TMPDIR": str(tmp_path)})
    try:
        assert httpx.get(url + "/info").json()["engine_mode"] == "process"
        with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
            together = list(pool.map(lambda b: httpx.post(url + "/generate", json=b, timeout=30).json(), BODIES))
    finally:
        assert stop(proc) == 0
    for body, got in zip(BODIES, together):
        p = dict(body["parameters"])
        ref = reference_generate(tiny_ckpt, body["inputs"], **p)
        assert got["generated_text"] == ref.text, body
    with app_client(tiny_ckpt) as c:  # engine="thread"
        threaded = [c.post("/generate", json=b).json() for b in BODIES]
    assert threaded == together
    assert not core_dirs(tmp_path)  # the core's socket directory is gone


def engine_stats(url: str) -> dict:
    """The core's stats as the front last heard them (running, queued, generated_tokens, ...)."""
    return httpx.get(url + "/info").json()["engine"]


def test_a_stop_string_in_the_front_aborts_the_request_in_the_core(tiny_ckpt):
    """The front finds the stop string and aborts the request in the core: the core stops generating well before
    the request's 100 tokens, which a slowed core (STEP_DELAY_S a step) would otherwise run for >= 5 s."""
    params = {"max_new_tokens": 100, "temperature": 0, "details": True}
    ref = reference_generate(tiny_ckpt, "stop here", max_new_tokens=100, temperature=0)
    assert len(ref.tokens) == 100  # no EOS: without the abort the core would run all 100
    stop_at = ref.text[10:12]  # a stop string that this greedy output reaches
    proc, url = start_app_process(tiny_ckpt, env=slow_core_env(STEP_DELAY_S))
    try:
        before = engine_stats(url)["generated_tokens"]
        r = httpx.post(url + "/generate", json={"inputs": "stop here", "parameters": {**params, "stop": [stop_at]}},
                       timeout=None)
        assert r.json()["details"]["finish_reason"] == "stop_sequence"
        wait_until(lambda: engine_stats(url)["running"] == 0, timeout=60)  # the bound only ends a hang
        assert engine_stats(url)["generated_tokens"] - before < 100
        # a grammar travels to the core process with its request; a stop string still ends a constrained one (no
        # client timeout: the first grammar compiles while the request waits, seconds on a loaded host)
        grammar = {"type": "regex", "value": "[a-e]{30}"}
        full = httpx.post(url + "/generate", json={"inputs": "stop here", "parameters": {
            **params, "grammar": grammar}}, timeout=None).json()
        assert re.fullmatch("[a-e]{30}", full["generated_text"]) and full["details"]["finish_reason"] == "stop_sequence"
        stop_at = full["generated_text"][10:13]
        cut = httpx.post(url + "/generate", json={"inputs": "stop here", "parameters": {
            **params, "grammar": grammar, "stop": [stop_at]}}, timeout=None).json()
        assert full["generated_text"].startswith(cut["generated_text"]) and stop_at not in cut["generated_text"]
    finally:
        stop(proc)


def test_sigkill_of_the_core_ends_every_stream_and_the_server_exits_non_zero(tiny_ckpt, tmp_path):
    """Eight streams in flight (a slowed core: none can finish first) when the core is killed: each ends with the
    'unavailable' error event, the server exits non-zero and the core is reaped."""
    proc, url = start_app_process(tiny_ckpt, "--max-new-tokens", "127",
                                  env={"TMPDIR": str(tmp_path), **slow_core_env(STEP_DELAY_S)})
    core_pid = httpx.get(url + "/info").json()["engine_pid"]
    started = concurrent.futures.ThreadPoolExecutor(8)
    first = [False] * 8
    slow = {"inputs": "a", "parameters": {"max_new_tokens": 120, "temperature": 1.0, "seed": 0}}

    def stream(i: int) -> str:
        with httpx.stream("POST", url + "/generate_stream", json={**slow, "parameters": {**slow["parameters"],
                                                                                         "seed": i}},
                          timeout=None) as r:
            last = ""
            try:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        first[i] = True
                        last = line
            except httpx.HTTPError:
                return "closed"
            return last

    try:
        futures = [started.submit(stream, i) for i in range(8)]
        wait_until(lambda: all(first), timeout=60, step=0.001)  # the bounds here only end a hang
        os.kill(core_pid, signal.SIGKILL)
        results = [f.result(timeout=60) for f in futures]
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code != 0
    for last in results:
        assert last != "closed"
        event = json.loads(last[5:])
        assert event.get("error_type") == "unavailable", event  # its final event is the error, none finished
    with pytest.raises(ProcessLookupError):
        os.kill(core_pid, 0)  # reaped, not a zombie (os.kill on a zombie succeeds)
    assert not core_dirs(tmp_path)


def test_two_api_servers_share_one_core_and_metrics_add_up(tiny_ckpt):
    proc, url = start_app_process(tiny_ckpt, "--api-servers", "2")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            # a new connection per request: the kernel spreads them over both fronts
            outs = list(pool.map(lambda i: httpx.post(url + "/generate", json={
                "inputs": "hi", "parameters": {"max_new_tokens": 4, "temperature": 0}}, timeout=30), range(16)))
        assert all(r.status_code == 200 for r in outs)
        assert len({r.json()["generated_text"] for r in outs}) == 1
        pids = {httpx.get(url + "/info").json()["engine_pid"] for _ in range(6)}
        assert len(pids) == 1  # one core behind both fronts
        for _ in range(4):  # whichever front answers, the counts are the sum over both
            text = httpx.get(url + "/metrics").text
            line = next(x for x in text.splitlines() if x.startswith('gpt_requests_total{finish_reason="length"'))
            assert float(line.split()[-1]) == 16.0, line
    finally:
        assert stop(proc) == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_client_disconnect_reaches_the_core_and_frees_the_slot(tiny_ckpt, stream):
    """A client that hangs up mid-request: the front counts it cancelled (499) and aborts it in the core, which
    stops generating; a slowed core (STEP_DELAY_S a step) would otherwise run its 120 tokens for >= 6 s."""
    proc, url = start_app_process(tiny_ckpt, "--max-new-tokens", "127", env=slow_core_env(STEP_DELAY_S))
    try:
        before = engine_stats(url)["generated_tokens"]
        body = {"prompt": "a", "max_tokens": 120, "ignore_eos": True, "stream": stream}  # no EOS ends it early
        hang_up_when(url, "/v1/completions", body, lambda: engine_stats(url)["generated_tokens"] > before)
        wait_until(lambda: engine_stats(url)["running"] == 0, timeout=60)  # the bound only ends a hang
        assert engine_stats(url)["generated_tokens"] - before < 120
        wait_until(lambda: 'finish_reason="cancelled",status="499"} 1.0' in httpx.get(url + "/metrics").text,
                   timeout=60)
        assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    finally:
        assert stop(proc) == 0


def test_prompt_logprobs_and_biases_cross_the_process_boundary(tiny_ckpt):
    """The new request and output fields (prompt log-probabilities, logit_bias with integer keys, min_tokens,
    stop_token_ids) travel through msgspec to the core process and back as in the thread mode."""
    bodies = [
        ("/v1/completions", {"prompt": "the king is dead, long live the king", "max_tokens": 2, "temperature": 0,
                             "echo": True, "logprobs": 2, "prompt_logprobs": 1}),
        ("/v1/completions", {"prompt": [[5, 6, 7, 8]], "max_tokens": 0, "echo": True, "logprobs": 0}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5, "temperature": 0.8, "seed": 3, "ignore_eos": True,
                             "logit_bias": {"104": 3.5}, "min_tokens": 2, "stop_token_ids": [101]}),
        ("/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 3, "decoder_input_details": True}}),
    ]

    def strip(out: dict) -> dict:
        return {k: v for k, v in out.items() if k not in ("id", "created")}

    proc, url = start_app_process(tiny_ckpt)
    try:
        got = [strip(httpx.post(url + route, json=b, timeout=30).json()) for route, b in bodies]
    finally:
        assert stop(proc) == 0
    with app_client(tiny_ckpt) as c:
        threaded = [strip(c.post(route, json=b).json()) for route, b in bodies]
    assert got == threaded
    assert got[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None and got[0]["choices"][0]["prompt_logprobs"]
    assert got[1]["choices"][0]["finish_reason"] == "length" and got[3]["details"]["prefill"][1]["logprob"] < 0


def test_the_core_uses_every_cpu_by_default_and_the_flag_overrides_it(tiny_ckpt):
    assert core_threads(CoreConfig(checkpoint="x")) == len(os.sched_getaffinity(0))
    assert core_threads(CoreConfig(checkpoint="x", torch_threads=3)) == 3
    proc, url = start_app_process(tiny_ckpt, "--torch-threads", "2")  # the last flag wins
    try:
        info = httpx.get(url + "/info").json()
        assert info["torch_threads"] == 2
        assert info["malloc_keeps_freed_memory"] is True  # glibc here: the core process keeps freed blocks
        times = info["startup_seconds"]  # where the core's start went, and its warm-up (done: /health said so)
        assert set(times) == {"imports", "load", "engine", "front_wait", "threads"}
        assert times["load"] == info["load_seconds"]
        assert all(v >= 0 for v in times.values()) and times["imports"] > 0  # Linux: the imports before its main
        assert info["engine"]["warmup_seconds"] > 0
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.parametrize("compile_, rules", [
    ("off", ((THREAD_GAIN + 0.3, 4), (THREAD_GAIN - 0.2, 3))),  # eager: the last core only for a measured gain
    # a compiled step gains from every core where the eager one does not: n unless the last makes it slower
    ("on", ((THREAD_GAIN - 0.2, 4), (1.0, 4), (CONTENDED_GAIN - 0.1, 3)))])
def test_choose_threads_keeps_the_last_core_only_for_a_measured_gain(tiny_ckpt, monkeypatch, compile_, rules):
    import torch

    import engine.cpu_tuning as ct

    core, _, _ = build_core(CoreConfig(checkpoint=str(tiny_ckpt), device="cpu", warmup=False, compile=compile_))
    assert core.runner.compile == compile_
    before = torch.get_num_threads()
    try:
        # the step's time comes from a fake clock: the last thread makes it `gain` times faster
        clock = {"t": 0.0, "gain": 1.0}
        model_forward = core.model.forward_cached

        def timed_forward(*a, **k):
            clock["t"] += 0.001 if torch.get_num_threads() == 4 else 0.001 * clock["gain"]
            return model_forward(*a, **k)

        for gain, want in rules:
            clock["gain"] = gain
            monkeypatch.setattr(core.model, "forward_cached", timed_forward)
            monkeypatch.setattr(ct.time, "perf_counter", lambda: clock["t"])
            got = choose_threads(core, 4)
            monkeypatch.undo()
            assert got["threads"] == want == torch.get_num_threads(), got
            assert got["last_thread_gain"] == pytest.approx(gain)
            assert core.cache.lengths[0] == 0  # the timing left its slot empty
        assert choose_threads(core, 1) == {"threads": 1, "cores": 1, "one_row_step_ms": None,
                                           "last_thread_gain": None, "chosen": "all"}
    finally:
        torch.set_num_threads(before)


def test_a_slow_step_keeps_every_thread_without_timing_more(tiny_ckpt, monkeypatch):
    import torch

    import engine.cpu_tuning as ct

    core, _, _ = build_core(CoreConfig(checkpoint=str(tiny_ckpt), device="cpu", warmup=False))
    before = torch.get_num_threads()
    clock = {"t": 0.0, "calls": 0}
    model_forward = core.model.forward_cached

    def slow_forward(*a, **k):
        clock["t"] += 0.02  # 20 ms a one-row step: the fronts' share of it is small
        clock["calls"] += 1
        return model_forward(*a, **k)

    monkeypatch.setattr(core.model, "forward_cached", slow_forward)
    monkeypatch.setattr(ct.time, "perf_counter", lambda: clock["t"])
    try:
        got = choose_threads(core, 2)
        assert got["threads"] == 2 and got["last_thread_gain"] is None and clock["calls"] == 6
    finally:
        torch.set_num_threads(before)


def test_a_step_slowed_by_a_busy_cpu_is_timed_against_fewer_threads(tiny_ckpt, monkeypatch):
    """Every thread waits on one that another process displaced: a step slow at n threads but fast at n - 1 is timed
    both ways (interleaved) and keeps n - 1, instead of taking every thread untimed."""
    import torch

    import engine.cpu_tuning as ct

    core, _, _ = build_core(CoreConfig(checkpoint=str(tiny_ckpt), device="cpu", warmup=False))
    before = torch.get_num_threads()
    clock = {"t": 0.0}
    model_forward = core.model.forward_cached

    def contended(*a, **k):
        clock["t"] += 0.010 if torch.get_num_threads() == 2 else 0.002
        return model_forward(*a, **k)

    monkeypatch.setattr(core.model, "forward_cached", contended)
    monkeypatch.setattr(ct.time, "perf_counter", lambda: clock["t"])
    try:
        got = choose_threads(core, 2)
        assert got["threads"] == 1 and got["chosen"] == "n-1" and got["last_thread_gain"] == pytest.approx(0.2)
    finally:
        torch.set_num_threads(before)


def test_the_timings_wait_until_the_parent_is_quiet():
    """The core's start-up timings (kernel choices, threads) go ahead once the parent has finished its own start
    (its imports compete for the CPUs): not before the event is set; at once without one; after the timeout if the
    parent never sets it."""
    import threading
    import time

    from engine.core_process import wait_quiet

    quiet = threading.Event()
    set_at = []

    def parent_done():
        set_at.append(time.monotonic())
        quiet.set()

    threading.Timer(0.3, parent_done).start()
    waited = wait_quiet(quiet)
    assert set_at and waited >= 0.25  # returned only after the parent said so
    assert 0.04 <= wait_quiet(threading.Event(), timeout=0.05) < 1
    assert wait_quiet(None) < 0.05


def test_the_malloc_tuning_leaves_glibcs_own_settings_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False


def test_the_thread_choice_is_kept_per_machine_model_and_format(tiny_ckpt, tmp_path, monkeypatch):
    """engine.core_process.kept_thread_choice: the first start times the thread count and keeps it beside the
    kernel choices; a later start of the same model and format takes it untimed (no wait for the parent either);
    another cache dtype, a kept count above the cores now given, or an entry that is not a count is timed again."""
    import dataclasses

    import torch

    import engine.core_process as cp

    timed, waited = [], []

    def fake_choose(core, n):
        timed.append(n)
        torch.set_num_threads(n - 1)
        return {"threads": n - 1, "cores": n, "one_row_step_ms": 2.0, "last_thread_gain": 1.01, "chosen": "n-1"}

    monkeypatch.setattr(cp, "choose_threads", fake_choose)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # as the core process loads (core_threads); the machine key counts them
        machine = KernelChoices().key
        cfg = CoreConfig(checkpoint=str(tiny_ckpt), device="cpu", warmup=False, compile_cache=str(tmp_path),
                         torch_threads=2)
        core, _, _ = build_core(cfg)
        first = cp.kept_thread_choice(core, cfg, lambda: waited.append(1))
        assert first["kept"] is False and first["threads"] == 1 and timed == [2] and waited == [1]
        torch.set_num_threads(2)
        again = cp.kept_thread_choice(core, cfg, lambda: waited.append(1))
        assert again == {"threads": 1, "cores": 2, "one_row_step_ms": None, "last_thread_gain": None,
                         "chosen": "n-1", "kept": True}
        assert timed == [2] and waited == [1] and torch.get_num_threads() == 1
        # the entry sits beside the kernels' in kernels.json, under this machine's key
        entry = json.loads((tmp_path / "kernels.json").read_text())[machine]
        key = "threads " + thread_model_key(core)
        assert entry[key] == 1 and "cache float32" in key

        bf16, _, _ = build_core(dataclasses.replace(cfg, kv_cache_dtype="bf16"))
        torch.set_num_threads(2)
        assert cp.kept_thread_choice(bf16, cfg, lambda: None)["kept"] is False and timed == [2, 2]
        torch.set_num_threads(2)

        more = dataclasses.replace(cfg, torch_threads=1)  # kept 1 <= 1: still kept
        assert cp.kept_thread_choice(core, more, lambda: None)["kept"] is True
        torch.set_num_threads(2)
        entry[key] = 3  # more threads than this start has
        (tmp_path / "kernels.json").write_text(json.dumps({machine: entry}))
        assert cp.kept_thread_choice(core, cfg, lambda: None)["kept"] is False and timed == [2, 2, 2]
        torch.set_num_threads(2)
        entry[key] = "one"
        (tmp_path / "kernels.json").write_text(json.dumps({machine: entry}))
        assert cp.kept_thread_choice(core, cfg, lambda: None)["kept"] is False and len(timed) == 4
    finally:
        torch.set_num_threads(before)


def test_a_core_started_before_its_settings_loads_once_they_come(tiny_ckpt):
    """`python -m app` starts the core's process before it parses its settings (torch loads meanwhile); the
    settings follow through a pipe, and the process loads and serves as one started with them."""
    from app.config import load_settings
    from engine.core_process import CoreProcess

    core = CoreProcess(None)
    core.start()
    try:
        core.configure(CoreConfig.from_settings(load_settings(checkpoint=str(tiny_ckpt), device="cpu",
                                                              torch_threads=1)))
        info = core.wait_loaded(60)
        assert info["n_params"] > 0 and info["startup_seconds"]["front_wait"] >= 0
    finally:
        assert core.stop() == 0
    assert not core.dir.exists()


@pytest.mark.parametrize("argv", [["--max-batch-size", "zero"], ["--help"], ["--dtype", "fp64"]])
def test_a_start_that_ends_before_its_settings_leaves_no_core_behind(argv, tmp_path, monkeypatch, capsys):
    """A bad flag or setting, or --help: the core started first is stopped, its socket folder removed."""
    import app.__main__ as cli
    from engine.core_process import CoreProcess

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    made: list[CoreProcess] = []
    real = CoreProcess.__init__

    def spy(self, cfg):
        real(self, cfg)
        made.append(self)

    monkeypatch.setattr(CoreProcess, "__init__", spy)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    assert code != 0 or argv == ["--help"]
    assert len(made) == 1 and not made[0].proc.is_alive() and made[0].proc.exitcode is not None
    assert core_dirs(tmp_path) == []
