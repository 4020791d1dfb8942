"""Server load benchmark: concurrent SSE streams against `/generate_stream`, batched vs unbatched.

    python -m bench.serve [--checkpoint DIR] [--levels 1,4,8,16,32] [--max-new-tokens 64] [--requests 2]
    python -m bench.serve --url http://127.0.0.1:8000 --no-baseline   # against a server you started

By default it starts two servers on 127.0.0.1 (free ports) from the same checkpoint (default: the
random GPT-2 124M of bench.decode): one with continuous batching (GPT_MAX_BATCH_SIZE = the highest
level) and one with batching disabled (GPT_MAX_BATCH_SIZE=1). For each concurrency level, the two
run back to back (so other load on a shared machine hits both alike): N client streams each send
`--requests` greedy requests one after another (same fixed prompt, `--max-new-tokens` each), no new
request starting after `--level-budget-s`. Reported per level: aggregate generated tokens/s (all
tokens ÷ wall time of the level), time to first token p50/p99 (from sending the request to the
first token event), inter-token latency p50/p99 (gaps between token events of a stream), errors.
It also times transformers' offline `generate` at batch 8 (same prompt length and new tokens) in
the same run, as the throughput to beat.

Writes bench/results/serve.json and bench/results/serve.png. Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench.common import (
    REPO,
    RESULTS,
    env_info,
    median,
    print_table,
    random_gpt2,
    set_threads,
    warn_contention,
    write_result,
)

PROMPT = ("The service had been running for three days when the first request for a longer story arrived, "
          "and the operators, who had expected nothing of the kind, gathered around the single screen to watch")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise SystemExit(f"refusing to load-test {host!r}: only loopback addresses (127.0.0.0/8, ::1, localhost)")


class Server:
    """`python -m app` in a subprocess on 127.0.0.1, stopped with SIGTERM (then SIGKILL) on exit."""

    def __init__(self, checkpoint: Path, max_batch: int, threads: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "GPT_MAX_BATCH_SIZE": str(max_batch), "GPT_TORCH_THREADS": str(threads),
               "GPT_LOG_LEVEL": "warning", "GPT_DEVICE": "cpu", "GPT_DTYPE": "fp32", "GPT_MAX_QUEUE": "1000"}
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
             "--port", str(self.port)], cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def one_request(client, url: str, prompt: str, max_new: int, timeout: float) -> dict[str, Any]:
    """One streamed request; token arrival times relative to the send."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new, "do_sample": False, "temperature": 0}}
    t0 = time.perf_counter()
    times: list[float] = []
    error = None
    try:
        async with client.stream("POST", url + "/generate_stream", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    ev = json.loads(line[5:])
                    if "error" in ev:
                        error = f"error event: {ev['error']}"
                        break
                    times.append(time.perf_counter() - t0)
                    if ev.get("generated_text") is not None:
                        break
    except Exception as e:  # noqa: BLE001 - any failure of a request is counted, not fatal
        error = f"{type(e).__name__}: {e}"
    return {"start": t0, "times": times, "error": error}


async def run_level(url: str, streams: int, requests: int, max_new: int, budget_s: float,
                    timeout: float) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t_start = time.perf_counter()

        async def stream_worker() -> list[dict[str, Any]]:
            done = []
            for _ in range(requests):
                if done and time.perf_counter() - t_start > budget_s:
                    break
                done.append(await one_request(client, url, PROMPT, max_new, timeout))
            return done

        per_stream = await asyncio.gather(*(stream_worker() for _ in range(streams)))
        wall = time.perf_counter() - t_start
    reqs = [r for s in per_stream for r in s]
    ok = [r for r in reqs if r["error"] is None and r["times"]]
    ttft = sorted(r["times"][0] for r in ok)
    itl = sorted(b - a for r in ok for a, b in zip(r["times"], r["times"][1:]))
    tokens = sum(len(r["times"]) for r in reqs)

    def pct(xs: list[float], p: float) -> float | None:
        return round(1000 * xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 1) if xs else None

    return {"streams": streams, "requests": len(reqs), "errors": len(reqs) - len(ok),
            "error_examples": sorted({r["error"] for r in reqs if r["error"]})[:3],
            "generated_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "tokens_per_request_min": min((len(r["times"]) for r in ok), default=0)}


def hf_batch8(hf_dir: Path, prompt_tokens: int, max_new: int, threads: int, repeats: int) -> dict[str, Any]:
    """transformers' offline generate at batch 8 (prompt of the same token length), total tokens/s, in a
    subprocess with the servers' thread count so it does not share this process's threads."""
    code = f"""
import json, time, torch
torch.set_num_threads({threads})
from transformers import GPT2LMHeadModel
m = GPT2LMHeadModel.from_pretrained({str(hf_dir)!r}).eval()
x = torch.randint(0, 50256, (8, {prompt_tokens}), generator=torch.Generator().manual_seed(0))
kw = dict(attention_mask=torch.ones_like(x), do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
out = []
with torch.inference_mode():
    m.generate(x, max_new_tokens=4, min_new_tokens=4, **kw)
    for _ in range({repeats}):
        t = time.perf_counter()
        m.generate(x, max_new_tokens={max_new}, min_new_tokens={max_new}, **kw)
        out.append(8 * {max_new} / (time.perf_counter() - t))
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        return {"error": r.stderr[-500:]}
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    return {"tok_s": round(median(runs), 2), "tok_s_all": [round(x, 2) for x in runs]}


def plot(results: dict[str, list[dict[str, Any]]], hf: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in results.items():
        x = [r["streams"] for r in rows]
        a.plot(x, [r["tok_s"] for r in rows], "o-", label=name)
        b.plot(x, [r["ttft_ms_p50"] for r in rows], "o-", label=f"{name} TTFT p50")
        b.plot(x, [r["ttft_ms_p99"] for r in rows], "o--", label=f"{name} TTFT p99")
        b.plot(x, [r["itl_ms_p50"] for r in rows], "s-", label=f"{name} ITL p50")
        b.plot(x, [r["itl_ms_p99"] for r in rows], "s--", label=f"{name} ITL p99")
    if hf:
        a.axhline(hf, color="gray", ls=":", label="HF generate, offline batch 8")
    a.set(xlabel="concurrent streams", ylabel="generated tokens/s (aggregate)", title="Throughput", xscale="log")
    b.set(xlabel="concurrent streams", ylabel="ms", title="Latency", xscale="log", yscale="log")
    for ax in (a, b):
        ax.set_xticks([r["streams"] for r in next(iter(results.values()))])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("GPT-2 124M (fp32, CPU) behind `python -m app`: /generate_stream, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the random GPT-2 124M of bench.decode")
    ap.add_argument("--url", default=None, help="use a running server (loopback only) instead of starting two")
    ap.add_argument("--levels", default="1,4,8,16,32", help="concurrent streams per level")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per stream and level")
    ap.add_argument("--level-budget-s", type=float, default=45.0, help="no new requests after this (per level)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-request client timeout")
    ap.add_argument("--threads", type=int, default=2, help="GPT_TORCH_THREADS of the servers")
    ap.add_argument("--no-unbatched", action="store_true", help="skip the GPT_MAX_BATCH_SIZE=1 server")
    ap.add_argument("--no-baseline", action="store_true", help="skip timing HF's offline batch-8 generate")
    ap.add_argument("--out", default="serve", help="result name: bench/results/<out>.json and .png")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]

    set_threads(args.threads)  # for the contention probe in env_info; the servers set their own
    info = env_info()
    warn_contention(info)
    hf_dir = None
    if args.checkpoint is None:
        hf_dir, args.checkpoint = random_gpt2()
    prompt_tokens = None
    try:
        from model.checkpoint import read_config
        from model.tokenizer import load_tokenizer

        tok = load_tokenizer(json.loads((args.checkpoint / "tokenizer.json").read_text()), args.checkpoint)
        prompt_tokens = len(tok.encode(PROMPT))
        block = read_config(args.checkpoint).block_size
        if prompt_tokens + args.max_new_tokens > block:
            raise SystemExit(f"prompt ({prompt_tokens}) + max_new_tokens exceeds the context ({block})")
    except (OSError, ValueError, KeyError):
        pass

    servers: dict[str, Server] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))  # server logs, named in any start-up error
    try:
        if args.url:
            check_loopback(args.url)
            urls = {"server": args.url}
        else:
            servers["batched"] = Server(args.checkpoint, max(levels), args.threads, logs / "batched.log")
            if not args.no_unbatched:
                servers["unbatched"] = Server(args.checkpoint, 1, args.threads, logs / "unbatched.log")
            for s in servers.values():
                s.wait_ready()
            urls = {name: s.url for name, s in servers.items()}
        for url in urls.values():  # warm-up request (first-request costs of the HTTP stack)
            asyncio.run(run_level(url, 1, 1, 4, 60, args.timeout_s))
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
        for i, n in enumerate(levels):
            order = list(urls) if i % 2 == 0 else list(urls)[::-1]
            for name in order:
                res = asyncio.run(run_level(urls[name], n, args.requests, args.max_new_tokens,
                                            args.level_budget_s, args.timeout_s))
                res["loadavg"] = round(os.getloadavg()[0], 2)
                results[name].append(res)
                print(f"{name:9s} {n:3d} streams: {res['tok_s']:7.1f} tok/s  TTFT p50 {res['ttft_ms_p50']} "
                      f"p99 {res['ttft_ms_p99']} ms  ITL p50 {res['itl_ms_p50']} p99 {res['itl_ms_p99']} ms  "
                      f"errors {res['errors']}  load {res['loadavg']}", flush=True)
    finally:
        for s in servers.values():
            s.stop()

    hf = None
    if not args.no_baseline and hf_dir is not None and prompt_tokens:
        hf = hf_batch8(hf_dir, prompt_tokens, args.max_new_tokens, args.threads, repeats=3)
        print(f"HF generate, offline batch 8: {hf.get('tok_s')} tok/s")

    summary: dict[str, Any] = {}
    main_name = "batched" if "batched" in results else next(iter(results))
    rows = results[main_name]
    by_level = {r["streams"]: r for r in rows}
    if 1 in by_level and 16 in by_level:
        summary["scaling_16_vs_1"] = round(by_level[16]["tok_s"] / by_level[1]["tok_s"], 2)
    if hf and hf.get("tok_s") and 16 in by_level:
        summary["ratio_16_streams_vs_hf_batch8"] = round(by_level[16]["tok_s"] / hf["tok_s"], 2)
    if "unbatched" in results:
        ub = {r["streams"]: r for r in results["unbatched"]}
        summary["batched_vs_unbatched"] = {n: round(by_level[n]["tok_s"] / ub[n]["tok_s"], 2)
                                           for n in levels if n in ub and ub[n]["tok_s"]}

    table = []
    for name, rs in results.items():
        for r in rs:
            table.append([name, r["streams"], r["requests"], r["tok_s"], r["ttft_ms_p50"], r["ttft_ms_p99"],
                          r["itl_ms_p50"], r["itl_ms_p99"], r["errors"]])
    print()
    print_table(["server", "streams", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms", "errors"], table)
    print(json.dumps(summary))
    png = RESULTS / f"{args.out}.png"
    plot(results, hf.get("tok_s") if hf else None, png)
    data = {**info, "benchmark": "serve", "checkpoint": str(args.checkpoint), "threads": args.threads,
            "prompt": PROMPT, "prompt_tokens": prompt_tokens, "max_new_tokens": args.max_new_tokens,
            "requests_per_stream": args.requests, "level_budget_s": args.level_budget_s,
            "max_batch_size": {"batched": max(levels), "unbatched": 1} if not args.url else None,
            "hf_offline_batch8": hf, "summary": summary, "levels": results}
    path = write_result(args.out, data)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
