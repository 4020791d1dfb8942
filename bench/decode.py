"""Decode benchmark: our generation loop vs transformers' `GPT2LMHeadModel.generate`, same weights.

    python -m bench.decode [--repeats 5] [--threads 2] [--workloads b1p32,b8p32,b1p512] [--new-tokens 128]

Both models hold the same randomly initialised GPT-2 124M (transformers' `GPT2Config()`
defaults, saved with `save_pretrained` and imported with `model.convert_hf`), run fp32
on the CPU with the same thread count, greedy, on the same random prompts. Ours is the
public loop (`engine.generate.stream_generate`: per-sequence state, detokenizer, logprobs
and all); HF's is `generate(use_cache=True)` with EOS disabled so both always produce
`--new-tokens` tokens. Repetitions alternate ours / HF so that other load on a shared
machine hits both alike; medians and ratios are reported.

Per workload: time to first token (TTFT: prefill + first token, for every prompt of the
batch; HF's is a `max_new_tokens=1` call), decode tokens/s (tokens after the first ÷ time
after the first), total tokens/s, and ours ÷ HF. The memory-bandwidth roofline: read
bandwidth measured in the same run (best of several sums over a 1 GB tensor) ÷ the bytes
of weights one decode step reads (every transformer weight and the tied head once; not
the position table) = the most decode steps per second any fp32 implementation can do.
Also checks that our greedy tokens equal HF's.

Writes bench/results/decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch

from bench.common import (
    env_info,
    median,
    memory_bandwidth,
    print_table,
    random_gpt2,
    set_threads,
    warn_contention,
    write_result,
)

WORKLOADS = {"b1p32": (1, 32), "b8p32": (8, 32), "b1p512": (1, 512)}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step must read: every parameter once (the tied head is the embedding), minus wpe."""
    skip = {id(model.transformer.wpe.weight)} if "wpe" in model.transformer else set()
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in skip:
            seen.add(id(p))
            n += p.numel() * p.element_size()
    return n


def run_ours(model, tokenizer, prompts: torch.Tensor, n_new: int) -> dict[str, Any]:
    from engine.generate import stream_generate
    from engine.params import SamplingParams

    B = prompts.size(0)
    params = SamplingParams(max_new_tokens=n_new, temperature=0.0, stop_at_eos=False, seed=0)
    tokens: list[list[int]] = [[] for _ in range(B)]
    t0 = time.perf_counter()
    t_first = None
    for i, ev in stream_generate(model, tokenizer, prompts.tolist(), params):
        tokens[i].append(ev.id)
        if t_first is None and all(tokens):
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return {"ttft": t_first - t0, "total": t_end - t0, "decode": t_end - t_first, "tokens": tokens}


def run_hf(model, prompts: torch.Tensor, n_new: int) -> dict[str, Any]:
    kw = dict(attention_mask=torch.ones_like(prompts), do_sample=False, use_cache=True, eos_token_id=None,
              pad_token_id=0, num_beams=1)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(prompts, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        t2 = time.perf_counter()
    ttft, total = t1 - t0, t2 - t1
    return {"ttft": ttft, "total": total, "decode": total - ttft, "tokens": out[:, prompts.size(1):].tolist()}


def summarize(runs: list[dict[str, Any]], B: int, n_new: int) -> dict[str, float]:
    ttft = median([r["ttft"] for r in runs])
    return {
        "ttft_ms": round(1000 * ttft, 1),
        "decode_tok_s": round(median([B * (n_new - 1) / r["decode"] for r in runs]), 2),
        "total_tok_s": round(median([B * n_new / r["total"] for r in runs]), 2),
        "ttft_ms_all": [round(1000 * r["ttft"], 1) for r in runs],
        "decode_tok_s_all": [round(B * (n_new - 1) / r["decode"], 2) for r in runs],
    }


def compare_tokens(ours: list[list[int]], hf: list[list[int]]) -> dict[str, Any]:
    same = sum(a == b for x, y in zip(ours, hf) for a, b in zip(x, y))
    total = sum(len(x) for x in hf)
    first = next(((i, j) for i, (x, y) in enumerate(zip(ours, hf)) for j, (a, b) in enumerate(zip(x, y)) if a != b),
                 None)
    return {"equal": ours == hf, "matching_tokens": same, "tokens": total, "first_mismatch": first}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions per workload (after one warm-up)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default min(2, cores))")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {list(WORKLOADS)}")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    ap.add_argument("--out", default="decode", help="result name: bench/results/<out>.json")
    args = ap.parse_args(argv)

    threads = set_threads(args.threads)
    from transformers import GPT2LMHeadModel

    from model.checkpoint import load_checkpoint

    hf_dir, ck_dir = random_gpt2(args.seed)
    ck = load_checkpoint(ck_dir)
    ours, tok = ck.model, ck.tokenizer
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    info = env_info()
    warn_contention(info)
    bw = memory_bandwidth()
    wbytes = weight_bytes(ours)
    roof = bw["read_gbps"] * 1e9 / wbytes
    print(f"threads {threads}, load {os.getloadavg()[0]:.2f}, read bandwidth {bw['read_gbps']} GB/s, "
          f"weights/step {wbytes / 1e6:.1f} MB → batch-1 roofline {roof:.1f} tok/s")

    results: dict[str, Any] = {}
    rows = []
    for name in args.workloads.split(","):
        B, P = WORKLOADS[name]
        g = torch.Generator().manual_seed(args.seed + P * 100 + B)
        prompts = torch.randint(0, 50256, (B, P), generator=g)  # no <|endoftext|> in the prompts
        n = args.new_tokens
        run_ours(ours, tok, prompts, min(n, 8))  # warm-up (allocator, kernels, lazy imports)
        run_hf(hf, prompts, min(n, 8))
        o_runs, h_runs = [], []
        for r in range(args.repeats):
            pair = [("o", lambda p=prompts, k=n: run_ours(ours, tok, p, k)),
                    ("h", lambda p=prompts, k=n: run_hf(hf, p, k))]
            for who, fn in (pair if r % 2 == 0 else pair[::-1]):
                gc.collect()
                (o_runs if who == "o" else h_runs).append(fn())
        o, h = summarize(o_runs, B, n), summarize(h_runs, B, n)
        match = compare_tokens(o_runs[-1]["tokens"], h_runs[-1]["tokens"])
        step_roof = roof * B  # weights are read once per step whatever the batch (KV reads ignored)
        res = {
            "batch": B, "prompt": P, "new_tokens": n, "ours": o, "hf": h,
            "ratio_decode": round(o["decode_tok_s"] / h["decode_tok_s"], 3),
            "ratio_total": round(o["total_tok_s"] / h["total_tok_s"], 3),
            "ratio_ttft": round(o["ttft_ms"] / h["ttft_ms"], 3),
            "roofline_tok_s": round(step_roof, 1),
            "ours_roofline_fraction": round(o["decode_tok_s"] / step_roof, 3),
            "hf_roofline_fraction": round(h["decode_tok_s"] / step_roof, 3),
            "tokens_match_hf": match,
        }
        results[name] = res
        rows.append([name, B, P, o["ttft_ms"], h["ttft_ms"], res["ratio_ttft"], o["decode_tok_s"],
                     h["decode_tok_s"], res["ratio_decode"], o["total_tok_s"], h["total_tok_s"],
                     f"{res['ours_roofline_fraction']:.0%}", "yes" if match["equal"] else
                     f"{match['matching_tokens']}/{match['tokens']}"])
        print(f"{name}: ours {o['decode_tok_s']} tok/s, HF {h['decode_tok_s']} tok/s, "
              f"TTFT {o['ttft_ms']} / {h['ttft_ms']} ms, load {os.getloadavg()[0]:.2f}", flush=True)

    print()
    print_table(["workload", "B", "prompt", "TTFT ours ms", "TTFT HF ms", "ratio", "decode ours tok/s",
                 "decode HF tok/s", "ratio", "total ours", "total HF", "roofline", "= HF tokens"], rows)
    data = {**info, "benchmark": "decode", "threads": threads, "repeats": args.repeats,
            "hf_attn_implementation": hf.config._attn_implementation, "memory_bandwidth": bw,
            "weight_bytes_per_step": wbytes, "roofline_batch1_tok_s": round(roof, 1), "workloads": results}
    path = write_result(args.out, data)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
