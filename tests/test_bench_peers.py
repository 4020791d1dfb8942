"""bench.peers' pure helpers: prompts, request bodies, SSE parsing (bench.harness'), summaries, server commands.

No servers, no network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import harness, peers


def test_parse_list_keeps_order_and_refuses_unknown_names():
    assert peers.parse_list("vllm, ours,vllm", peers.SERVERS, "servers") == ["vllm", "ours"]
    with pytest.raises(SystemExit, match="unknown servers \\['tgi'\\]"):
        peers.parse_list("ours,tgi", peers.SERVERS, "servers")
    with pytest.raises(SystemExit, match="no workloads"):
        peers.parse_list(" , ", peers.WORKLOADS, "workloads")


def test_prompts_are_deterministic_token_ids_of_the_documented_shapes():
    fixed = peers.prompt_ids("fixed", 0)
    assert fixed == peers.prompt_ids("fixed", 7) and len(fixed) == 32
    longs = [peers.prompt_ids("long", i) for i in range(3)]
    assert all(len(p) == 512 for p in longs) and len({tuple(p) for p in longs}) == 3
    a, b = peers.prompt_ids("prefix", 0), peers.prompt_ids("prefix", 1)
    assert len(a) == len(b) == 512 and a[:480] == b[:480] and a[480:] != b[480:]
    every = fixed + sum(longs, []) + a + b
    assert all(0 <= t < peers.EOT for t in every)  # never <|endoftext|>
    with pytest.raises(ValueError):
        peers.prompt_ids("short", 0)


def test_completion_body_greedy_and_sampled():
    greedy = peers.completion_body([1, 2], 8, 0.0, seed=3)
    assert greedy == {"model": peers.MODEL_NAME, "prompt": [1, 2], "max_tokens": 8, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": 0.0}
    sampled = peers.completion_body([1], 4, 0.8, seed=5)
    # the full distribution everywhere: llama-server's default top_k 40 / min_p 0.05 switched off
    assert sampled["seed"] == 5 and sampled["top_k"] == -1 and sampled["top_p"] == 1.0 and sampled["min_p"] == 0.0


def test_parse_sse_events_splits_complete_events_and_keeps_the_rest():
    buf = b'data: {"a": 1}\n\n: ping\n\ndata:{"b": 2}\r\n\r\ndata: [DONE]\n\ndata: {"c"'
    events, rest = harness.parse_sse_events(buf)
    assert events == [b'{"a": 1}', b'{"b": 2}'] and rest == b'data: {"c"'
    assert harness.parse_sse_events(b"") == ([], b"")


def chunk(text, finish=None, usage=None):
    obj = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj).encode()


def test_chunk_info_counts_tokens_not_stream_endings():
    assert peers.chunk_info(chunk(" the"))["token"] is True
    assert peers.chunk_info(chunk(" end", "length"))["token"] is True  # ours and vLLM: the last token ends it
    assert peers.chunk_info(chunk("", None))["token"] is True  # a token whose text is held back (partial UTF-8)
    end = peers.chunk_info(chunk("", "length", {"completion_tokens": 3, "prompt_tokens": 3}))
    assert end["token"] is False and end["completion_tokens"] == 3 and end["finish_reason"] == "length"  # llama
    usage_only = peers.chunk_info(json.dumps({"choices": [], "usage": {"completion_tokens": 9}}).encode())
    assert usage_only == {"token": False, "completion_tokens": 9, "finish_reason": None}
    err = peers.chunk_info(json.dumps({"error": {"message": "boom", "type": "x"}}).encode())
    assert err["error"] == "boom" and err["token"] is False


def test_percentile_nearest_rank():
    assert peers.percentile([], 50) is None
    assert peers.percentile([3.0], 99) == 3.0
    xs = [float(i) for i in range(1, 101)]
    assert peers.percentile(xs, 50) == 50.0 and peers.percentile(xs, 99) == 99.0 and peers.percentile(xs, 100) == 100.0


def test_summarize_uses_usage_counts_and_measures_decode_after_the_first_token():
    reqs = [{"times": [0.1, 0.2, 0.3], "completion_tokens": 5, "error": None, "finish_reason": "length"},
            {"times": [0.2, 0.3], "completion_tokens": None, "error": None, "finish_reason": "stop"},
            {"times": [], "completion_tokens": None, "error": "HTTP 500: b''", "finish_reason": None}]
    s = peers.summarize("s16", reqs, wall=1.0)
    assert s["requests"] == 3 and s["errors"] == 1 and s["error_examples"] == ["HTTP 500: b''"]
    assert s["generated_tokens"] == 7 and s["tok_s"] == 7.0  # 5 from usage + 2 events
    assert s["ttft_ms_p50"] == 100.0 and s["ttft_ms_all"] == [100.0, 200.0]
    assert s["decode_tok_s_p50"] == pytest.approx(15.0)  # median of (5-1)/0.2 = 20 and (2-1)/0.1 = 10
    assert s["tokens_per_request_min"] == 2 and s["token_count_from_usage"] is False


def test_first_mismatch():
    assert peers.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert peers.first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert peers.first_mismatch([1, 2], [1, 2, 3]) == 2


PATHS = {"python": "/venv/bin/python", "checkpoint": Path("/ck"), "vllm_python": "/v/bin/python",
         "export_dir": Path("/ck-export"), "llama_server": "/b/llama-server",
         "gguf": {"f32": "/m/f32.gguf", "f16": "/m/f16.gguf"}, "vllm_preload": ["/lib/libtcmalloc_minimal.so.4"]}


def test_server_commands_have_equal_threads_context_and_slots_on_loopback():
    ours, env = peers.server_command("ours", 9001, 2, PATHS)
    assert ours[:3] == ["/venv/bin/python", "-m", "app"] and env == {}
    assert ours[ours.index("--host") + 1] == "127.0.0.1" and ours[ours.index("--torch-threads") + 1] == "2"
    assert ours[ours.index("--max-batch-size") + 1] == str(peers.SLOTS) and "fp32" in ours

    vllm, env = peers.server_command("vllm", 9002, 2, PATHS)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # `vllm serve` fails on the dist name
    assert vllm[vllm.index("--max-num-seqs") + 1] == str(peers.SLOTS)
    assert vllm[vllm.index("--max-model-len") + 1] == str(peers.CONTEXT)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4"
    _, env = peers.server_command("vllm-default-threads", 9002, 2, PATHS)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    _, env = peers.server_command("vllm-no-preload", 9002, 2, PATHS)
    assert "LD_PRELOAD" not in env

    llama, env = peers.server_command("llama-f16", 9003, 2, PATHS)
    assert llama[:3] == ["/b/llama-server", "-m", "/m/f16.gguf"] and env == {}
    assert llama[llama.index("-t") + 1] == llama[llama.index("-tb") + 1] == "2"
    # -c is the total over the slots: each of the SLOTS slots gets the full context
    assert int(llama[llama.index("-c") + 1]) == peers.CONTEXT * int(llama[llama.index("-np") + 1])
    nocache, _ = peers.server_command("llama-f32-nocache", 9003, 2, PATHS)
    assert "--no-cache-prompt" in nocache and "/m/f32.gguf" in nocache
    for argv in (ours, vllm, llama):
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1].startswith("900")


def test_ratios_are_oriented_so_that_above_one_means_ours_is_better():
    ours = {"b1.decode_tok_s_p50": {"median": 30.0}, "b1.ttft_ms_p50": {"median": 100.0}}
    peer = {"b1.decode_tok_s_p50": {"median": 40.0}, "b1.ttft_ms_p50": {"median": 50.0}}
    assert peers.ratios({"ours": ours, "llama-f32": peer}) == {
        "llama-f32": {"b1.decode_tok_s_p50": 0.75, "b1.ttft_ms_p50": 0.5}}


def test_server_summary_medians_over_rounds_and_counts_failures():
    rounds = [{"startup_s": 5.0, "idle_memory": {"rss_mb": 100.0, "pss_mb": 90.0},
               "workloads": {"b1": {"decode_tok_s_p50": 30.0, "ttft_ms_p50": 80.0}}},
              {"startup_s": 7.0, "idle_memory": {"rss_mb": 110.0, "pss_mb": 95.0},
               "workloads": {"b1": {"decode_tok_s_p50": 34.0, "ttft_ms_p50": 90.0}}},
              {"error": "RuntimeError: not ready", "startup_s": None}]
    s = peers.server_summary(rounds)
    assert s["rounds_ok"] == 2 and s["rounds_failed"] == 1
    assert s["b1.decode_tok_s_p50"] == {"median": 32.0, "range": [30.0, 34.0]}
    assert s["startup_s"]["median"] == 6.0 and s["idle_pss_mb"] == 92.5


def test_lscpu_info_has_flags_and_reports_a_missing_lscpu(monkeypatch):
    info = peers.lscpu_info()  # lscpu is util-linux's, on every Debian
    assert "error" not in info and info["flags"] and int(info["CPU(s)"]) >= 1, info
    monkeypatch.setenv("PATH", "")
    assert "error" in peers.lscpu_info()


def test_crash_fallback_only_for_a_segfault_at_start_up_of_llama_server():
    crashed = {"error": "RuntimeError: exited with -11 during start-up: ..."}
    assert peers.crash_fallback("llama-q8_0", crashed, ["llama-server"]) == ["--no-repack"]
    assert peers.crash_fallback("llama-q8_0", crashed, ["llama-server", "--no-repack"]) is None  # tried already
    assert peers.crash_fallback("llama-q8_0", {"error": "RuntimeError: not ready after 300 s"}, []) is None
    assert peers.crash_fallback("ours", crashed, []) is None


def test_goals_take_the_better_fp32_peer():
    summ = {"ours": {"s16.tok_s": {"median": 150.0}, "long512.ttft_ms_p50": {"median": 500.0},
                     "b1.decode_tok_s_p50": {"median": 36.0}},
            "vllm": {"s16.tok_s": {"median": 200.0}, "long512.ttft_ms_p50": {"median": 400.0}},
            "llama-f32": {"s16.tok_s": {"median": 120.0}, "long512.ttft_ms_p50": {"median": 450.0},
                          "b1.decode_tok_s_p50": {"median": 40.0}},
            "llama-q8_0": {"s16.tok_s": {"median": 999.0}}}  # not fp32: not a goal's peer
    g = peers.goals(summ)
    s16 = g["16 streams tok/s vs the better fp32 peer"]
    assert s16["peer"] == "vllm" and s16["ratio"] == 0.75 and s16["met"] is False
    ttft = g["TTFT of distinct 512-token prompts vs the better fp32 peer"]
    assert ttft["peer"] == "vllm" and ttft["ratio"] == 0.8
    b1 = g["batch-1 decode tok/s vs llama-server f32"]
    assert b1["ratio"] == 0.9 and b1["met"] is True
    assert "64 streams tok/s vs the better fp32 peer" not in g  # not measured
