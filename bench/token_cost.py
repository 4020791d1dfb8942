"""Where one batch-1 token goes: the engine core's step split into forward, sampler and the rest, the forward's
operators by kind, and what HTTP streaming adds on top.

    python -m bench.token_cost [--checkpoint DIR] [--quantize none|int8|int4] [--compile off,on] [--tokens 200]
    python -m bench.token_cost --gpt2 --compile off --quantize int8

For each `--compile` mode (interleaved over `--rounds`): the engine core built as the server builds it
(`engine.build.build_core`, default settings, `--threads` torch threads; a compile waited for), one greedy, one
seeded T = 1 and one seeded T = 0.8 top-p 0.95 request of `--tokens` tokens decoded alone, every step timed, with
the model's forward (the eager `forward_cached` or the compiled step, which draws greedy and T = 1 tokens itself:
engine/plain_draw.py) and the sampler's part (its draw, or recording the compiled step's draw) timed inside it:
per-token medians of step, forward, sampler and the rest (scheduler, outputs, grammar and bookkeeping). Then 50
steps under torch.profiler, self CPU time per operator kind (matmuls, attention, a compiled graph's call, dynamo's
guard lookup, the rest). Then `python -m app` with the same settings, a greedy stream over HTTP
(`/generate_stream`): the mean gap between token events (second to last: the core sends a fast model's tokens a
few at a time), and `http_overhead_ms` = that gap less the in-process step. Writes bench/results/<out>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, env_info, random_gpt2, write_result

KINDS = {  # profiler operator names → the kind they are counted under (first match)
    "compiled graph": ("CompiledFxGraph", "Torch-Compiled Region"),
    "guards": ("TorchDynamo Cache Lookup",),
    "matmul": ("addmm", "aten::mm", "linear", "mkldnn", "quantized::", "int4pack", "int8pack", "bmm"),
    "attention": ("scaled_dot_product", "flash_attention"),
}


def kind(name: str) -> str:
    return next((k for k, keys in KINDS.items() if any(key in name for key in keys)), "other")


def timed(fn, sink: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - t0)
        return out

    return wrapper


def in_process(checkpoint: str, quantize: str, compile: str, threads: int, tokens: int) -> dict[str, Any]:
    from torch.profiler import profile

    from engine.build import CoreConfig, build_core
    from engine.params import SamplingParams
    from engine.request import EngineRequest

    cfg = CoreConfig(checkpoint=checkpoint, device="cpu", dtype="fp32", quantize=quantize, compile=compile,
                     torch_threads=threads)
    core, info, _ = build_core(cfg)
    core.warmup()
    compiled = core.wait_compiled(900)
    forward: list[float] = []
    sampler: list[float] = []
    core.model.forward_cached = timed(core.model.forward_cached, forward)
    if core._compiled is not None:
        core._compiled.replay = timed(core._compiled.replay, forward)
    core.sampler.step = timed(core.sampler.step, sampler)
    core.sampler.take = timed(core.sampler.take, sampler)  # a draw made inside the compiled step: its read-back
    out: dict[str, Any] = {"compiled_decode": compiled, "compile_s": core.compile_seconds,
                           "weight_bytes": info["weight_bytes"]}
    for name, params in (("greedy", SamplingParams(max_new_tokens=tokens, temperature=0.0, stop_at_eos=False)),
                         ("sampled_t1", SamplingParams(max_new_tokens=tokens, temperature=1.0, stop_at_eos=False)),
                         ("sampled", SamplingParams(max_new_tokens=tokens, temperature=0.8, top_p=0.95,
                                                    stop_at_eos=False)),
                         # llama.cpp's sampling defaults (temperature 0.8, top-k 40, top-p 0.95)
                         ("sampled_top_k", SamplingParams(max_new_tokens=tokens, temperature=0.8, top_k=40, top_p=0.95,
                                                          stop_at_eos=False))):
        core.add(EngineRequest(name, list(range(10, 42)), params, seed=1))
        steps: list[float] = []
        forward.clear()
        sampler.clear()
        while core.has_work():
            t0 = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - t0)
        decode = slice(2, None)  # after the prefill step and the first decode
        ms = {k: statistics.median(v[decode]) * 1000 for k, v in (("step", steps), ("forward", forward),
                                                                   ("sampler", sampler))}
        ms["rest"] = ms["step"] - ms["forward"] - ms["sampler"]
        out[name] = {k: round(v, 3) for k, v in ms.items()} | {"tok_s": round(1000 / ms["step"], 1)}
    core.add(EngineRequest("profiled", list(range(10, 42)), SamplingParams(max_new_tokens=52, temperature=0.0,
                                                                            stop_at_eos=False), seed=1))
    core.step()
    core.step()
    with profile() as prof:
        n = 0
        while core.has_work():
            core.step()
            n += 1
    by_kind: dict[str, float] = {}
    for ev in prof.key_averages():
        by_kind[kind(ev.key)] = by_kind.get(kind(ev.key), 0.0) + ev.self_cpu_time_total / 1000 / n
    out["profile_ms_per_step"] = {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    return out


def over_http(checkpoint: str, quantize: str, compile: str, threads: int, tokens: int) -> dict[str, Any]:
    import tempfile

    import httpx

    from bench.harness import Server, free_port

    port = free_port()
    argv = [sys.executable, "-m", "app", "--checkpoint", checkpoint, "--port", str(port), "--host", "127.0.0.1",
            "--device", "cpu", "--dtype", "fp32", "--quantize", quantize, "--torch-threads", str(threads)]
    with tempfile.TemporaryDirectory() as d:
        server = Server(f"ours-compile-{compile}", argv, {"GPT_COMPILE": compile}, Path(d) / "server.log", port)
        server.start()
        try:
            healthy_s = server.wait_ready(900)  # and the background compile, when there is one

            def stream(n: int) -> float:
                """The mean gap between token events from the second to the last: the core sends a fast model's
                tokens a few at a time (engine/stream_interval.py), so the gaps themselves are mostly ~0 and one
                interval long (their median read 10,000 tok/s for the bundled model)."""
                body = {"inputs": "ROMEO:\n", "parameters": {"max_new_tokens": n}}
                times = []
                with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=300) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            times.append(time.perf_counter())
                return (times[-1] - times[1]) / (len(times) - 2)

            stream(8)
            gap = statistics.median(stream(tokens) for _ in range(3))
        finally:
            server.stop()
    return {"healthy_s": round(healthy_s, 2), "compile_wait_s": server.compile_wait_s,
            "token_gap_ms": round(gap * 1000, 3), "tok_s": round(1 / gap, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.token_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "shakespeare"))
    p.add_argument("--gpt2", action="store_true", help="the random GPT-2 124M of bench/common.py instead")
    p.add_argument("--quantize", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--compile", default="off,on", help="modes to compare (engine/compiled_decode.py)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-http", action="store_true")
    p.add_argument("--out", default="token-cost")
    args = p.parse_args(argv)
    modes = args.compile.split(",")
    if bad := [m for m in modes if m not in ("off", "on")]:
        p.error(f"--compile takes off and/or on, got {', '.join(bad)}")
    checkpoint = str(random_gpt2()[1]) if args.gpt2 else args.checkpoint
    if not Path(checkpoint).is_dir():
        p.error(f"--checkpoint {checkpoint}: no such checkpoint directory")
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            cmd = [sys.executable, "-c", "import json, sys; from bench.token_cost import in_process; "
                   f"print(json.dumps(in_process({checkpoint!r}, {args.quantize!r}, {m!r}, {args.threads}, "
                   f"{args.tokens})))"]
            res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ})
            if res.returncode != 0:
                last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(f"error: round {r} ({m}) failed: {last}", file=sys.stderr)
                return 1
            import json

            rec = json.loads(res.stdout.strip().splitlines()[-1])
            if not args.no_http:
                rec["http"] = over_http(checkpoint, args.quantize, m, args.threads, args.tokens)
                rec["http"]["overhead_ms"] = round(rec["http"]["token_gap_ms"] - rec["greedy"]["step"], 3)
            rounds[m].append(rec)
            print(f"round {r} compile={m}: greedy {rec['greedy']} T=1 {rec['sampled_t1']['step']} ms, T=0.8 "
                  f"top-p 0.95 {rec['sampled']['step']} ms, + top-k 40 {rec['sampled_top_k']['step']} ms "
                  f"profile {rec['profile_ms_per_step']} http {rec.get('http')}", flush=True)
    data = {"env": env_info(), "checkpoint": checkpoint, "quantize": args.quantize, "threads": args.threads,
            "tokens": args.tokens, "rounds": rounds}
    print(f"wrote {write_result(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
