"""Speculative decoding benchmark: speculation off / ngram / draft, interleaved in one process, per workload.

    python -m bench.speculative [--repeats 3] [--threads 1] [--workloads copy,repeat,chat,streams16,streams64,gpt2]
                                [--methods off,ngram,draft] [--compile auto|on|off] [--quick]

Each method gets its own engine core built as the server builds it (weights prepacked, padded vocabulary, no prefix
cache, warmed up, its decode steps compiled as `--compile` says, the server's `auto` by default, and waited for: the
first run on a machine compiles each model and setup for minutes), on its own copy of the checkpoint; every repeat
runs the methods one after another on the same requests, so load on a shared machine hits them alike, and medians
over repeats are reported with each method's ratio to `off` from the same run. Every run also checks that a
method's tokens equal `off`'s (they must: the verification is exact).

Workloads (batch 1 unless named streams):
- copy: the copy model (bench/spec_models.py: the bundled model fine-tuned here to repeat a passage) is given a
  tinyshakespeare passage from the held-out 10% and "\\n\\nAgain:\\n", greedy, as many new tokens as the passage;
  half the passages get the "small edit" (a word swapped) in the reference answer only (the model decides).
- repeat: the bundled model (checkpoints/shakespeare), greedy, 128 new tokens after Shakespeare openings: its
  greedy text repeats itself, which prompt lookup catches.
- chat: the bundled model on You:/Model: transcripts (two earlier turns, a new question), sampled (T 0.8, top-p
  0.95, seeded), stop at "\\nYou:", 96 new tokens.
- streams16 / streams64: the bundled model, 16 / 64 sampled streams at once (T 0.8), 64 new tokens each: what
  speculation costs where a step is compute-bound (GPT_SPECULATIVE_MAX_BATCH turns it off there by default).
- crossover2 / 4 / 8 / 16 (not in the default list): the bundled model's greedy openings as 2-16 streams at once,
  64 new tokens: where speculation stops paying as the batch grows (run them with --max-batch 64).
- sampled2 / 4 (not in the default list): the same openings as 2 / 4 sampled streams (T 0.8, top-p 0.95, seeded),
  64 new tokens: batches within the default GPT_SPECULATIVE_MAX_BATCH whose drafts mostly fail.
- gpt2: random GPT-2 124M (bench/common.random_gpt2; greedy text of random weights loops), greedy, batch 1, 96 new
  tokens; its draft is its own first 2 blocks with its head (bench/spec_models.py build_truncated: a read-bound
  target with a cheap draft that agrees with it, where no trained pair with GPT-2's tokenizer is at hand offline).

Per workload and method: decode tok/s (tokens after each request's first ÷ time after its first, summed over the
requests), TTFT (median), total tok/s for streams, acceptance (accepted ÷ proposed tokens), and ratios to off.
Writes bench/results/speculative.json (--quick: speculative-quick.json, tiny sizes: a smoke run, not a result).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import CACHE, REPO, env_info, median, print_table, set_threads, write_result

BUNDLED = REPO / "checkpoints" / "shakespeare"
OPENINGS = ["ROMEO:\nWhat light", "First Citizen:\nBefore we proceed any further", "KING HENRY:\n",
            "JULIET:\nGood night, good night!", "MENENIUS:\nWhat work's, my countrymen", "HAMLET:\nTo be, or not",
            "GLOUCESTER:\nNow is the winter", "LADY MACBETH:\nOut, damned spot"]
CHAT = [("What is your name?", "My name is Romeo, sir.", "Where do you live?", "In Verona, where we lay our scene."),
        ("Who are you?", "A poor servant of the duke.", "What do you want?", "I want to serve my lord."),
        ("Good morrow, sir.", "Good morrow to you, my lord.", "How fares the king?", "The king is well."),
        ("What news from Rome?", "The senate is met.", "Who speaks for the people?", "The tribunes do, my lord.")]
QUESTIONS = ["And what of your father?", "Tell me of the war.", "Why do you weep?", "What will you do now?"]


# ---------------------------------------------------------------------------------------------- workloads
def workloads(quick: bool, copy_dir: Path | None, draft_dir: Path | None) -> dict[str, dict[str, Any]]:
    """name → target checkpoint, draft checkpoint (None: no draft), requests [(prompt ids, params)], batch."""
    from bench.spec_models import SEPARATOR, copy_example, corpus
    from engine.params import SamplingParams
    from model.checkpoint import load_checkpoint

    n_req = 2 if quick else 8
    tok = load_checkpoint(BUNDLED).tokenizer
    new = 16 if quick else 128
    out: dict[str, dict[str, Any]] = {}
    _, held_out = corpus(tok)
    rng = random.Random(0)
    sep = tok.encode(SEPARATOR)
    copy_reqs = []
    for i in range(n_req):
        prompt, answer = copy_example(held_out, sep, rng, n=24 if quick else rng.randint(64, 110), edit=i % 2 == 1)
        copy_reqs.append((prompt, SamplingParams(max_new_tokens=len(answer), temperature=0, stop_at_eos=False)))
    out["copy"] = dict(target=copy_dir or BUNDLED, draft=draft_dir, requests=copy_reqs, batch=1,
                       note=None if copy_dir else "copy model missing: the bundled model stands in (it cannot copy)")
    out["repeat"] = dict(target=BUNDLED, draft=draft_dir, batch=1, requests=[
        (tok.encode(p), SamplingParams(max_new_tokens=new, temperature=0, stop_at_eos=False))
        for p in OPENINGS[:n_req]])
    chat = []
    for i in range(n_req):
        q1, a1, q2, a2 = CHAT[i % len(CHAT)]
        text = f"You: {q1}\nModel: {a1}\nYou: {q2}\nModel: {a2}\nYou: {QUESTIONS[i % len(QUESTIONS)]}\nModel:"
        chat.append((tok.encode(text), SamplingParams(max_new_tokens=16 if quick else 96, temperature=0.8, top_p=0.95,
                                                      seed=i, stop=["\nYou:"])))
    out["chat"] = dict(target=BUNDLED, draft=draft_dir, requests=chat, batch=1)
    for streams in (16, 64):
        b = 4 if quick else streams
        out[f"streams{streams}"] = dict(target=BUNDLED, draft=draft_dir, batch=b, requests=[
            (tok.encode(OPENINGS[i % len(OPENINGS)]), SamplingParams(max_new_tokens=8 if quick else 64,
                                                                     temperature=0.8, seed=i)) for i in range(b)])
    for b in (2, 4, 8, 16):  # where speculation stops paying: greedy (accepting) streams, run with --max-batch 64
        out[f"crossover{b}"] = dict(target=BUNDLED, draft=draft_dir, batch=b, requests=[
            (tok.encode(OPENINGS[i % len(OPENINGS)]), SamplingParams(max_new_tokens=16 if quick else 64, temperature=0,
                                                                     stop_at_eos=False)) for i in range(b)])
    for b in (2, 4):  # the same openings sampled (T 0.8, top-p 0.95, seeded): few drafts hold, within the default
        # GPT_SPECULATIVE_MAX_BATCH (4), where the core's priced passes should pause speculation (engine/spec_decode)
        out[f"sampled{b}"] = dict(target=BUNDLED, draft=draft_dir, batch=b, requests=[
            (tok.encode(OPENINGS[i % len(OPENINGS)]), SamplingParams(
                max_new_tokens=16 if quick else 64, temperature=0.8, top_p=0.95, seed=i, stop_at_eos=False))
            for i in range(b)])
    gpt2 = CACHE / "gpt2-random-s0"
    if (gpt2 / "config.json").is_file():
        g = load_checkpoint(gpt2).tokenizer
        from bench.spec_models import GPT2_DRAFT_DIR

        draft = GPT2_DRAFT_DIR if (GPT2_DRAFT_DIR / "config.json").is_file() else None
        out["gpt2"] = dict(target=gpt2, draft=draft, batch=1, requests=[
            (g.encode(p), SamplingParams(max_new_tokens=16 if quick else 96, temperature=0, stop_at_eos=False))
            for p in OPENINGS[:n_req]])
    return out


# ---------------------------------------------------------------------------------------------- running
def build(target: Path, method: str, draft: Path | None, k: int, max_batch: int, n_slots: int, p_min: float,
          compile: str = "auto"):
    """An engine core as the server builds it, its decode steps compiled as `GPT_COMPILE` says (the server's
    default `auto`; waited for, so every repeat runs what a warm server runs: with speculation, the compiled
    verification passes too)."""
    from engine.core import EngineCore
    from engine.spec_decode import parse_speculative
    from model.checkpoint import load_checkpoint

    ck = load_checkpoint(target)
    spec = parse_speculative(method if method != "draft" else f"draft:{draft}", k=k, max_batch=max_batch,
                             draft_p_min=p_min)
    draft_model = load_checkpoint(draft).model if method == "draft" else None
    core = EngineCore(ck.model, n_slots=n_slots, vocab_size=ck.tokenizer.vocab_size, eos_id=ck.tokenizer.eot_id,
                      prepack=True, speculative=spec, draft_model=draft_model, tokenizer=ck.tokenizer,
                      compile=compile)
    core.warmup()
    core.wait_compiled(3600)
    return core, ck.tokenizer


def run_batch1(core, tok, requests) -> dict[str, Any]:
    """Requests one at a time: TTFT and decode time of each, stop strings applied as the server does."""
    from engine.request import EngineRequest
    from engine.stopping import StopMatcher

    ttft, decode_s, decode_tokens, tokens = [], 0.0, 0, []
    for i, (prompt, params) in enumerate(requests):
        core.add(EngineRequest(f"r{i}", prompt, params, seed=params.seed or 0))
        stops = StopMatcher(params.stop) if params.stop else None
        dec = tok.stream_decoder() if stops else None
        t0 = time.perf_counter()
        first = last = None
        got: list[int] = []
        while core.has_work():
            for out in core.step():
                now = time.perf_counter()
                first = first or now
                last = now
                for t in out.token_ids:
                    got.append(t)
                    if stops is not None and stops.feed(dec.feed(t))[1]:
                        core.abort([out.request_id])
                        break
        ttft.append(first - t0)
        decode_s += last - first
        decode_tokens += len(got) - 1
        tokens.append(got)
    return {"ttft_ms": 1000 * median(ttft), "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
            "tokens": tokens, "generated": sum(len(t) for t in tokens)}


def run_streams(core, requests) -> dict[str, Any]:
    from engine.request import EngineRequest

    t0 = time.perf_counter()
    for i, (prompt, params) in enumerate(requests):
        core.add(EngineRequest(f"s{i}", prompt, params, seed=params.seed or 0))
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(requests))}
    first = None
    while core.has_work():
        for out in core.step():
            first = first or time.perf_counter()
            got[out.request_id] += out.token_ids
    wall = time.perf_counter() - t0
    n = sum(len(v) for v in got.values())
    return {"total_tok_s": n / wall, "ttft_ms": 1000 * (first - t0), "tokens": list(got.values()), "generated": n}


def main(argv: list[str] | None = None) -> None:
    from bench.spec_models import COPY_DIR, DRAFT_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", default="copy,repeat,chat,streams16,streams64,gpt2")
    ap.add_argument("--methods", default="off,ngram,draft")
    ap.add_argument("--k", type=int, default=None, help="GPT_NUM_SPECULATIVE_TOKENS (default: the setting's)")
    ap.add_argument("--max-batch", type=int, default=None, help="GPT_SPECULATIVE_MAX_BATCH (default: the setting's)")
    ap.add_argument("--draft-p-min", type=float, default=None, help="GPT_SPECULATIVE_DRAFT_P_MIN (default: the "
                                                                  "setting's)")
    ap.add_argument("--copy-model", type=Path, default=COPY_DIR)
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--compile", default="auto", help="GPT_COMPILE (default: the server's, auto)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke run")
    ap.add_argument("--name", default="speculative", help="the result file: bench/results/NAME.json")
    args = ap.parse_args(argv)
    from engine.spec_decode.config import DEFAULT_DRAFT_P_MIN, DEFAULT_K, DEFAULT_MAX_BATCH

    set_threads(args.threads)
    torch.manual_seed(0)
    info = env_info()
    repeats = 1 if args.quick else args.repeats
    copy_dir = args.copy_model if (args.copy_model / "config.json").is_file() else None
    draft_dir = args.draft if (args.draft / "config.json").is_file() else None
    all_wl = workloads(args.quick, copy_dir, draft_dir)
    max_batch = args.max_batch or DEFAULT_MAX_BATCH
    args.k = args.k or DEFAULT_K
    p_min = DEFAULT_DRAFT_P_MIN if args.draft_p_min is None else args.draft_p_min
    results: dict[str, Any] = {}
    rows = []
    for name in args.workloads.split(","):
        if name not in all_wl:
            print(f"skipping {name}: its model is missing")
            continue
        wl = all_wl[name]
        methods = [m for m in args.methods.split(",") if m != "draft" or wl["draft"] is not None]
        cores = {m: build(wl["target"], m, wl["draft"], args.k, max_batch, wl["batch"], p_min, args.compile)
                 for m in methods}
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(repeats):
            for m in methods:
                core, tok = cores[m]
                r = run_batch1(core, tok, wl["requests"]) if wl["batch"] == 1 else run_streams(core, wl["requests"])
                runs[m].append(r)
        res: dict[str, Any] = {"target": str(wl["target"]), "draft": str(wl["draft"]) if wl["draft"] else None,
                               "batch": wl["batch"], "requests": len(wl["requests"]), "note": wl.get("note")}
        speed = "decode_tok_s" if wl["batch"] == 1 else "total_tok_s"
        for m in methods:
            spec = cores[m][0].speculator
            res[m] = {speed: round(median([r[speed] for r in runs[m]]), 1),
                      "ttft_ms": round(median([r["ttft_ms"] for r in runs[m]]), 2),
                      "runs": [round(r[speed], 1) for r in runs[m]],
                      "generated": runs[m][0]["generated"],
                      "identical_to_off": runs[m][0]["tokens"] == runs["off"][0]["tokens"] if "off" in runs else None,
                      "acceptance": spec.stats() if spec is not None else None,
                      "compiled_decode": cores[m][0].stats()["compiled_decode"]}
            if "off" in runs:
                res[m]["ratio_to_off"] = round(res[m][speed] / res["off"][speed], 3)
            s = res[m]["acceptance"]
            rows.append([name, m, wl["batch"], res[m][speed], res[m].get("ratio_to_off"), res[m]["ttft_ms"],
                         s["acceptance_rate"] if s else None, res[m]["identical_to_off"]])
        results[name] = res
    print_table(["workload", "method", "batch", "tok/s", "x off", "TTFT ms", "acceptance", "same tokens"], rows)
    data = {"benchmark": "speculative", "env": info, "repeats": repeats, "k": args.k, "max_batch": max_batch,
            "draft_p_min": p_min, "compile": args.compile,
            "quick": args.quick, "results": results}
    print(write_result(f"{args.name}-quick" if args.quick else args.name, data))


if __name__ == "__main__":
    main()
