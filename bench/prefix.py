"""Prefix caching benchmark: the same server with and without `GPT_PREFIX_CACHE`, same weights, same requests.

    python -m bench.prefix [--checkpoint DIR] [--workloads chat,system,distinct,admission] [--rounds 1]

Workloads (each against both servers, the order alternating by round, one server at a time):
- `chat`: 4 conversations at once through `/v1/chat/completions` (streaming), 8 turns each; every turn appends
  ~60 tokens of user text and the model's reply (`--reply-tokens`), as a chat client resends the whole
  conversation. Time to first token per turn (median over the conversations) with and without the cache.
- `system`: requests sharing one ~400-token system prompt with different ~20-token questions, 16 streams at
  once through `/v1/completions` (`--system-requests` in all): TTFT p50/p99 and generated tokens/s.
- `distinct`: prompts of ~200 tokens that share nothing (each starts with its own words), 16 streams: the cost of
  the cache machinery when it cannot help (goal: no regression beyond 3%).
- `admission`: the scheduler alone at 256 slots holding cached conversations: microseconds per admission
  (matching, LRU choice, index upkeep), with and without the cache.
- `determinism`: greedy conversations in-process (the engine core alone), cache on vs off: how many requests give
  identical tokens, and the top-two logit margin wherever one differs.

Both servers run the app's default settings (`python -m app`, slots and prefill chunk as a user gets them) on the
random GPT-2 124M of bench.common (fp32) unless --checkpoint is given. Writes bench/results/prefix.json.
Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import env_info, median, print_table, random_gpt2, set_threads, warn_contention, write_result
from bench.harness import app_server

WORDS = ("time light river stone winter garden market silver window letter morning harbor mountain "
         "question lantern shadow kingdom voyage ember meadow thunder candle forest mirror island "
         "whisper crystal orchard compass velvet").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def stream(client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streaming request: time to the first content, the text, the usage (cached tokens)."""
    t0 = time.perf_counter()
    ttft, text, usage, error, n = None, [], None, None, 0
    try:
        async with client.stream("POST", path, json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                if "error" in ev:
                    error = str(ev["error"])
                    continue
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices", []):
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if piece:  # not the chat stream's opening role chunk (empty content)
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
                        n += 1
    except Exception as e:  # noqa: BLE001 - counted, not fatal
        error = f"{type(e).__name__}: {e}"
    return {"ttft": ttft, "text": "".join(text), "usage": usage, "error": error, "events": n,
            "wall": time.perf_counter() - t0}


def cached_of(res: dict[str, Any]) -> int:
    return ((res.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def chat_workload(url: str, args, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    convs = [[{"role": "system", "content": "You are a helpful assistant. " + words(rng, 20)}]
             for _ in range(args.conversations)]
    per_turn: list[dict[str, Any]] = []
    errors, examples = 0, []
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s) as client:
        for turn in range(args.turns):
            for c in convs:
                c.append({"role": "user", "content": words(rng, 55)})
            body = dict(max_tokens=args.reply_tokens, temperature=1.0)
            results = await asyncio.gather(*[stream(client, "/v1/chat/completions",
                                                    {**body, "messages": c, "seed": rng.randrange(2**31)})
                                             for c in convs])
            for c, res in zip(convs, results):
                if res.get("error") is not None:
                    errors += 1
                    examples.append(res["error"])
                c.append({"role": "assistant", "content": res.get("text") or ""})
            ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
            usage = [r.get("usage") or {} for r in results]
            per_turn.append({"turn": turn + 1, "ttft_p50_ms": 1000 * median(ttfts) if ttfts else None,
                             "ttft_max_ms": 1000 * max(ttfts) if ttfts else None,
                             "prompt_tokens_mean": sum(u.get("prompt_tokens", 0) for u in usage) / len(usage),
                             "cached_tokens_mean": sum(cached_of(r) for r in results) / len(results)})
    return {"turns": per_turn, "errors": errors, "error_examples": examples[:3]}


async def many(url: str, path: str, bodies: list[dict[str, Any]], streams: int, timeout: float) -> dict[str, Any]:
    import httpx

    queue = list(bodies)
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def worker(client):
        while queue:
            results.append(await stream(client, path, queue.pop(0)))

    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(*[worker(client) for _ in range(streams)])
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.get("error") is None and r.get("ttft") is not None]
    ttfts = [r["ttft"] for r in ok]
    tokens = sum(r["events"] for r in ok)
    return {"requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
            "tok_s": tokens / wall if wall else None, "ttft_p50_ms": 1000 * pct(ttfts, 50) if ttfts else None,
            "ttft_p99_ms": 1000 * pct(ttfts, 99) if ttfts else None,
            "cached_tokens_mean": sum(cached_of(r) for r in ok) / len(ok) if ok else 0}


def system_bodies(args, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    system = "System: you answer questions about the archive. " + words(rng, 390) + "\n"
    return [{"prompt": system + "Question: " + words(rng, 18) + "?\nAnswer:", "max_tokens": args.max_tokens,
             "temperature": 1.0, "seed": i} for i in range(args.system_requests)]


def distinct_bodies(args, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt": f"{i} {rng.choice(WORDS)} " + words(rng, 195), "max_tokens": args.max_tokens,
             "temperature": 1.0, "seed": i} for i in range(args.system_requests)]


def admission_cost(slots: int = 256, prompt_len: int = 600, admissions: int = 400) -> dict[str, Any]:
    """Microseconds per admission at `slots` slots, every one caching a different conversation: the scheduler
    alone (match over the index, LRU choice, index upkeep), cache on vs off."""
    from engine.ops import Draw
    from engine.params import SamplingParams
    from engine.request import EngineRequest
    from engine.scheduler import Scheduler

    def run(s: Scheduler, rng: random.Random, reqs: list) -> float:
        """Admit `reqs` (timed), then run them to the end with random tokens."""
        for r in reqs:
            s.add(r)
        t0 = time.perf_counter()
        step = s.schedule(0.0)
        dt = time.perf_counter() - t0
        while s.has_work():
            s.update(step, [Draw(rng.randrange(50000), 0.0) for _ in step.sampled])
            step = s.schedule(0.0)
        return dt

    out = {}
    for on in (False, True):
        rng = random.Random(0)
        s = Scheduler(slots, prefill_chunk=None, eos_id=None, prefix_cache=on)
        convs = [[rng.randrange(50000) for _ in range(prompt_len)] for _ in range(slots)]
        run(s, rng, [EngineRequest(f"w{i}", c, SamplingParams(max_new_tokens=2), seed=0) for i, c in enumerate(convs)])
        total = 0.0
        for a in range(admissions):  # one at a time: a conversation's next turn (or a new one, every 4th)
            c = convs[a % slots] + [rng.randrange(50000) for _ in range(20)] if a % 4 else \
                [rng.randrange(50000) for _ in range(prompt_len)]
            total += run(s, rng, [EngineRequest(f"a{a}", c[:1000], SamplingParams(max_new_tokens=1), seed=0)])
        out["on" if on else "off"] = {"us_per_admission": 1e6 * total / admissions, "hit_tokens": s.hit_tokens}
    return {"slots": slots, "prompt_len": prompt_len, **out}


def determinism(checkpoint: Path, conversations: int = 6, turns: int = 5, new: int = 24) -> dict[str, Any]:
    """Greedy outputs with and without reuse, in-process on the same weights: conversations that grow turn by turn
    (each prompt = the last prompt + its reply + new text), run with the cache on and off. Counts the requests whose
    tokens are identical and, where they differ, the top-two logit margin (fresh run) at the first difference."""
    import torch

    from engine.core import EngineCore
    from engine.params import SamplingParams
    from engine.request import EngineRequest
    from model.checkpoint import load_checkpoint

    ck = load_checkpoint(checkpoint)
    tok = ck.tokenizer

    def run(on: bool) -> list[list[Any]]:
        # as many slots as conversations: more conversations cycling through fewer slots is LRU's worst case
        core = EngineCore(ck.model, n_slots=conversations, vocab_size=tok.vocab_size, eos_id=None, prefill_chunk=128,
                          prefix_cache=on)
        rng = random.Random(0)
        prompts = [tok.encode(words(rng, 30)) for _ in range(conversations)]
        outs: list[list[Any]] = []
        with torch.inference_mode():
            for t in range(turns):
                for i, p in enumerate(prompts):
                    core.add(EngineRequest(f"{t}-{i}", p, SamplingParams(max_new_tokens=new, temperature=0), seed=0,
                                           top_n=2))
                got: dict[str, list] = {}
                while core.has_work():
                    for o in core.step():
                        got.setdefault(o.request_id, []).append(o)
                for i in range(len(prompts)):
                    o = got[f"{t}-{i}"]
                    outs.append(o)
                    prompts[i] = prompts[i] + [x.token_ids[0] for x in o] + tok.encode(" " + words(rng, 12))
        return outs, core.stats()

    fresh, _ = run(False)
    reused, stats = run(True)
    same, margins = 0, []
    for a, b in zip(fresh, reused):
        ta, tb = [x.token_ids[0] for x in a], [x.token_ids[0] for x in b]
        if ta == tb:
            same += 1
        else:
            j = next(k for k, (x, y) in enumerate(zip(ta, tb)) if x != y)
            margins.append(a[j].top[0][0][1] - a[j].top[0][1][1])
    lp = max(abs(x.logprobs[0] - y.logprobs[0]) for a, b in zip(fresh, reused) for x, y in zip(a, b))
    return {"requests": len(fresh), "identical": same, "margins_at_first_difference": margins,
            "max_logprob_abs_diff_in_common": lp, "prefix_hit_tokens": stats["prefix_hit_tokens"],
            "prompt_tokens_computed": stats["prompt_tokens"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the random GPT-2 124M of bench.common")
    ap.add_argument("--workloads", default="chat,system,distinct,admission,determinism")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="GPT_TORCH_THREADS (default: the server's own)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=40)
    ap.add_argument("--system-requests", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default="prefix")
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - {"chat", "system", "distinct", "admission", "determinism"}
    if unknown:
        print(f"bench.prefix: unknown workloads {sorted(unknown)}", file=sys.stderr)
        return 2
    threads = set_threads(args.threads) if args.threads else None
    checkpoint = args.checkpoint or random_gpt2()[1]
    info = env_info()
    warn_contention(info)
    data: dict[str, Any] = {**info, "benchmark": "prefix", "checkpoint": str(checkpoint), "args": vars(args)}
    data["args"]["checkpoint"] = str(checkpoint)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    logs = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    server_workloads = [w for w in workloads if w not in ("admission", "determinism")]
    for rnd in range(args.rounds if server_workloads else 0):
        order = ["on", "off"] if rnd % 2 == 0 else ["off", "on"]
        for mode in order:
            server = app_server(checkpoint, None, threads or 0, logs / f"{mode}-{rnd}.log",
                                extra_env={"GPT_PREFIX_CACHE": "1" if mode == "on" else "0"})
            try:
                server.wait_ready()
                res: dict[str, Any] = {"round": rnd}
                for w in server_workloads:
                    if w == "chat":
                        res[w] = asyncio.run(chat_workload(server.url, args, seed=rnd))
                        t8 = res[w]["turns"][-1]
                        if res[w]["errors"]:
                            print(f"  {mode:3} chat errors: {res[w]['errors']}, e.g. {res[w]['error_examples']}")
                        print(f"  {mode:3} chat    turn {t8['turn']} TTFT p50 {t8['ttft_p50_ms'] or 0:.0f} ms, "
                              f"cached {t8['cached_tokens_mean']:.0f} of {t8['prompt_tokens_mean']:.0f}", flush=True)
                    else:
                        bodies = (system_bodies if w == "system" else distinct_bodies)(args, seed=rnd)
                        res[w] = asyncio.run(many(server.url, "/v1/completions", bodies, args.streams,
                                                  args.request_timeout_s))
                        r = res[w]
                        print(f"  {mode:3} {w:8} TTFT p50 {r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f} ms, "
                              f"{r['tok_s']:.1f} tok/s, cached {r['cached_tokens_mean']:.0f}, errors {r['errors']}",
                              flush=True)
                runs[mode].append(res)
            finally:
                server.stop()
    data["runs"] = runs
    summary: dict[str, Any] = {}
    if "chat" in server_workloads and runs["on"]:
        def turn8(mode):
            return median([r["chat"]["turns"][-1]["ttft_p50_ms"] for r in runs[mode]])
        summary["chat_turn8_ttft_ms"] = {"on": turn8("on"), "off": turn8("off")}
        summary["chat_turn8_speedup"] = turn8("off") / turn8("on") if turn8("on") and turn8("off") else None
    for w in ("system", "distinct"):
        if w in server_workloads and runs["on"]:
            def m(mode, key, w=w):
                return median([r[w][key] for r in runs[mode]])
            summary[w] = {k: {"on": m("on", k), "off": m("off", k)} for k in ("ttft_p50_ms", "ttft_p99_ms", "tok_s")}
            summary[w]["ttft_p50_speedup"] = m("off", "ttft_p50_ms") / m("on", "ttft_p50_ms")
            summary[w]["tok_s_ratio"] = m("on", "tok_s") / m("off", "tok_s")
    if "admission" in workloads:
        summary["admission"] = admission_cost()
    if "determinism" in workloads:
        summary["determinism"] = determinism(checkpoint)
        print(f"  determinism: {summary['determinism']}", flush=True)
    data["summary"] = summary
    goals = {}
    if summary.get("chat_turn8_speedup"):
        goals["chat turn 8 TTFT >= 4x lower"] = summary["chat_turn8_speedup"] >= 4
    if "system" in summary:
        goals["shared system prompt TTFT p50 >= 4x lower"] = summary["system"]["ttft_p50_speedup"] >= 4
    if "distinct" in summary:
        goals["no shared prefix: tok/s within 3%"] = summary["distinct"]["tok_s_ratio"] >= 0.97
    data["goals"] = goals
    path = write_result(args.out, data)
    rows = []
    if summary.get("chat_turn8_speedup"):
        t = summary["chat_turn8_ttft_ms"]
        rows.append(["chat turn 8 TTFT p50 ms", f"{t['on']:.0f}", f"{t['off']:.0f}",
                     f"{summary['chat_turn8_speedup']:.2f}x"])
    for w in ("system", "distinct"):
        if w in summary:
            t = summary[w]
            rows.append([f"{w} TTFT p50 ms", f"{t['ttft_p50_ms']['on']:.0f}", f"{t['ttft_p50_ms']['off']:.0f}",
                         f"{t['ttft_p50_speedup']:.2f}x"])
            rows.append([f"{w} tok/s", f"{t['tok_s']['on']:.1f}", f"{t['tok_s']['off']:.1f}",
                         f"{t['tok_s_ratio']:.3f}"])
    if "admission" in summary:
        a = summary["admission"]
        rows.append([f"admission us at {a['slots']} slots", f"{a['on']['us_per_admission']:.0f}",
                     f"{a['off']['us_per_admission']:.0f}", ""])
    print_table(["", "cache on", "cache off", "ratio"], rows)
    print(f"goals: {goals}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
