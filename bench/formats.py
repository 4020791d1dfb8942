"""Weight formats side by side, in-process: speed, memory and quality of what `GPT_QUANTIZE` / `GPT_DTYPE` serve.

    python -m bench.formats [--formats fp32,bf16,int8,int4] [--batches 1,16,64] [--rounds 3] [--out formats]
    python -m bench.formats --checkpoint checkpoints/shakespeare --formats fp32,bf16,fp16,int8,int4 --batches 1,16
    python -m bench.formats --formats fp32,fp32+kv-bf16,int8,int8+kv-bf16 --prompt-tokens 300 --no-quality

Speed: the engine core built as the server builds it (`engine.build.build_core`: prepacked / quantized
weights, the warm-up, 32 slots) on the random GPT-2 124M of bench/common.py (or `--checkpoint`); per format, the
median time of a decode step at each batch (every slot decoding greedily, `--new-tokens` steps after the prompts)
and of a 512-token prefill (the context less one where shorter). Formats are interleaved round by round (a loaded
machine hits all alike) and each round runs in a fresh process, so the allocator and the kernels' caches start
equal. Memory: the weights' bytes as served
(`model.linear.weight_bytes`). Quality: bits per byte of the bundled model (checkpoints/shakespeare) on the held-out
last 10% of tinyshakespeare (`training.evaluate` with the format), the same text llama.cpp's formats are scored on
in bench/quality.py. Writes bench/results/<out>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, env_info, median, random_gpt2, write_result

FORMATS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "fp16": ("fp16", "none"), "int8": ("fp32", "int8"),
           "int4": ("fp32", "int4")}
DEFAULT_FORMATS = ("fp32", "bf16", "int8", "int4")
# the KV cache in bf16 beside a format's weights (GPT_KV_CACHE_DTYPE=bf16); its quality scored token by token
# through the cache, beside the same format through an fp32 cache (training.evaluate --kv-cache-dtype)
KV_VARIANTS = {f"{name}+kv-bf16": fmt for name, fmt in FORMATS.items() if name != "bf16"}
SHAKESPEARE = Path(REPO).parent / "shared" / "data" / "tinyshakespeare.txt"
VAL_BYTES = 111540  # the last 10% of tinyshakespeare: the bundled model's held-out split


def one_round(fmt: str, batches: list[int], new_tokens: int, threads: int | None,
              prompt_tokens: int = 32, checkpoint: str | None = None, spread: int = 0) -> dict[str, Any]:
    """In this process: build the core for `fmt`, time decode steps (after `prompt_tokens`-token prompts; with
    `spread`, row i's prompt is (i * 37) % (spread + 1) tokens shorter, so the rows decode at different lengths, as
    streams that started at different times do) and a long prefill."""
    import torch

    from engine.build import CoreConfig, build_core
    from engine.params import SamplingParams
    from engine.request import EngineRequest

    dtype, quantize = FORMATS.get(fmt) or KV_VARIANTS[fmt]
    ck = checkpoint or random_gpt2()[1]
    cfg = CoreConfig(checkpoint=str(ck), device="cpu", dtype=dtype, quantize=quantize, max_batch_size=max(batches),
                     torch_threads=threads, prefix_cache=False,
                     kv_cache_dtype="bf16" if fmt in KV_VARIANTS else "auto")
    core, info, _ = build_core(cfg)
    core.warmup()
    core.wait_compiled(timeout=900)  # what a server runs once its background compiles are in (steady state)
    stats = core.stats()
    out: dict[str, Any] = {"weight_bytes": info["weight_bytes"], "kernels": info.get("kernels"), "decode_ms": {},
                           "compiled_decode": stats["compiled_decode"],
                           "compiled_attention": stats["compiled_attention"]}
    g = torch.Generator().manual_seed(0)
    for b in batches:
        # rows keep decoding until every row is past its (chunked) prefill; then `new_tokens` steps of all b rows
        # are timed and the requests aborted
        budget = core.max_len - prompt_tokens
        ids = [f"{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            n = prompt_tokens - (i * 37) % (spread + 1)
            prompt = torch.randint(0, core.vocab_size - 1, (n,), generator=g).tolist()
            core.add(EngineRequest(rid, prompt, SamplingParams(max_new_tokens=budget, temperature=0), seed=i))
        times = []
        while core.has_work() and len(times) < new_tokens:
            t0 = time.perf_counter()
            outs = core.step()
            dt = time.perf_counter() - t0
            if core.stats()["running"] == b and outs and all(o.token_ids for o in outs) and len(outs) == b:
                times.append(dt)
        core.abort(ids)
        while core.has_work():
            core.step()
        if not times:
            raise SystemExit(f"no decode step ran all {b} rows: shorten --prompt-tokens ({prompt_tokens})")
        out["decode_ms"][str(b)] = round(1000 * median(times[2:] or times), 2)
    prompt = torch.randint(0, core.vocab_size - 1, (min(512, core.max_len - 1),), generator=g).tolist()
    ttft = []
    for i in range(3):
        core.add(EngineRequest(f"long-{i}", prompt[i:] + prompt[:i], SamplingParams(max_new_tokens=1), seed=0))
        t0 = time.perf_counter()
        while core.has_work():
            core.step()
        ttft.append(time.perf_counter() - t0)
    out["prefill512_ms"] = round(1000 * median(ttft), 1)
    out["prefill_tokens"] = len(prompt)  # 512, or the checkpoint's context less one
    return out


def quality(fmt: str) -> dict[str, Any]:
    """Bits per byte of the bundled model in this format on the held-out split; a KV variant's decoded token by
    token through its bf16 cache, beside the same weights through an fp32 cache (`fp32_cache_bits_per_byte`)."""
    import tempfile

    from training.evaluate import evaluate

    dtype, quantize = FORMATS.get(fmt) or KV_VARIANTS[fmt]
    with tempfile.TemporaryDirectory() as d:
        val = Path(d) / "val.txt"
        data = SHAKESPEARE.read_bytes()
        val.write_bytes(data[-VAL_BYTES:])

        def score(kv: str | None) -> dict[str, Any]:
            return evaluate(str(REPO / "checkpoints" / "shakespeare"), [str(val)], device="cpu", quantize=quantize,
                            dtype=dtype, kv_cache_dtype=kv)

        if fmt in FORMATS:
            r = score(None)
            return {"bits_per_byte": r["bits_per_byte"], "perplexity": r["perplexity"], "seconds": r["seconds"]}
        r, ref = score("bf16"), score("fp32")
    q, q0 = r["bits_per_byte"], ref["bits_per_byte"]
    return {"bits_per_byte": q, "perplexity": r["perplexity"], "seconds": r["seconds"], "kv_cache_dtype": "bf16",
            "fp32_cache_bits_per_byte": q0, "delta_vs_fp32_cache_pct": round(100 * (q - q0) / q0, 5)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.formats", description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    p.add_argument("--checkpoint", default=None, help="a checkpoint to time instead of the random GPT-2 124M")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=32, help="each decoding row's prompt")
    p.add_argument("--length-spread", type=int, default=0,
                   help="row i's prompt is (i * 37) %% (N + 1) tokens shorter: rows decode at different lengths")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--out", default="formats")
    p.add_argument("--one-round", help=argparse.SUPPRESS)  # internal: one format's round in a fresh process
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.one_round:
        print(json.dumps(one_round(args.one_round, batches, args.new_tokens, args.threads, args.prompt_tokens,
                                   args.checkpoint, args.length_spread)))
        return 0
    fmts = args.formats.split(",")
    if unknown := [f for f in fmts if f not in FORMATS and f not in KV_VARIANTS]:
        p.error(f"unknown format(s) {', '.join(unknown)}: use {', '.join([*FORMATS, *KV_VARIANTS])}")
    if args.prompt_tokens < 1 or args.prompt_tokens + args.new_tokens >= 1024:  # GPT-2's context
        p.error(f"--prompt-tokens ({args.prompt_tokens}) must be >= 1 and leave room for --new-tokens "
                f"({args.new_tokens}) in GPT-2's 1,024-token context")
    if not 0 <= args.length_spread < args.prompt_tokens:
        p.error(f"--length-spread ({args.length_spread}) must be >= 0 and below --prompt-tokens ({args.prompt_tokens})")
    if args.checkpoint is None:
        random_gpt2()  # built once, before any timing
    rounds: dict[str, list] = {f: [] for f in fmts}
    for r in range(args.rounds):
        for f in (fmts if r % 2 == 0 else fmts[::-1]):
            cmd = [sys.executable, "-m", "bench.formats", "--one-round", f, "--batches", args.batches,
                   "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
                   "--length-spread", str(args.length_spread)]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            cmd += ["--checkpoint", args.checkpoint] if args.checkpoint else []
            res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if res.returncode != 0:  # its last line says why (e.g. no decode step ran every row)
                last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(f"error: round {r} of {f} exited with {res.returncode}: {last}", file=sys.stderr)
                return 1
            rounds[f].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r} {f}: {rounds[f][-1]['decode_ms']} prefill512 {rounds[f][-1]['prefill512_ms']} ms",
                  flush=True)
    results: dict[str, Any] = {}
    for f in fmts:
        rs = rounds[f]
        results[f] = {"weight_bytes": rs[0]["weight_bytes"], "kernels": rs[0]["kernels"],
                      "decode_ms": {b: median([x["decode_ms"][b] for x in rs]) for b in rs[0]["decode_ms"]},
                      "prefill512_ms": median([x["prefill512_ms"] for x in rs]), "rounds": rs}
        results[f]["decode_tok_s"] = {b: round(int(b) * 1000 / ms, 1) for b, ms in results[f]["decode_ms"].items()}
        if not args.no_quality:
            results[f]["quality"] = quality(f)
    base = results.get("fp32")
    if base:
        for r in results.values():
            r["speed_vs_fp32"] = {b: round(base["decode_ms"][b] / ms, 3) for b, ms in r["decode_ms"].items()}
            if "quality" in r:
                q0 = base["quality"]["bits_per_byte"]
                r["quality"]["delta_vs_fp32_pct"] = round(100 * (r["quality"]["bits_per_byte"] - q0) / q0, 4)
    from model.cpu_support import support

    data = {"env": env_info(), "cpu": support().describe(),
            "model": f"{args.checkpoint or 'random GPT-2 124M'} (speed); checkpoints/shakespeare (quality)",
            "batches": batches, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
            "length_spread": args.length_spread,
            "rounds": args.rounds, "formats": results}
    print(json.dumps({f: {k: v for k, v in r.items() if k != "rounds"} for f, r in results.items()}, indent=1))
    print(f"wrote {write_result(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
