"""Peers benchmark: our server against vLLM (CPU) and llama.cpp's llama-server, same weights, one client.

    python -m bench.peers                      # set up what is missing, then 2 interleaved rounds of everything
    python -m bench.peers --setup-only         # only build the peers (vLLM venv, llama-server, GGUF files)
    python -m bench.peers --servers ours,llama-f32 --workloads b1 --rounds 1 --new-tokens 16   # a smoke run

The model is the random GPT-2 124M of bench/common.py (`random_gpt2`), exported with `python -m model.export_hf`
for vLLM and converted to GGUF (f32 / f16 / q8_0) with the `convert_hf_to_gguf.py` of the llama.cpp tree
vendored in the `llama-cpp-python` sdist, whose cmake build gives `llama-server`. Everything the peers need lives
under BENCH_CACHE/peers (default ~/.cache/gpt-serve-bench/peers), outside the repository, set up by
bench/peer_setup.py; each step is skipped when its output is already there. A peer whose setup fails is recorded
as failed in the JSON (with the log's tail) and the bench goes on with the others.

Each round starts every server in turn (the order reversed on odd rounds), on 127.0.0.1 with equivalent
settings: the same threads, 32 slots of the full 1024-token context, fp32 weights unless the name says
otherwise; then it measures start-up time and idle memory, and drives the server with one client
(bench/harness.py's raw asyncio HTTP/1.1 client, OpenAI `/v1/completions` with `stream: true`) through the
workloads; then stops it. Once per server it checks greedy-token equality with ours on the same prompt (token ids
through each server's own API) and, on a mismatch, gives our model's logit margin at the first differing position.
Writes bench/results/<out>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench.common import CACHE, env_info, median, print_table, random_gpt2, set_threads, write_result
from bench.harness import Server, SSEConnection, compile_bytecode, free_port, tree_memory_mb
from bench.peer_setup import TORCH_VERSION, setup_peers

CONTEXT = 1024  # GPT-2's context: every server gets SLOTS sequences of this length
SLOTS = 32  # our CPU default (engine.sizing.CPU_DEFAULT_BATCH); llama-server -np, vLLM --max-num-seqs
EOT = 50256
MODEL_NAME = "gpt2-random"

# name → (kind, weights); kinds: ours (python -m app), vllm, llama (llama-server on a GGUF file)
SERVERS: dict[str, dict[str, Any]] = {
    "ours": {"kind": "ours", "weights": "fp32"},
    "vllm": {"kind": "vllm", "weights": "fp32"},
    "llama-f32": {"kind": "llama", "weights": "f32"},
    "llama-f16": {"kind": "llama", "weights": "f16"},
    "llama-q8_0": {"kind": "llama", "weights": "q8_0"},
    "llama-q4_0": {"kind": "llama", "weights": "q4_0"},
    "llama-q4_K_M": {"kind": "llama", "weights": "q4_K_M"},
    # not in the default set: the other configurations
    "vllm-default-threads": {"kind": "vllm", "weights": "fp32", "default_threads": True},
    "vllm-no-preload": {"kind": "vllm", "weights": "fp32", "no_preload": True},
    "llama-f32-nocache": {"kind": "llama", "weights": "f32", "extra_args": ["--no-cache-prompt"]},
    "llama-bf16": {"kind": "llama", "weights": "bf16"},
    "ours-bf16": {"kind": "ours", "weights": "bf16"},
    # our weight formats (model/linear.py) beside llama.cpp's of the same bits: int8 vs q8_0, int4 vs q4_0
    "ours-eager": {"kind": "ours", "weights": "fp32", "extra_args": ["--compile", "off"]},  # the default: auto
    # the compiled decode step kept whatever its timing (auto keeps it where faster: engine/compile_gate.py)
    "ours-compiled": {"kind": "ours", "weights": "fp32", "extra_args": ["--compile", "on"]},
    # the KV cache in bf16 (half the memory), attended through compiled loops (model/decode_attention.py)
    "ours-kv-bf16": {"kind": "ours", "weights": "fp32", "extra_args": ["--kv-cache-dtype", "bf16"]},
    "ours-int8": {"kind": "ours", "weights": "fp32", "quantize": "int8"},
    "ours-int4": {"kind": "ours", "weights": "fp32", "quantize": "int4"},
    # the same formats with the decode step eager / compiled whatever its timing (auto compiles int4, and int8 where
    # the CPU has int8 dot products, and keeps the step where faster: their steps compute eager's bits,
    # engine/compiled_decode.py `Step.exact`)
    "ours-int8-compiled": {"kind": "ours", "weights": "fp32", "quantize": "int8", "extra_args": ["--compile", "on"]},
    "ours-int4-compiled": {"kind": "ours", "weights": "fp32", "quantize": "int4", "extra_args": ["--compile", "on"]},
    "ours-int8-eager": {"kind": "ours", "weights": "fp32", "quantize": "int8", "extra_args": ["--compile", "off"]},
    "ours-int4-eager": {"kind": "ours", "weights": "fp32", "quantize": "int4", "extra_args": ["--compile", "off"]},
    # int8 weights and a bf16 KV cache: the smallest server (its step compiled by default: the quantized steps compute
    # eager's bits, so the 16-bit cache's rounding of keys is the same in both). Since 2026-12-07 ours-int8's own
    # cache on a CPU (engine.build.resolve_kv_dtype); the fp32 cache beside quantized weights is ours-int*-kv-fp32
    "ours-int8-kv-bf16": {"kind": "ours", "weights": "fp32", "quantize": "int8",
                          "extra_args": ["--kv-cache-dtype", "bf16"]},
    "ours-int8-kv-fp32": {"kind": "ours", "weights": "fp32", "quantize": "int8",
                          "extra_args": ["--kv-cache-dtype", "fp32"]},
    "ours-int4-kv-fp32": {"kind": "ours", "weights": "fp32", "quantize": "int4",
                          "extra_args": ["--kv-cache-dtype", "fp32"]},
}
DEFAULT_SERVERS = "ours,vllm,llama-f32,llama-f16,llama-q8_0"
FP32_SERVERS = ("ours", "ours-eager", "vllm", "llama-f32", "vllm-default-threads", "vllm-no-preload",
                "llama-f32-nocache")

# name → streams, prompt kind, sampling. Prompts are token ids (no tokenizer difference can creep in):
# "fixed" = one 32-token prompt sent repeatedly (what TTFT of the table used), "long" = distinct
# 512-token prompts (no cache can hide the prefill), "prefix" = one shared 480-token prefix + distinct
# 32-token tails (what a prefix cache saves). Sampled requests send top_k -1, top_p 1, min_p 0 so that every
# server samples from the full distribution (llama-server's defaults truncate: top_k 40, min_p 0.05).
WORKLOADS: dict[str, dict[str, Any]] = {
    "b1": {"streams": 1, "prompt": "fixed", "temperature": 0.0, "what": "batch-1 greedy: decode tok/s, TTFT"},
    "s16": {"streams": 16, "prompt": "fixed", "temperature": 1.0, "what": "16 sampled streams (T=1, seeds)"},
    "s64": {"streams": 64, "prompt": "fixed", "temperature": 0.8, "what": "64 sampled streams (T=0.8, seeds)"},
    "long512": {"streams": 1, "prompt": "long", "temperature": 0.0, "what": "TTFT, distinct 512-token prompts"},
    "prefix": {"streams": 1, "prompt": "prefix", "temperature": 0.0,
               "what": "TTFT, 480-token shared prefix + distinct 32-token tails"},
}
DEFAULT_WORKLOADS = ",".join(WORKLOADS)
TTFT_WORKLOADS = ("long512", "prefix")


# ---------------------------------------------------------------- pure helpers (tested in tests/test_bench_peers.py)

def parse_list(arg: str, known: dict[str, Any], what: str) -> list[str]:
    """`a,b` → names, refusing unknown ones with the list of known ones (order kept, duplicates dropped)."""
    names = list(dict.fromkeys(x.strip() for x in arg.split(",") if x.strip()))
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown {what} {unknown}; choose from {list(known)}")
    if not names:
        raise SystemExit(f"no {what} given")
    return names


def prompt_ids(kind: str, index: int, seed: int = 0) -> list[int]:
    """Deterministic random token ids (never <|endoftext|>): `fixed` 32 tokens (the same for every index),
    `long` 512 tokens distinct per index, `prefix` a shared 480-token prefix + a 32-token tail distinct per index."""
    def ids(n: int, s: int) -> list[int]:
        rng = random.Random(s)
        return [rng.randrange(EOT) for _ in range(n)]

    if kind == "fixed":
        return ids(32, seed * 1000 + 1)
    if kind == "long":
        return ids(512, seed * 1000 + 100 + index)
    if kind == "prefix":
        return ids(480, seed * 1000 + 2) + ids(32, seed * 1000 + 500 + index)
    raise ValueError(f"unknown prompt kind {kind!r}")


def completion_body(prompt: list[int], max_tokens: int, temperature: float, seed: int | None) -> dict[str, Any]:
    """The one OpenAI /v1/completions streaming request every server gets."""
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": temperature}
    if temperature > 0:
        body.update({"top_p": 1.0, "top_k": -1, "min_p": 0.0})
        if seed is not None:
            body["seed"] = seed
    return body


def chunk_info(data: bytes) -> dict[str, Any]:
    """What one OpenAI streaming chunk says: whether it carries a token, its usage, its finish reason, an error."""
    obj = json.loads(data)
    if "error" in obj and obj["error"]:
        err = obj["error"]
        return {"token": False, "error": err.get("message", str(err)) if isinstance(err, dict) else str(err)}
    choices = obj.get("choices") or []
    usage = obj.get("usage") or None
    # a chunk with empty text that only ends the stream (llama-server sends one after the last token) is no token
    token = any(c.get("text") is not None and (c["text"] != "" or not c.get("finish_reason")) for c in choices)
    return {"token": token,
            "completion_tokens": usage.get("completion_tokens") if usage else None,
            "finish_reason": next((c.get("finish_reason") for c in choices if c.get("finish_reason")), None)}


def percentile(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile of xs (None for no data)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def summarize(workload: str, reqs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Per-workload numbers from the client's request records (times in s from each request's send)."""
    ok = [r for r in reqs if r["error"] is None and r["times"]]
    ntok = [r["completion_tokens"] if r["completion_tokens"] is not None else len(r["times"]) for r in ok]
    ttft = [r["times"][0] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    decode = [(n - 1) / (r["times"][-1] - r["times"][0]) for r, n in zip(ok, ntok)
              if n > 1 and r["times"][-1] > r["times"][0]]
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    out: dict[str, Any] = {
        "requests": len(reqs), "errors": len(reqs) - len(ok),
        "error_examples": sorted({str(r["error"]) for r in reqs if r["error"]})[:3],
        "generated_tokens": sum(ntok), "wall_s": round(wall, 3),
        "tok_s": round(sum(ntok) / wall, 2) if wall > 0 else None,
        "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p90": ms(percentile(ttft, 90)),
        "ttft_ms_p99": ms(percentile(ttft, 99)), "ttft_ms_all": [ms(x) for x in ttft] if len(ttft) <= 16 else None,
        "itl_ms_p50": ms(percentile(itl, 50)), "itl_ms_p99": ms(percentile(itl, 99)),
        "decode_tok_s_p50": round(median(decode), 2) if decode else None,
        "tokens_per_request_min": min(ntok, default=0),
        # tokens counted from the usage chunk where the server sends one, else stream events
        "token_count_from_usage": all(r["completion_tokens"] is not None for r in ok) if ok else None,
        "events_per_token": round(sum(len(r["times"]) for r in ok) / sum(ntok), 3) if sum(ntok) else None,
    }
    return out


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts at the shorter's end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def lscpu_info() -> dict[str, Any]:
    """lscpu's model name, counts and flags (a list), or the error."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}
    info: dict[str, Any] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "Flags":
            info["flags"] = value.split()
        elif key in ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
                     "L1d cache", "L2 cache", "L3 cache", "Hypervisor vendor", "NUMA node(s)"):
            info[key] = value
    return info


def server_command(name: str, port: int, threads: int, paths: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of server `name` on 127.0.0.1:port with the given threads.

    `paths`: python (ours), checkpoint, vllm_python, export_dir, llama_server, gguf {weights: path}."""
    spec = SERVERS[name]
    host = "127.0.0.1"
    if spec["kind"] == "ours":
        slots = [] if paths.get("ours_default_slots") else ["--max-batch-size", str(SLOTS)]
        return ([paths["python"], "-m", "app", "--checkpoint", str(paths["checkpoint"]), "--host", host,
                 "--port", str(port), "--device", "cpu", "--dtype", spec["weights"], *slots,
                 "--max-queue", "1000", "--torch-threads", str(threads), "--model-name", MODEL_NAME,
                 "--log-level", "warning", *(["--quantize", spec["quantize"]] if "quantize" in spec else []),
                 *spec.get("extra_args", [])], {})
    if spec["kind"] == "vllm":
        env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               # KV cache for SLOTS full contexts, fp32: 2 (k, v) × 12 layers × 768 × 4 B × 1024 × 32 = 2.4 GB
               "VLLM_CPU_KVCACHE_SPACE": "3"}
        if not spec.get("default_threads"):
            # vLLM's CPU docs: bind the OpenMP threads to cores; by default it leaves one core to the server
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        if paths.get("vllm_preload") and not spec.get("no_preload"):
            # vLLM's CPU docs: LD_PRELOAD tcmalloc and Intel's OpenMP (its worker warns without them)
            env["LD_PRELOAD"] = ":".join(paths["vllm_preload"])
        return ([paths["vllm_python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(paths["export_dir"]),
                 "--served-model-name", MODEL_NAME, "--host", host, "--port", str(port), "--dtype", "float32",
                 "--max-model-len", str(CONTEXT), "--max-num-seqs", str(SLOTS), "--uvicorn-log-level", "warning"],
                env)
    if spec["kind"] == "llama":
        return ([str(paths["llama_server"]), "-m", str(paths["gguf"][spec["weights"]]), "--host", host,
                 "--port", str(port), "-t", str(threads), "-tb", str(threads), "-c", str(CONTEXT * SLOTS),
                 "-np", str(SLOTS), "--alias", MODEL_NAME, "--no-webui", *spec.get("extra_args", [])], {})
    raise ValueError(spec["kind"])


# ---------------------------------------------------------------- the client (bench.harness' SSE client)

async def stream_request(host: str, port: int, body: dict[str, Any], timeout: float,
                         path: str = "/v1/completions") -> dict[str, Any]:
    """One streaming POST on its own connection; event times (s since send) of the chunks carrying a token."""
    times: list[float] = []
    rec: dict[str, Any] = {"times": times, "completion_tokens": None, "error": None, "finish_reason": None}

    def on_data(now: float, data: bytes) -> None:
        info = chunk_info(data)
        if info.get("error"):
            rec["error"] = f"error event: {info['error']}"
        if info.get("token"):
            times.append(now)
        if info.get("completion_tokens") is not None:
            rec["completion_tokens"] = info["completion_tokens"]
        if info.get("finish_reason"):
            rec["finish_reason"] = info["finish_reason"]

    sent = await SSEConnection(host, port, keep_alive=False).post_stream(path, body, timeout, on_data)
    if sent["error"]:  # the HTTP status, or the request failed
        rec["error"] = sent["error"]
    return rec


async def run_workload(url: str, workload: str, new_tokens: int, requests: int, timeout: float,
                       budget_s: float, seed_base: int = 0) -> dict[str, Any]:
    """One workload against url: `streams` concurrent clients, each sending its requests one after another
    (b1 and the TTFT workloads: 1 client, `requests` requests; s16/s64: one request per stream)."""
    w = WORKLOADS[workload]
    p = urlparse(url)
    ttft_only = workload in TTFT_WORKLOADS
    max_tokens = 4 if ttft_only else new_tokens
    per_stream = requests if w["streams"] == 1 else 1
    if w["prompt"] == "prefix":  # one untimed request puts the shared prefix in whatever cache the server has
        await stream_request(p.hostname, p.port, completion_body(prompt_ids("prefix", 10_000), 1, 0.0, None), timeout)
    t_start = time.perf_counter()

    async def client(i: int) -> list[dict[str, Any]]:
        out = []
        for k in range(per_stream):
            if out and time.perf_counter() - t_start > budget_s:
                break
            idx = seed_base + i * per_stream + k
            body = completion_body(prompt_ids(w["prompt"], idx), max_tokens, w["temperature"], seed=idx)
            out.append(await stream_request(p.hostname, p.port, body, timeout))
        return out

    reqs = [r for rs in await asyncio.gather(*(client(i) for i in range(w["streams"]))) for r in rs]
    res = summarize(workload, reqs, time.perf_counter() - t_start)
    res.update({"streams": w["streams"], "max_tokens": max_tokens, "temperature": w["temperature"],
                "prompt_tokens": len(prompt_ids(w["prompt"], 0)),
                "short_requests": sum(1 for r in reqs if r["error"] is None and r["finish_reason"] == "stop")})
    return res

# ---------------------------------------------------------------- greedy equality

def greedy_ids(kind: str, url: str, prompt: list[int], text: str, n: int, timeout: float) -> list[int]:
    """Greedy token ids of n new tokens, through the server's own API: ours TGI /generate with details (it takes
    text: `text` encodes to `prompt` with our tokenizer), vLLM /v1/completions with return_token_ids,
    llama-server /completion with return_tokens."""
    import httpx

    if kind == "ours":
        r = httpx.post(url + "/generate", json={"inputs": text, "parameters": {
            "max_new_tokens": n, "do_sample": False, "details": True}}, timeout=timeout)
        r.raise_for_status()
        return [t["id"] for t in r.json()["details"]["tokens"]]
    if kind == "vllm":
        r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": n,
                                                      "temperature": 0.0, "return_token_ids": True}, timeout=timeout)
        r.raise_for_status()
        return list(r.json()["choices"][0]["token_ids"])
    if kind == "llama":
        r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0.0,
                                                  "return_tokens": True, "cache_prompt": False}, timeout=timeout)
        r.raise_for_status()
        return list(r.json()["tokens"])
    raise ValueError(kind)


EQUALITY_TEXT = ("The service had been running for three days when the first request for a longer story arrived, "
                 "and the operators, who had expected nothing of the kind, gathered around the single screen to watch")


class MarginModel:
    """Our model in this process, to explain a mismatch: logits at the first differing position."""

    def __init__(self, checkpoint: Path) -> None:
        from model.checkpoint import load_checkpoint

        self.ck = load_checkpoint(checkpoint)

    def margin(self, prompt: list[int], ours: list[int], peer: list[int], pos: int) -> dict[str, Any]:
        import torch

        ctx = prompt + ours[:pos]
        with torch.inference_mode():
            logits = self.ck.model(torch.tensor([ctx]))[0][0, -1].float()
        top = torch.topk(logits, 2)
        out = {"position": pos, "top1": int(top.indices[0]), "top2": int(top.indices[1]),
               "top1_minus_top2": round(float(top.values[0] - top.values[1]), 6)}
        if pos < len(ours):
            out["ours_token"], out["ours_logit"] = ours[pos], round(float(logits[ours[pos]]), 6)
        if pos < len(peer):
            out["peer_token"], out["peer_logit"] = peer[pos], round(float(logits[peer[pos]]), 6)
            if pos < len(ours):
                out["ours_minus_peer_logit"] = round(out["ours_logit"] - out["peer_logit"], 6)
        return out


def equality_prompt(checkpoint: Path) -> list[int]:
    from model.checkpoint import load_checkpoint  # noqa: F401 (import check)
    from model.tokenizer import load_tokenizer

    tok = load_tokenizer(json.loads((checkpoint / "tokenizer.json").read_text()), checkpoint)
    return tok.encode(EQUALITY_TEXT)


# ---------------------------------------------------------------- the run

def run_server_round(name: str, server: Server, workloads: list[str], args, eq_needed: bool,
                     eq_prompt: list[int]) -> tuple[dict[str, Any], list[int] | None, str | None]:
    """Start, measure, drive and stop one server. Returns (round record, greedy ids or None, error of greedy)."""
    rec: dict[str, Any] = {"port": server.port}
    ids, eq_err = None, None
    server.start()
    try:
        rec["startup_s"] = round(server.wait_ready(args.server_timeout_s), 2)
        rec["compile_wait_s"] = server.compile_wait_s
        t = time.perf_counter()
        warm = asyncio.run(stream_request("127.0.0.1", server.port, completion_body(prompt_ids("fixed", 0), 8, 0.0,
                                                                                   None), args.request_timeout_s))
        rec["first_request_s"] = round(time.perf_counter() - t, 3)
        if warm["error"]:
            raise RuntimeError(f"warm-up request failed: {warm['error']}")
        time.sleep(2)  # let the allocator settle
        server.remember_family()
        rec["idle_memory"] = tree_memory_mb(server.proc.pid)
        if eq_needed:
            try:
                ids = greedy_ids(SERVERS[name]["kind"], server.url, eq_prompt, EQUALITY_TEXT, args.equality_tokens,
                                 args.request_timeout_s)
            except Exception as e:  # noqa: BLE001
                eq_err = f"{type(e).__name__}: {e}"
        rec["workloads"] = {}
        for wl in workloads:
            requests = args.b1_requests if wl == "b1" else args.ttft_requests
            res = asyncio.run(run_workload(server.url, wl, args.new_tokens, requests, args.request_timeout_s,
                                           args.workload_budget_s))
            res["loadavg"] = round(os.getloadavg()[0], 2)
            rec["workloads"][wl] = res
            print(f"  {name:12s} {wl:8s} tok/s {res['tok_s']}  decode {res['decode_tok_s_p50']}  TTFT p50 "
                  f"{res['ttft_ms_p50']} p99 {res['ttft_ms_p99']} ms  errors {res['errors']}  load {res['loadavg']}",
                  flush=True)
        rec["memory_after"] = tree_memory_mb(server.proc.pid)  # peak_rss_mb: the most it held, workloads included
    except Exception as e:  # noqa: BLE001 - a failed server round is recorded, the others run
        rec["error"] = f"{type(e).__name__}: {e}"
        print(f"  {name}: FAILED: {rec['error'][-500:]}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rec, ids, eq_err


# kind → (extra arguments, why) for a server that dies with SIGSEGV during start-up
CRASH_FALLBACKS = {
    "llama": (["--no-repack"], "llama-server's AMX path (ggml_backend_amx_mul_mat, used for q8_0 weights on CPUs with "
              "amx_int8, as the team's VM) segfaults at warm-up; --no-repack keeps the weights out of it"),
}


def crash_fallback(name: str, rec: dict[str, Any], argv: list[str]) -> list[str] | None:
    """The fallback arguments for a server whose start-up ended in SIGSEGV, unless it already has them."""
    fb = CRASH_FALLBACKS.get(SERVERS[name]["kind"])
    if fb and "exited with -11 during start-up" in rec.get("error", "") and not set(fb[0]) <= set(argv):
        return list(fb[0])
    return None


KEY_METRICS = {  # workload → (metric, higher is better)
    "b1": [("decode_tok_s_p50", True), ("ttft_ms_p50", False)],
    "s16": [("tok_s", True), ("ttft_ms_p50", False)],
    "s64": [("tok_s", True), ("ttft_ms_p50", False)],
    "long512": [("ttft_ms_p50", False)],
    "prefix": [("ttft_ms_p50", False)],
}


def server_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric: the median over rounds and the range (min, max), plus start-up and idle memory."""
    ok = [r for r in rounds if "error" not in r]
    out: dict[str, Any] = {"rounds_ok": len(ok), "rounds_failed": len(rounds) - len(ok)}
    for key in ("startup_s", "first_request_s"):
        vals = [r[key] for r in rounds if r.get(key) is not None]
        if vals:
            out[key] = {"median": round(median(vals), 2), "range": [min(vals), max(vals)]}
    for key in ("rss_mb", "pss_mb"):
        vals = [r["idle_memory"][key] for r in rounds if r.get("idle_memory")]
        if vals:
            out[f"idle_{key}"] = round(median(vals), 1)
    for wl, metrics in KEY_METRICS.items():
        for m, _ in metrics:
            vals = [r["workloads"][wl][m] for r in ok if wl in r.get("workloads", {})
                    and r["workloads"][wl].get(m) is not None]
            if vals:
                out[f"{wl}.{m}"] = {"median": round(median(vals), 2), "range": [min(vals), max(vals)]}
    return out


def ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """ours ÷ each peer per key metric, oriented so that > 1 means ours is better."""
    ours = summaries.get("ours") or {}
    out: dict[str, dict[str, float]] = {}
    for peer, s in summaries.items():
        if peer == "ours":
            continue
        r = {}
        for wl, metrics in KEY_METRICS.items():
            for m, higher in metrics:
                a, b = (ours.get(f"{wl}.{m}") or {}).get("median"), (s.get(f"{wl}.{m}") or {}).get("median")
                if a and b:
                    r[f"{wl}.{m}"] = round(a / b if higher else b / a, 3)
        out[peer] = r
    return out


# issue 17's goals, at equal precision (fp32): (metric, higher is better, peers compared, target ratio)
GOALS = {
    "16 streams tok/s vs the better fp32 peer": ("s16.tok_s", True, ("vllm", "llama-f32"), 1.0),
    "64 streams tok/s vs the better fp32 peer": ("s64.tok_s", True, ("vllm", "llama-f32"), 1.0),
    "TTFT of distinct 512-token prompts vs the better fp32 peer": ("long512.ttft_ms_p50", False,
                                                                   ("vllm", "llama-f32"), 1.0),
    "batch-1 decode tok/s vs llama-server f32": ("b1.decode_tok_s_p50", True, ("llama-f32",), 0.9),
}


def goals(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each goal: ours, the better of the peers measured, their ratio (> 1: ours better) and whether it is met."""
    out: dict[str, Any] = {}
    for goal, (metric, higher, names, target) in GOALS.items():
        ours = ((summaries.get("ours") or {}).get(metric) or {}).get("median")
        peers_ = {n: ((summaries.get(n) or {}).get(metric) or {}).get("median") for n in names}
        peers_ = {n: v for n, v in peers_.items() if v}
        if not ours or not peers_:
            continue
        best = (max if higher else min)(peers_, key=peers_.get)
        ratio = ours / peers_[best] if higher else peers_[best] / ours
        out[goal] = {"metric": metric, "ours": ours, "peer": best, "peer_value": peers_[best],
                     "ratio": round(ratio, 3), "target": target, "met": ratio >= target}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default=DEFAULT_SERVERS, help=f"comma-separated subset of {list(SERVERS)}")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"comma-separated subset of {list(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the server order is reversed on odd rounds")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per request of b1/s16/s64")
    ap.add_argument("--b1-requests", type=int, default=3, help="sequential requests of the batch-1 workload")
    ap.add_argument("--ttft-requests", type=int, default=4, help="sequential requests of long512 and prefix")
    ap.add_argument("--equality-tokens", type=int, default=128, help="greedy tokens compared with ours (0: skip)")
    ap.add_argument("--threads", type=int, default=None, help="threads of every server (default min(2, cores))")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the random GPT-2 124M of bench/common.py")
    ap.add_argument("--peers-dir", type=Path, default=CACHE / "peers", help="where the peers are set up")
    ap.add_argument("--torch-version", default=os.environ.get("TORCH_VERSION", TORCH_VERSION))
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    ap.add_argument("--setup-only", action="store_true", help="set up the peers and exit")
    ap.add_argument("--server-timeout-s", type=float, default=300.0, help="start-up limit per server")
    ap.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request client limit")
    ap.add_argument("--workload-budget-s", type=float, default=120.0, help="no new request after this per workload")
    ap.add_argument("--out", default="peers", help="result name: bench/results/<out>.json")
    ap.add_argument("--ours-default-slots", action="store_true",
                    help="our servers size their KV cache themselves (GPT_KV_CACHE_MEMORY's default budget) instead "
                         f"of --max-batch-size {SLOTS}: a model too large for {SLOTS} full-length slots")
    args = ap.parse_args(argv)
    servers = parse_list(args.servers, SERVERS, "servers")
    workloads = parse_list(args.workloads, WORKLOADS, "workloads")
    if args.new_tokens + 32 > CONTEXT or args.rounds < 1:
        raise SystemExit("--new-tokens must leave room for the 32-token prompt in 1024; --rounds >= 1")
    threads = set_threads(args.threads)

    checkpoint = args.checkpoint
    if checkpoint is None:
        _, checkpoint = random_gpt2()
    checkpoint = checkpoint.resolve()
    args.peers_dir.mkdir(parents=True, exist_ok=True)
    t_setup = time.monotonic()
    setup, paths, unavailable = setup_peers({s: SERVERS[s] for s in servers}, checkpoint, args.peers_dir,
                                            args.torch_version, args.jobs)
    paths["ours_default_slots"] = args.ours_default_slots
    setup_s = round(time.monotonic() - t_setup, 1)
    if args.setup_only:
        print(json.dumps({"setup": setup, "unavailable": unavailable, "seconds": setup_s}, indent=2))
        return 1 if unavailable else 0

    info = env_info()
    compile_bytecode()  # our start timed as installed, not compiling its modules from source
    eq_prompt = equality_prompt(checkpoint) if args.equality_tokens > 0 else []
    logs = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    runnable = [s for s in servers if s not in unavailable]
    results: dict[str, dict[str, Any]] = {s: {**SERVERS[s], "rounds": []} for s in servers}
    for s, why in unavailable.items():
        results[s]["setup_error"] = why
    greedy: dict[str, Any] = {}
    fallback_args: dict[str, list[str]] = {}
    print(f"servers {runnable} (unavailable: {list(unavailable) or 'none'}), workloads {workloads}, "
          f"{args.rounds} round(s), {threads} threads; logs in {logs}", flush=True)
    for rnd in range(args.rounds):
        order = runnable if rnd % 2 == 0 else runnable[::-1]
        print(f"round {rnd + 1}/{args.rounds}: {order}", flush=True)
        for name in order:
            port = free_port()
            argv_, env = server_command(name, port, threads, paths)
            argv_ += fallback_args.get(name, [])
            server = Server(name, argv_, env, logs / f"{name}.log", port)
            results[name]["command"], results[name]["env"] = argv_, env
            eq_needed = args.equality_tokens > 0 and name not in greedy
            rec, ids, eq_err = run_server_round(name, server, workloads, args, eq_needed, eq_prompt)
            fallback = crash_fallback(name, rec, argv_)
            if fallback:  # start it once more with the fallback, and keep that for the later rounds
                fallback_args[name] = fallback
                results[name]["fallback"] = {"args": fallback, "first_error": rec["error"][-800:],
                                             "why": CRASH_FALLBACKS[SERVERS[name]["kind"]][1]}
                print(f"  {name}: crashed at start-up; again with {fallback}", flush=True)
                port = free_port()
                argv_ = server_command(name, port, threads, paths)[0] + fallback
                server = Server(name, argv_, env, logs / f"{name}.log", port)
                results[name]["command"] = argv_
                rec, ids, eq_err = run_server_round(name, server, workloads, args, eq_needed, eq_prompt)
                rec["fallback"] = fallback
            rec["round"] = rnd + 1
            results[name]["rounds"].append(rec)
            if eq_needed and (ids is not None or eq_err):
                greedy[name] = {"ids": ids, "error": eq_err}

    # greedy equality with ours (fp32 servers must equal; f16/q8_0 are reported, not expected to)
    equality: dict[str, Any] = {}
    ours_ids = (greedy.get("ours") or {}).get("ids")
    margin_model = None
    for name, g in greedy.items():
        if name == "ours":
            continue
        e: dict[str, Any] = {"expected_equal": name in FP32_SERVERS, "tokens": args.equality_tokens}
        if g["error"] or ours_ids is None:
            e["error"] = g["error"] or f"no greedy tokens from ours: {(greedy.get('ours') or {}).get('error')}"
        else:
            pos = first_mismatch(ours_ids, g["ids"])
            e.update({"equal": pos is None, "matching_prefix": len(ours_ids) if pos is None else pos,
                      "ours_len": len(ours_ids), "peer_len": len(g["ids"])})
            if pos is not None:
                e["ours_from_mismatch"], e["peer_from_mismatch"] = ours_ids[pos:pos + 8], g["ids"][pos:pos + 8]
                try:
                    margin_model = margin_model or MarginModel(checkpoint)
                    e["margin"] = margin_model.margin(eq_prompt, ours_ids, g["ids"], pos)
                except Exception as ex:  # noqa: BLE001
                    e["margin_error"] = f"{type(ex).__name__}: {ex}"
        equality[name] = e
        print(f"greedy equality {name} vs ours: {json.dumps({k: v for k, v in e.items() if k != 'margin'})}"
              + (f" margin {e['margin']}" if "margin" in e else ""), flush=True)

    summaries = {s: server_summary(results[s]["rounds"]) for s in servers if results[s]["rounds"]}
    for s, summ in summaries.items():
        results[s]["summary"] = summ
    rat = ratios(summaries)
    goal = goals(summaries)
    table = []
    for s in servers:
        summ = summaries.get(s, {})

        def get(k: str, summ: dict[str, Any] = summ) -> Any:
            return (summ.get(k) or {}).get("median", "")
        eq = equality.get(s, {})
        table.append([s, SERVERS[s]["weights"], get("b1.decode_tok_s_p50"), get("b1.ttft_ms_p50"), get("s16.tok_s"),
                      get("s64.tok_s"), get("long512.ttft_ms_p50"), get("prefix.ttft_ms_p50"),
                      (summ.get("startup_s") or {}).get("median", ""), summ.get("idle_pss_mb", ""),
                      "ref" if s == "ours" else (f"{eq.get('matching_prefix')}/{eq.get('ours_len')}"
                                                 if "matching_prefix" in eq else eq.get("error", "")[:30]),
                      results[s].get("setup_error", "")[:40] or (f"{summ.get('rounds_failed')} failed"
                                                                  if summ.get("rounds_failed") else "ok")])
    print()
    print_table(["server", "weights", "b1 decode tok/s", "b1 TTFT ms", "s16 tok/s", "s64 tok/s", "TTFT 512 ms",
                 "TTFT prefix ms", "start s", "idle PSS MB", "greedy = ours", "status"], table)
    print(json.dumps(rat))
    for g, v in goal.items():
        print(f"goal: {g}: ours {v['ours']} vs {v['peer']} {v['peer_value']} = {v['ratio']} (target {v['target']}, "
              f"{'met' if v['met'] else 'not met'})")
    data = {**info, "benchmark": "peers", "lscpu": lscpu_info(), "checkpoint": str(checkpoint), "threads": threads,
            "context": CONTEXT, "slots": SLOTS, "rounds": args.rounds, "new_tokens": args.new_tokens,
            "b1_requests": args.b1_requests, "ttft_requests": args.ttft_requests,
            "workloads": {w: WORKLOADS[w] for w in workloads}, "peers_dir": str(args.peers_dir),
            "setup": setup, "setup_s": setup_s, "servers": results, "greedy_equality": equality,
            "greedy_prompt": {"text": EQUALITY_TEXT, "ids": eq_prompt}, "ratios_ours_vs_peer": rat, "goals": goal}
    path = write_result(args.out, data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
