"""Server load benchmark: concurrent SSE streams against `/generate_stream`, batched vs unbatched vs defaults.

    python -m bench.serve [--checkpoint DIR] [--levels 1,4,8,16,32] [--max-new-tokens 64] [--requests 2]
                          [--workloads greedy,sampled]
    python -m bench.serve --url http://127.0.0.1:8000 --no-baseline   # against a server you started

By default it starts three servers on 127.0.0.1 (free ports) from the same checkpoint (default: the
random GPT-2 124M of bench.decode): one with continuous batching sized for the load
(GPT_MAX_BATCH_SIZE = the highest level), one with the app's default settings (no GPT_MAX_BATCH_SIZE:
what a user who just runs `python -m app` gets) and one with batching disabled (GPT_MAX_BATCH_SIZE=1);
all with GPT_TORCH_THREADS = --threads. Greedy requests go to every server; the sampled workloads
(`sampled`: temperature 0.8 and a seed per request; `top_p`: temperature 0.8, top_p 0.95, seed) go to
the default-settings server. For each concurrency level the runs go back to back, the order
alternating (so other load on a shared machine hits all alike): N client streams each send
`--requests` requests one after another (same fixed prompt, `--max-new-tokens` each), no new request
starting after `--level-budget-s`. Reported per level: aggregate generated tokens/s (all tokens ÷ wall
time of the level), time to first token p50/p99 (from sending the request to the first token event),
inter-token latency p50/p99 (gaps between token events of a stream), errors. Beside the level-1 runs it
times the in-process library loop (`engine.generate.generate`, batch 1, greedy, same prompt and new
tokens), so one HTTP stream can be compared with the loop it wraps; and it times transformers'
offline `generate` at batch 8 (same prompt length and new tokens), as the throughput to beat.

Writes bench/results/serve.json and bench/results/serve.png. Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from bench.harness import Server, SSEConnection, app_server

# name → the TGI `parameters` of a request (a per-request seed is added to the sampled ones) and the
# equivalent SamplingParams of the library loop
WORKLOADS: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "sampled": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
}

PROMPT = ("The service had been running for three days when the first request for a longer story arrived, "
          "and the operators, who had expected nothing of the kind, gathered around the single screen to watch")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise SystemExit(f"refusing to load-test {host!r}: only loopback addresses (127.0.0.0/8, ::1, localhost)")


def tgi_parameters(workload: str, max_new: int, seed: int) -> dict[str, Any]:
    """TGI `parameters` of one request of `workload`; sampled workloads get `seed`."""
    params = {"max_new_tokens": max_new, **WORKLOADS[workload]}
    if workload != "greedy":
        params["seed"] = seed
    return params


def parse_workloads(arg: str) -> list[str]:
    """`--workloads a,b` → names, refusing unknown ones with the list of known ones."""
    workloads = arg.split(",")
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    return workloads


def library_params(workload: str, max_new: int, seed: int, stop_at_eos: bool = True):
    """The SamplingParams the server derives from tgi_parameters(workload, max_new, seed)."""
    from engine.params import SamplingParams

    w = WORKLOADS[workload]
    return SamplingParams(max_new_tokens=max_new, temperature=w.get("temperature", 0.0), top_p=w.get("top_p", 1.0),
                          seed=seed, stop_at_eos=stop_at_eos)


def app_default_max_batch() -> int | None:
    """The slots a server started without GPT_MAX_BATCH_SIZE uses on this (CPU) machine."""
    try:
        from engine.sizing import CPU_DEFAULT_BATCH

        return CPU_DEFAULT_BATCH
    except ImportError:
        return None


async def run_level(url: str, streams: int, requests: int, max_new: int, budget_s: float,
                    timeout: float, workload: str = "greedy", prompt: str = PROMPT) -> dict[str, Any]:
    """`streams` concurrent clients, each sending `requests` requests of `workload` one after another.

    Request k of stream i has seed i + k·streams (sampled workloads), as row i of the k-th library batch.
    """
    parsed = urlparse(url)
    t_start = time.perf_counter()

    async def stream_worker(i: int) -> list[dict[str, Any]]:
        conn = SSEConnection(parsed.hostname, parsed.port)
        done = []
        try:
            for k in range(requests):
                if done and time.perf_counter() - t_start > budget_s:
                    break
                params = tgi_parameters(workload, max_new, seed=i + k * streams)
                done.append(await conn.post_stream("/generate_stream", {"inputs": prompt, "parameters": params},
                                                   timeout))
        finally:
            conn.close()
        return done

    per_stream = await asyncio.gather(*(stream_worker(i) for i in range(streams)))
    wall = time.perf_counter() - t_start
    reqs = [r for s in per_stream for r in s]
    ok = [r for r in reqs if r["error"] is None and r["times"]]
    ttft = sorted(r["times"][0] for r in ok)
    itl = sorted(b - a for r in ok for a, b in zip(r["times"], r["times"][1:]))
    tokens = sum(len(r["times"]) for r in reqs)

    def pct(xs: list[float], p: float) -> float | None:
        return round(1000 * xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 1) if xs else None

    return {"streams": streams, "workload": workload, "requests": len(reqs), "errors": len(reqs) - len(ok),
            "error_examples": sorted({r["error"] for r in reqs if r["error"]})[:3],
            "generated_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "tokens_per_request_min": min((len(r["times"]) for r in ok), default=0),
            # requests that ended before max_new tokens (e.g. on <|endoftext|>): tok/s counts tokens received
            "short_requests": sum(len(r["times"]) < max_new for r in ok)}


def library_level(model, tokenizer, prompt_ids: list[int], batch: int, requests: int, max_new: int,
                  workload: str = "greedy", stop_at_eos: bool = True) -> dict[str, Any]:
    """The in-process loop (`engine.generate.generate`) on `batch` copies of the prompt, `requests` times
    in a row (batch k's row i has seed i + k·batch, as the server's stream i); tokens/s over the whole."""
    from engine.generate import generate

    tokens, t0 = 0, time.perf_counter()
    for k in range(requests):
        params = [library_params(workload, max_new, i + k * batch, stop_at_eos) for i in range(batch)]
        seqs = generate(model, tokenizer, [list(prompt_ids) for _ in range(batch)], params)
        tokens += sum(len(s.tokens) for s in seqs)
    wall = time.perf_counter() - t0
    return {"batch": batch, "workload": workload, "calls": requests, "generated_tokens": tokens,
            "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2)}


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


def plot(results: dict[str, list[dict[str, Any]]], hf: float | None, library: float | None, title: str,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"ttft_ms_p50": ("o-", "TTFT p50"), "ttft_ms_p99": ("o--", "TTFT p99"),
              "itl_ms_p50": ("s-", "ITL p50"), "itl_ms_p99": ("s--", "ITL p99")}
    for j, (name, rows) in enumerate(results.items()):
        x, color = [r["streams"] for r in rows], f"C{j}"
        a.plot(x, [r["tok_s"] for r in rows], "o-", color=color, label=name)
        for key, (style, _) in styles.items():  # one colour per run; the line style says which latency
            b.plot(x, [r[key] for r in rows], style, color=color, label=name if key == "ttft_ms_p50" else None)
    for style, what in styles.values():
        b.plot([], [], style, color="gray", label=what)
    if hf:
        a.axhline(hf, color="gray", ls=":", label="HF generate, offline batch 8")
    if library:
        a.plot([1], [library], "k*", markersize=10, label="library loop, batch 1")
    a.set(xlabel="concurrent streams", ylabel="generated tokens/s (aggregate)", title="Throughput", xscale="log")
    b.set(xlabel="concurrent streams", ylabel="ms", title="Latency", xscale="log", yscale="log")
    for ax in (a, b):
        ax.set_xticks([r["streams"] for r in next(iter(results.values()))])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the random GPT-2 124M of bench.decode")
    ap.add_argument("--url", default=None, help="use a running server (loopback only) instead of starting them")
    ap.add_argument("--levels", default="1,4,8,16,32", help="concurrent streams per level")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per stream and level")
    ap.add_argument("--workloads", default="greedy,sampled",
                    help=f"comma-separated subset of {list(WORKLOADS)}; greedy runs on every server, the others "
                         "on the default-settings one")
    ap.add_argument("--level-budget-s", type=float, default=45.0, help="no new requests after this (per level)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-request client timeout")
    ap.add_argument("--threads", type=int, default=2, help="GPT_TORCH_THREADS of the servers (and the library loop)")
    ap.add_argument("--no-unbatched", action="store_true", help="skip the GPT_MAX_BATCH_SIZE=1 server")
    ap.add_argument("--no-default", action="store_true",
                    help="skip the default-settings server (the sampled workloads then run on the batched one)")
    ap.add_argument("--no-library", action="store_true", help="skip the in-process library loop at batch 1")
    ap.add_argument("--no-baseline", action="store_true", help="skip timing HF's offline batch-8 generate")
    ap.add_argument("--out", default="serve", help="result name: bench/results/<out>.json and .png")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    workloads = parse_workloads(args.workloads)
    if "greedy" not in workloads:
        workloads.insert(0, "greedy")  # every server's comparison is greedy

    set_threads(args.threads)  # for the contention probe in env_info and the library loop; servers set their own
    info = env_info()
    warn_contention(info)
    hf_dir = None
    explicit_checkpoint = args.checkpoint is not None
    if args.checkpoint is None:
        hf_dir, args.checkpoint = random_gpt2()
    prompt_tokens = prompt_ids = None
    try:
        from model.checkpoint_info import read_config
        from model.tokenizer import load_tokenizer

        tok = load_tokenizer(json.loads((args.checkpoint / "tokenizer.json").read_text()), args.checkpoint)
        prompt_ids = tok.encode(PROMPT)
        prompt_tokens = len(prompt_ids)
        block = read_config(args.checkpoint).block_size
        if prompt_tokens + args.max_new_tokens > block:
            raise SystemExit(f"prompt ({prompt_tokens}) + max_new_tokens exceeds the context ({block})")
    except (OSError, ValueError, KeyError):
        pass
    # the in-process loop on the same checkpoint (with --url only when --checkpoint names the server's)
    lib_model = lib_tok = None
    if not args.no_library and (not args.url or explicit_checkpoint):
        from engine.sampler import Sampler
        from model.checkpoint import load_checkpoint

        ck = load_checkpoint(args.checkpoint)
        lib_model, lib_tok = ck.model, ck.tokenizer
        lib_model.pad_vocab(Sampler(1, lib_tok.vocab_size, 4).padded)  # the server's layout
        prompt_ids = lib_tok.encode(PROMPT)

    default_batch = app_default_max_batch()
    servers: dict[str, Server] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))  # server logs, named in any start-up error
    try:
        if args.url:
            check_loopback(args.url)
            urls = {"server": args.url}
        else:
            servers["batched"] = app_server(args.checkpoint, max(levels), args.threads, logs / "batched.log")
            if not args.no_default:
                servers["default"] = app_server(args.checkpoint, None, args.threads, logs / "default.log")
            if not args.no_unbatched:
                servers["unbatched"] = app_server(args.checkpoint, 1, args.threads, logs / "unbatched.log")
            for s in servers.values():
                s.wait_ready()
            urls = {name: s.url for name, s in servers.items()}
        # runs: (result name, server, workload): greedy on every server, the sampled workloads on the one
        # with the app's default settings (or the only/batched one)
        sampled_on = "default" if "default" in urls else next(iter(urls))
        runs = [(name, name, "greedy") for name in urls]
        runs += [(f"{sampled_on}+{w}", sampled_on, w) for w in workloads if w != "greedy"]
        for name, url in urls.items():  # warm-up request (first-request costs of the HTTP stack)
            asyncio.run(run_level(url, 1, 1, 4, 60, args.timeout_s, "sampled" if name == sampled_on else "greedy"))
        if lib_model is not None:
            library_level(lib_model, lib_tok, prompt_ids, 1, 1, 4)  # warm-up
        results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in runs}
        library: list[dict[str, Any]] = []
        for i, n in enumerate(levels):
            order: list[tuple[str, str, str] | None] = list(runs)
            if lib_model is not None and (n == 1 or (1 not in levels and i == 0)):
                order.append(None)  # the library loop, batch 1, beside this level's runs
            for run in (order if i % 2 == 0 else order[::-1]):
                if run is None:
                    res = library_level(lib_model, lib_tok, prompt_ids, 1, args.requests, args.max_new_tokens)
                    res["loadavg"] = round(os.getloadavg()[0], 2)
                    library.append(res)
                    print(f"{'library':16s}   1 stream : {res['tok_s']:7.1f} tok/s  ({res['generated_tokens']} "
                          f"tokens in {res['wall_s']} s)  load {res['loadavg']}", flush=True)
                    continue
                name, server, workload = run
                res = asyncio.run(run_level(urls[server], n, args.requests, args.max_new_tokens,
                                            args.level_budget_s, args.timeout_s, workload))
                res["loadavg"] = round(os.getloadavg()[0], 2)
                results[name].append(res)
                print(f"{name:16s} {n:3d} streams: {res['tok_s']:7.1f} tok/s  TTFT p50 {res['ttft_ms_p50']} "
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
    if "default" in results:
        df = {r["streams"]: r for r in results["default"]}
        summary["default_vs_batched"] = {n: round(df[n]["tok_s"] / by_level[n]["tok_s"], 2)
                                         for n in levels if n in df and by_level.get(n, {}).get("tok_s")}
    greedy_rows = {r["streams"]: r for r in results[sampled_on]}
    for w in workloads:
        if w != "greedy":
            summary[f"{w}_vs_greedy_{sampled_on}"] = {
                r["streams"]: round(r["tok_s"] / greedy_rows[r["streams"]]["tok_s"], 2)
                for r in results[f"{sampled_on}+{w}"] if greedy_rows.get(r["streams"], {}).get("tok_s")}
    lib_tok_s = median([r["tok_s"] for r in library]) if library else None
    if lib_tok_s:
        summary["library_batch1_tok_s"] = lib_tok_s
        summary["http_1_stream_vs_library"] = {name: round(r["tok_s"] / lib_tok_s, 3) for name, rs in results.items()
                                               for r in rs if r["streams"] == 1 and r["workload"] == "greedy"}

    table = []
    for name, rs in results.items():
        for r in rs:
            table.append([name, r["streams"], r["requests"], r["tok_s"], r["ttft_ms_p50"], r["ttft_ms_p99"],
                          r["itl_ms_p50"], r["itl_ms_p99"], r["tokens_per_request_min"], r["errors"]])
    for r in library:
        table.append(["library", 1, r["calls"], r["tok_s"], "", "", "", "", r["generated_tokens"] // r["calls"], 0])
    print()
    print_table(["run", "streams", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms", "min tokens", "errors"], table)
    print(json.dumps(summary))
    png = RESULTS / f"{args.out}.png"
    model_name = "GPT-2 124M (random)" if hf_dir is not None else args.checkpoint.name
    plot(results, hf.get("tok_s") if hf else None, lib_tok_s,
         f"{model_name} (fp32, CPU) behind `python -m app`: /generate_stream, {', '.join(workloads)}", png)
    data = {**info, "benchmark": "serve", "checkpoint": str(args.checkpoint), "threads": args.threads,
            "prompt": PROMPT, "prompt_tokens": prompt_tokens, "max_new_tokens": args.max_new_tokens,
            "requests_per_stream": args.requests, "level_budget_s": args.level_budget_s,
            "max_batch_size": {name: {"batched": max(levels), "default": default_batch, "unbatched": 1}[name]
                               for name in servers} if not args.url else None,
            "workloads": {w: WORKLOADS[w] for w in workloads}, "sampled_workloads_on": sampled_on,
            "hf_offline_batch8": hf, "library_batch1": library, "summary": summary, "levels": results}
    path = write_result(args.out, data)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
