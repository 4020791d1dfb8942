"""Serving-stack ceiling: a near-free GPT behind `python -m app` vs the in-process library loop.

    python -m bench.stack [--threads 2] [--levels 1,16,64] [--new-tokens 128] [--requests 1]
                          [--workloads greedy,sampled,top_p] [--repeats 1] [--no-library] [--no-sampler] [--out stack]

The model is a randomly initialised GPT with one layer, n_embd 64 and 4 heads, GPT-2's vocabulary
(50257, `r50k_base`), context 256 (`torch.manual_seed(0)`; saved once with `model.checkpoint.
save_checkpoint` under the bench cache). Its forward pass costs almost nothing beside the 64×50257
head, so what the numbers show is the cost of everything around the model: sampling, the per-token
Python of the generation loop, the engine's scheduling, detokenizing, and (for the server) the
HTTP/SSE stack. Its `<|endoftext|>` logit is pinned at -64 (see `tiny_gpt`), so every request runs to
`--new-tokens` whatever the sampling; the server has no switch to ignore EOS, so tok/s counts the
tokens actually received and `short_requests` would show any that ended early.

One server (`python -m app`, 127.0.0.1, GPT_MAX_BATCH_SIZE=64 or the highest level, GPT_TORCH_THREADS =
--threads). For each workload (greedy; `sampled`: temperature 0.8, a seed per request; `top_p`:
temperature 0.8, top_p 0.95, seed) and level N: N concurrent SSE streams to `/generate_stream`, each
sending `--requests` requests of `--new-tokens` tokens (the same ~32-token prompt), and, back to back
with it (order alternating), the library loop on the same model, workload and batch size:
`engine.generate.generate(model, tokenizer, [prompt] * N, params)` with `stop_at_eos=False`, timed
around the call. Reported per (workload, level): server and library tokens/s and their ratio, TTFT p50,
ITL p50/p99, errors, CPU seconds used by the server, the client and the library loop; then the ratios
sampled/greedy and top_p/greedy (at the highest level and at 1 stream) and server/library.

Then the model's own share, a bare decode step (`engine.generate.decode_step`) at each level's batch size,
and "the sampler alone": `engine.sampler.Sampler` on random (B, 50257) fp32 logits at
B = 1, 16, 64 for greedy, temperature 0.8, + top_p 0.95, + top_k 50 (median ms per call), interleaved
with the sampler it replaced (`sample_next` of `--baseline-rev`, loaded from git), for the speed-up.

The library loop's model gets the server's layout (`GPT.pad_vocab` to the sampler's blocks), so both
sides run the same model the same way.

Writes bench/results/stack.json and prints tables. Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    CACHE,
    REPO,
    env_info,
    median,
    print_table,
    set_threads,
    warn_contention,
    write_result,
)
from bench.harness import Server, app_server
from bench.serve import WORKLOADS, library_level, parse_workloads, run_level

PROMPT = ("The service had been running for three days when the first request for a longer story arrived, "
          "and the operators, who had expected nothing like it, gathered to watch")  # 32 tokens (r50k_base)
CONFIG = dict(vocab_size=50257, block_size=256, n_layer=1, n_head=4, n_embd=64)
MAX_BATCH = 64
SAMPLER_CONFIGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "t0.8": {"temperature": 0.8},
    "t0.8+top_p0.95": {"temperature": 0.8, "top_p": 0.95},
    "t0.8+top_k50": {"temperature": 0.8, "top_k": 50},
}


def tiny_gpt(seed: int = 0, cache: Path = CACHE) -> Path:
    """The near-free GPT (CONFIG, random init with `torch.manual_seed(seed)`), as our checkpoint; built once.

    One change to the random init so that no request ends early: ln_f's bias is 1 and the tied
    embedding row of `<|endoftext|>` is all -1. LayerNorm's normalised output sums to zero over the
    features, so that token's logit is -(n_embd · 1) = -64 for every input while the others stay
    ~N(0, 0.2): it is never the argmax and its probability is ~e^-64.
    """
    ck_dir = cache / f"stack-gpt-l1-e64-s{seed}"
    if not (ck_dir / "config.json").is_file():
        import torch

        from model.checkpoint import save_checkpoint
        from model.config import GPTConfig
        from model.gpt import GPT
        from model.tokenizer import Tokenizer

        torch.manual_seed(seed)
        model = GPT(GPTConfig(**CONFIG)).eval()
        tok = Tokenizer.named("r50k_base")
        with torch.no_grad():
            model.transformer.ln_f.bias.fill_(1.0)
            model.transformer.wte.weight[tok.eot_id] = -1.0
        save_checkpoint(ck_dir, model, tok, {"produced_by": "bench.stack.tiny_gpt", "seed": seed,
                                             "note": "random init; <|endoftext|> logit pinned at -n_embd"})
    return ck_dir


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repetitions of one measurement → one dict: numbers are medians, the rest from the first run."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs = [r[k] for r in runs if r.get(k) is not None]
            out[k] = round(median(xs), 3) if xs else None
    if len(runs) > 1:
        out["tok_s_all"] = [r["tok_s"] for r in runs]
    return out


def server_run(server: Server, n: int, args: argparse.Namespace, workload: str) -> dict[str, Any]:
    cpu_server, cpu_client = server.cpu_s(), time.process_time()
    res = asyncio.run(run_level(server.url, n, args.requests, args.new_tokens, args.level_budget_s,
                                args.timeout_s, workload, PROMPT))
    if cpu_server is not None and (after := server.cpu_s()) is not None:
        res["server_cpu_s"] = round(after - cpu_server, 2)
    res["client_cpu_s"] = round(time.process_time() - cpu_client, 2)
    res["loadavg"] = round(os.getloadavg()[0], 2)
    return res


def library_run(model, tokenizer, prompt_ids: list[int], n: int, args: argparse.Namespace,
                workload: str) -> dict[str, Any]:
    gc.collect()
    cpu = time.process_time()
    res = library_level(model, tokenizer, prompt_ids, n, args.requests, args.new_tokens, workload, stop_at_eos=False)
    res["cpu_s"] = round(time.process_time() - cpu, 2)
    res["loadavg"] = round(os.getloadavg()[0], 2)
    return res


def time_calls(fn, calls: int, warmup: int = 2) -> float:
    """Median seconds of `calls` calls of fn (after `warmup` untimed ones)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return median(ts)


def load_old_sampler(rev: str):
    """model/sampling.py as it was at git revision `rev` (the per-row-generator sampler this work replaced),
    imported under another name so both run side by side; None where git or the revision is missing."""
    import importlib.util
    import subprocess
    import tempfile

    try:
        src = subprocess.run(["git", "show", f"{rev}:model/sampling.py"], cwd=REPO, capture_output=True,
                             text=True, check=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(tempfile.mkdtemp()) / "old_sampling.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_sampling"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod if hasattr(mod, "sample_next") else None


def sampler_alone(batches: list[int], calls: int, vocab: int = CONFIG["vocab_size"],
                  baseline_rev: str | None = None) -> dict[str, Any]:
    """Median ms per call of the sampler on random (B, vocab) fp32 logits, interleaved with the sampler of
    `baseline_rev` (the old `sample_next`, one torch.Generator per row) when it can be loaded."""
    import torch

    from engine.params import SamplingParams
    from engine.sampler import Sampler

    padded = Sampler(1, vocab, 4).padded  # the served model's logits are padded to whole blocks (GPT.pad_vocab)
    g = torch.Generator().manual_seed(0)
    logits = {B: torch.randn(B, padded, generator=g) * 0.3 for B in batches}
    old = load_old_sampler(baseline_rev) if baseline_rev else None
    out: dict[str, Any] = {"vocab": vocab, "calls": calls, "configs": SAMPLER_CONFIGS, "baseline_rev": baseline_rev,
                           "baseline_loaded": old is not None}

    def ours(B: int, kw: dict[str, Any]):
        s = Sampler(B, vocab, calls + 32)
        done = [calls + 29]  # steps since admission: the token history must stay inside its calls + 32 positions

        def call():
            if done[0] >= calls + 29:
                for i in range(B):
                    s.admit(i, SamplingParams(**kw), [1, 2, 3], seed=i)
                done[0] = 0
            s.step(logits[B], range(B))
            done[0] += 1
        return call

    def baseline(B: int, kw: dict[str, Any]):
        params = [old.SamplingParams(seed=i, **kw) for i in range(B)]
        gens = [torch.Generator().manual_seed(i) for i in range(B)]
        return lambda: old.sample_next(logits[B][:, :vocab], params, gens)

    rows: dict[str, dict[str, Any]] = {}
    for name, kw in SAMPLER_CONFIGS.items():
        for B in batches:
            row: dict[str, Any] = {"config": name, "batch": B}
            for turn in range(2):  # interleaved: ours, baseline, ours, baseline
                row.setdefault("ours_ms", []).append(1000 * time_calls(ours(B, kw), calls))
                if old is not None and (B <= 16 or name == "greedy" or calls <= 10 or turn == 0):
                    row.setdefault("baseline_ms", []).append(1000 * time_calls(baseline(B, kw), max(3, calls // 4)))
            row["ours_ms"] = round(median(row["ours_ms"]), 3)
            if "baseline_ms" in row:
                row["baseline_ms"] = round(median(row["baseline_ms"]), 3)
                row["speedup"] = round(row["baseline_ms"] / row["ours_ms"], 1)
            rows[f"{name}/B{B}"] = row
    out["rows"] = rows
    return out


def model_step_alone(model, prompt_ids: list[int], batches: list[int], calls: int) -> dict[str, Any]:
    """Median ms of one bare decode step (`engine.generate.decode_step` on a KV cache filled with the prompt)
    at each batch size: the model's own share, the floor under every other number. Errors are recorded."""
    import torch

    try:
        from engine.generate import decode_step, prefill
        from model.kv_cache import KVCache
    except Exception as e:  # noqa: BLE001 - modules being rewritten must not end the benchmark
        print(f"model step alone: skipped ({type(e).__name__}: {e})")
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    out: dict[str, Any] = {}
    for B in batches:
        try:
            slots = list(range(B))
            cache = KVCache(model.config, B, len(prompt_ids) + calls + 8, dtype=torch.float32,
                            device=torch.device("cpu"))
            prefill(model, cache, slots, [list(prompt_ids)] * B)
            last = torch.zeros(B, dtype=torch.long)
            ms = 1000 * time_calls(lambda c=cache, s=slots, t=last: decode_step(model, c, s, t), calls)
            out[f"B{B}"] = {"batch": B, "ms": round(ms, 3), "tok_s": round(1000 * B / ms, 1)}
        except Exception as e:  # noqa: BLE001
            out[f"B{B}"] = {"batch": B, "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"model step alone: B={B} failed: {type(e).__name__}: {e}")
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None,
                    help="GPT_TORCH_THREADS of the server and torch threads of the library loop "
                         "(default min(2, cores))")
    ap.add_argument("--levels", default="1,16,64", help="concurrent streams (= library batch sizes)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=1, help="requests per stream (library: calls in a row)")
    ap.add_argument("--workloads", default="greedy,sampled,top_p", help=f"comma-separated subset of {list(WORKLOADS)}")
    ap.add_argument("--repeats", type=int, default=1, help="measurements per (workload, level); medians reported")
    ap.add_argument("--level-budget-s", type=float, default=120.0, help="no new requests after this (per level)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-request client timeout")
    ap.add_argument("--sampler-calls", type=int, default=20, help="timed calls per sampler configuration")
    ap.add_argument("--no-library", action="store_true", help="skip the in-process library loop")
    ap.add_argument("--no-sampler", action="store_true", help="skip timing the sampler alone")
    ap.add_argument("--baseline-rev", default="9ae5986",
                    help="git revision whose model/sampling.py (sample_next) is timed beside ours")
    ap.add_argument("--engines", default="process,thread",
                    help="server engine modes to measure side by side (GPT_ENGINE): process (the default: the core "
                         "in its own process) and thread (the core on a thread of the HTTP process)")
    ap.add_argument("--out", default="stack", help="result name: bench/results/<out>.json")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    workloads = parse_workloads(args.workloads)

    threads = set_threads(args.threads)
    info = env_info()
    warn_contention(info)
    ck_dir = tiny_gpt()
    max_batch = max(MAX_BATCH, *levels)
    logs = Path(tempfile.mkdtemp(prefix="bench-stack-"))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    # the core process keeps its default threads (every core but one per front): the settings users run
    servers = {e: app_server(ck_dir, max_batch, None if e == "process" else threads, logs / f"server-{e}.log",
                             engine=e)
               for e in engines}
    results: dict[str, list[dict[str, Any]]] = {w: [] for w in workloads}
    try:
        from model.checkpoint import load_checkpoint  # while the server starts

        ck = load_checkpoint(ck_dir)
        model, tok = ck.model, ck.tokenizer
        from engine.sampler import Sampler

        model.pad_vocab(Sampler(1, tok.vocab_size, 4).padded)  # as the server does
        prompt_ids = tok.encode(PROMPT)
        if len(prompt_ids) + args.new_tokens > ck.config.block_size:
            raise SystemExit(f"prompt ({len(prompt_ids)}) + --new-tokens exceeds the context ({ck.config.block_size})")
        for srv in servers.values():
            srv.wait_ready()
        print(f"model: {ck_dir} ({model.num_params(non_embedding=False) / 1e6:.2f}M parameters), threads "
              f"{threads}, server GPT_MAX_BATCH_SIZE={max_batch}, prompt {len(prompt_ids)} tokens, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        for w in workloads:  # warm-up (first-request costs of the HTTP stack, lazy imports, allocator)
            for srv in servers.values():
                asyncio.run(run_level(srv.url, 2, 1, 4, 60, args.timeout_s, w, PROMPT))
            if not args.no_library:
                library_level(model, tok, prompt_ids, 2, 1, 4, w, stop_at_eos=False)

        k = 0
        for w in workloads:
            for n in levels:
                runs: dict[str, list] = {e: [] for e in engines}
                l_runs = []
                for _ in range(args.repeats):
                    order = [*engines, "library"]
                    order = order[k % len(order):] + order[:k % len(order)]  # rotate: load hits all alike
                    k += 1
                    for who in order:
                        if who in servers:
                            runs[who].append(server_run(servers[who], n, args, w))
                        elif not args.no_library:
                            l_runs.append(library_run(model, tok, prompt_ids, n, args, w))
                s = merge(runs[engines[0]])
                lib = merge(l_runs) if l_runs else None
                row = {"streams": n, "server": s, "library": lib, "engine": engines[0],
                       "server_vs_library": ratio(s["tok_s"], lib and lib["tok_s"])}
                for e in engines[1:]:
                    other = merge(runs[e])
                    row[f"server_{e}"] = other
                    row[f"server_{e}_vs_library"] = ratio(other["tok_s"], lib and lib["tok_s"])
                    row[f"server_vs_server_{e}"] = ratio(s["tok_s"], other["tok_s"])
                if args.repeats > 1:
                    row["server_runs"], row["library_runs"] = runs[engines[0]], l_runs
                results[w].append(row)
                short = f"  SHORT REQUESTS {s['short_requests']}" if s.get("short_requests") else ""
                others = "  ".join(f"{e} {row[f'server_{e}']['tok_s']:8.1f}" for e in engines[1:])
                print(f"{w:8s} {n:3d} streams: server ({engines[0]}) {s['tok_s']:8.1f} tok/s  {others}  library "
                      f"{lib['tok_s'] if lib else '-':>8} tok/s  ratio {row['server_vs_library']}  TTFT p50 "
                      f"{s['ttft_ms_p50']} ms  ITL p50 {s['itl_ms_p50']} p99 {s['itl_ms_p99']} ms  errors "
                      f"{s['errors']}{short}  load {s['loadavg']}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()

    summary: dict[str, Any] = {}
    top = max(levels)
    for side in ("server", "library"):
        tok_s = {(w, r["streams"]): (r[side] or {}).get("tok_s") for w in workloads for r in results[w]}
        for w in workloads:
            if w == "greedy" or "greedy" not in workloads:
                continue
            for n in sorted({top, 1} & set(levels), reverse=True):
                if (v := ratio(tok_s.get((w, n)), tok_s.get(("greedy", n)))) is not None:
                    summary[f"{side}_{w}_vs_greedy_{n}_streams"] = v
    for w in workloads:
        for r in results[w]:
            if r["streams"] == top and r["server_vs_library"] is not None:
                summary[f"server_vs_library_{w}_{top}_streams"] = r["server_vs_library"]

    table = []
    for w in workloads:
        for r in results[w]:
            s, lib = r["server"], r["library"] or {}
            table.append([w, r["streams"], s["requests"], s["tok_s"], lib.get("tok_s", ""),
                          r["server_vs_library"] or "", s["ttft_ms_p50"], s["itl_ms_p50"], s["itl_ms_p99"],
                          s["tokens_per_request_min"], s["errors"], s.get("server_cpu_s", ""), s["client_cpu_s"],
                          lib.get("cpu_s", "")])
    print()
    print_table(["workload", "streams", "requests", "server tok/s", "library tok/s", "server/lib", "TTFT p50 ms",
                 "ITL p50 ms", "ITL p99 ms", "min tokens", "errors", "server CPU s", "client CPU s",
                 "library CPU s"], table)
    print(json.dumps(summary))

    gc.collect()
    steps = model_step_alone(model, prompt_ids, levels, calls=20)
    rows = [[v["batch"], v.get("ms", v.get("error", "")), v.get("tok_s", "")] for v in steps.values()
            if isinstance(v, dict) and "batch" in v]
    if rows:
        print()
        print_table(["model step alone: B", "ms/step", "tok/s"], rows)

    sampler = None
    if not args.no_sampler:
        sampler = sampler_alone(sorted({1, 16, 64}), args.sampler_calls, baseline_rev=args.baseline_rev)
        rows = [[v["config"], v["batch"], v["ours_ms"], v.get("baseline_ms", ""), v.get("speedup", "")]
                for v in sampler["rows"].values()]
        print()
        print_table(["sampler", "B", "ours ms/call", f"{args.baseline_rev} ms/call", "speed-up"], rows)

    data = {**info, "benchmark": "stack", "threads": threads, "checkpoint": str(ck_dir),
            "model": {**CONFIG, "n_params": model.num_params(non_embedding=False), "eos_logit": -CONFIG["n_embd"]},
            "max_batch_size": max_batch, "prompt": PROMPT, "prompt_tokens": len(prompt_ids),
            "new_tokens": args.new_tokens, "requests_per_stream": args.requests, "repeats": args.repeats,
            "workloads": {w: WORKLOADS[w] for w in workloads}, "summary": summary, "results": results,
            "model_step_alone": steps, "sampler_alone": sampler}
    path = write_result(args.out, data)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
