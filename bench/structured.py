"""Structured output: what a grammar-constrained step costs next to an unconstrained one.

    python -m bench.structured [--models gpt2,stack] [--batches 1,16,64] [--steps 32] [--repeats 3]
                               [--threads 2] [--device cpu] [--baseline-rev main] [--out structured]

Per model (`gpt2`: a random GPT-2 124M, bench.common.random_gpt2; `stack`: the stack-ceiling model of
bench/stack.py, one layer, n_embd 64, GPT-2's vocabulary) and batch size B, an engine core
(`engine.core.EngineCore`, B slots, the server's layout: padded vocabulary, CUDA graphs on CUDA) is given
B requests (temperature 0.8, seeded, a ~32-token prompt, <|endoftext|> not stopping them) and, after their
prefill and 2 warm steps, `--steps` decode steps are timed one by one. Modes:
- `none`: no request constrained (the reference: unconstrained sampling);
- `none_used`: the same, in a core that has served a constrained request before (its matchers exist), so the
  cost of the feature when a batch does not use it;
- `one`: 1 of the B requests constrained by the ~10-field JSON schema `record` (SCHEMAS); `all`: all B.
- `baseline` (with `--baseline-rev`, default `main`): mode `none` with the `model` package of that revision
  (`git archive`), in a subprocess: the engine before this feature.
Cells are interleaved per repeat (baseline, none, none_used, one, all, ...), so drift hits them alike.
Reported per cell: ms per decode step (median of the repeats' medians), tokens/s (B / step time), and the ratios
to `none`; the goals: `none` vs `baseline` and `none_used` vs `none` within 2% (unchanged when unused), and
tokens/s of `all` ≥ 0.7 × `none` at B = 64 on the stack-ceiling model. Only steps where all B requests are still
running count (`rows_min` says if some finished early).

Then the grammar compile time per schema (cold: a fresh cache each time; the library's tokenizer built once)
on GPT-2's vocabulary and the bundled model's.

Writes bench/results/<out>.json and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, env_info, median, print_table, random_gpt2, set_threads, write_result

# name → (schema, a document that satisfies it). Tests sample these too (tests/test_structured_output.py).
SCHEMAS: dict[str, tuple[dict, Any]] = {
    "object": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                "required": ["name", "age"], "additionalProperties": False},
               {"name": "Romeo", "age": 16}),
    "array": ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
               "minItems": 1, "maxItems": 4},
              [3, 14, 15]),
    "enum": ({"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "angry"]},
                                                "ok": {"type": "boolean"}},
              "required": ["mood", "ok"], "additionalProperties": False},
             {"mood": "sad", "ok": True}),
    "nested": ({"type": "object", "properties": {
                   "play": {"type": "object", "properties": {
                       "title": {"type": "string", "maxLength": 16},
                       "acts": {"type": "array", "items": {"type": "object", "properties": {
                           "n": {"type": "integer", "minimum": 1, "maximum": 5}},
                           "required": ["n"], "additionalProperties": False}, "maxItems": 2}},
                       "required": ["title", "acts"], "additionalProperties": False}},
                "required": ["play"], "additionalProperties": False},
               {"play": {"title": "Hamlet", "acts": [{"n": 1}, {"n": 2}]}}),
    "pattern": ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                   "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
                 "required": ["code", "date"], "additionalProperties": False},
                {"code": "AB-123", "date": "2024-07"}),
    "numbers": ({"type": "object", "properties": {
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "count": {"type": "integer", "minimum": -5, "maximum": 5},
                    "year": {"type": "integer", "exclusiveMinimum": 1900, "exclusiveMaximum": 2100}},
                 "required": ["score", "count", "year"], "additionalProperties": False},
                {"score": 0.5, "count": -3, "year": 1999}),
    # ~10 fields of every kind: the benchmark's schema
    "record": ({"type": "object", "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
                    "name": {"type": "string", "maxLength": 20},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                    "active": {"type": "boolean"},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 100},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                                 "zip": {"type": "string",
                                                                         "pattern": "^[0-9]{5}$"}},
                                "required": ["city", "zip"], "additionalProperties": False},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "note": {"type": ["string", "null"], "maxLength": 24}},
                "required": ["id", "name", "email", "active", "role", "score", "tags", "address", "age", "note"],
                "additionalProperties": False},
               {"id": 7, "name": "Juliet", "email": "jc@verona.org", "active": True, "role": "user", "score": 99.5,
                "tags": ["a", "b"], "address": {"city": "Verona", "zip": "37121"}, "age": 13, "note": None}),
}
BENCH_SCHEMA = "record"
PROMPT = ("The service had been running for three days when the first request for a longer story arrived, "
          "and the operators, who had expected nothing like it, gathered to watch")
MODES = ("none", "none_used", "one", "all")


# ---------------------------------------------------------------------------------------------- one cell
def checkpoint_of(name: str) -> Path:
    if name == "gpt2":
        return random_gpt2()[1]
    if name == "stack":
        from bench.stack import tiny_gpt

        return tiny_gpt()
    return Path(name)


def time_cell(ckpt_dir: str, batch: int, mode: str, steps: int, device: str, dtype: str | None) -> dict[str, Any]:
    """Decode `steps` steps of `batch` requests in a fresh core; `mode` says which are constrained. Imports the
    `model` package it finds first on sys.path (the baseline's in a baseline subprocess)."""
    import torch

    from engine.core import EngineCore
    from engine.params import SamplingParams
    from engine.request import EngineRequest
    from model.checkpoint import load_checkpoint

    dt = getattr(torch, dtype) if dtype else None
    ck = load_checkpoint(ckpt_dir, device=device, dtype=dt)
    tok = ck.tokenizer
    kw = {"tokenizer": tok} if mode != "baseline" else {}
    core = EngineCore(ck.model, n_slots=batch, vocab_size=tok.vocab_size, eos_id=tok.eot_id, **kw)
    core.warmup()
    prompt = tok.encode(PROMPT)[:32]
    params = lambda: SamplingParams(max_new_tokens=steps + 8, temperature=0.8, stop_at_eos=False)  # noqa: E731
    spec = None
    if mode in ("none_used", "one", "all"):
        from engine.request import StructuredSpec

        spec = StructuredSpec("json_schema", json.dumps(SCHEMAS[BENCH_SCHEMA][0]))
    if mode == "none_used":  # serve one constrained request first: the core's matchers exist from then on
        core.add(EngineRequest("warm", prompt, params(), seed=0, structured=spec))
        while core.has_work():
            core.step()
    n_constrained = {"one": 1, "all": batch}.get(mode, 0)
    for i in range(batch):
        kw = {"structured": spec} if i < n_constrained else {}  # (the baseline's EngineRequest has no such field)
        core.add(EngineRequest(str(i), prompt, params(), seed=i, **kw))
    sync = torch.cuda.synchronize if ck.model.lm_head.weight.is_cuda else (lambda: None)
    for _ in range(3):  # the prefill step, then 2 warm decode steps
        core.step()
    times, rows_min = [], batch
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        core.step()
        sync()
        running = core.scheduler.n_running
        if running == batch:
            times.append(time.perf_counter() - t)
        rows_min = min(rows_min, running)
    ms = 1000 * median(times) if times else None
    return {"ms": ms, "steps_timed": len(times), "rows_min": rows_min}


def baseline_tree(rev: str) -> Path | None:
    """The `model` package of `rev`, extracted under a temporary directory (None if git cannot)."""
    d = Path(tempfile.mkdtemp(prefix="bench-structured-base-"))
    try:
        data = subprocess.run(["git", "archive", rev, "model"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    tar = d / "model.tar"
    tar.write_bytes(data)
    with tarfile.open(tar) as t:
        t.extractall(d, filter="data")
    return d


def baseline_cell(tree: Path, args: argparse.Namespace, ckpt: str, batch: int) -> dict[str, Any]:
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import torch; "
            "torch.set_num_threads(int(sys.argv[7])); from bench.structured import time_cell; "
            "print(json.dumps(time_cell(sys.argv[3], int(sys.argv[4]), 'baseline', int(sys.argv[5]), sys.argv[6], "
            "sys.argv[8] or None)))")
    r = subprocess.run([sys.executable, "-c", code, str(tree), str(REPO), ckpt, str(batch), str(args.steps),
                        args.device, str(args.threads), args.dtype or ""], capture_output=True, text=True,
                       cwd=tree, env={**os.environ, "PYTHONPATH": ""})
    if r.returncode != 0:
        return {"ms": None, "error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed"}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- compile time
def compile_times(repeats: int) -> dict[str, Any]:
    from engine.request import StructuredSpec
    from engine.structured_output import Grammars
    from model.tokenizer import Tokenizer

    out: dict[str, Any] = {}
    for tname in ("r50k_base", "shakespeare"):
        tok = (Tokenizer.named(tname) if tname != "shakespeare" else
               Tokenizer.from_ranks_file(REPO / "checkpoints" / "shakespeare" / "shakespeare.tiktoken"))
        t0 = time.perf_counter()
        g = Grammars(tok)
        row: dict[str, Any] = {"tokenizer_s": round(time.perf_counter() - t0, 3)}
        for name, (schema, _) in SCHEMAS.items():
            ts = []
            for _ in range(repeats):
                g._cache.clear()
                t = time.perf_counter()
                g.compile(StructuredSpec("json_schema", json.dumps(schema)))
                ts.append(time.perf_counter() - t)
            row[name] = round(1000 * median(ts), 3)
        out[tname] = row
    return out


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,stack", help="gpt2, stack, or checkpoint directories")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    ap.add_argument("--baseline-rev", default="main", help="'' to skip the baseline")
    ap.add_argument("--out", default="structured")
    args = ap.parse_args()
    args.threads = set_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    tree = baseline_tree(args.baseline_rev) if args.baseline_rev else None
    results: dict[str, Any] = {}
    for mname in args.models.split(","):
        ckpt = str(checkpoint_of(mname))
        for b in batches:
            cell: dict[str, list] = {}
            for _ in range(args.repeats):
                if tree is not None:
                    cell.setdefault("baseline", []).append(baseline_cell(tree, args, ckpt, b))
                for mode in MODES:
                    cell.setdefault(mode, []).append(time_cell(ckpt, b, mode, args.steps, args.device, args.dtype))
            row: dict[str, Any] = {}
            for mode, runs in cell.items():
                ms = [r["ms"] for r in runs if r.get("ms")]
                row[mode] = {"ms": round(median(ms), 3) if ms else None, "ms_all": [r.get("ms") for r in runs],
                             "tok_s": round(1000 * b / median(ms), 1) if ms else None,
                             "rows_min": min(r.get("rows_min", b) for r in runs),
                             **({"error": runs[0]["error"]} if "error" in runs[0] else {})}
            ref = row["none"]["tok_s"]
            for mode in row:
                if ref and row[mode]["tok_s"]:
                    row[mode]["vs_none"] = round(row[mode]["tok_s"] / ref, 3)
            results[f"{mname}/B{b}"] = {"model": mname, "batch": b, **row}
            print(mname, b, {m: row[m]["ms"] for m in row}, flush=True)
    goals: dict[str, Any] = {}
    stack64 = results.get("stack/B64")
    if stack64 and stack64["all"].get("vs_none"):
        goals["all_64_vs_unconstrained_stack"] = stack64["all"]["vs_none"]
        goals["all_64_goal_0.7_met"] = stack64["all"]["vs_none"] >= 0.7
    unused = [r["none_used"]["vs_none"] for r in results.values() if r["none_used"].get("vs_none")]
    base = [r["none"]["tok_s"] / r["baseline"]["tok_s"] for r in results.values()
            if r.get("baseline", {}).get("tok_s") and r["none"]["tok_s"]]
    if unused:
        goals["none_used_vs_none_worst"] = min(unused)
    if base:
        goals["none_vs_baseline_worst"] = round(min(base), 3)
        goals["unchanged_when_unused_goal_met"] = min(base) >= 0.98 and (not unused or min(unused) >= 0.98)
    compile_ms = compile_times(args.repeats)
    modes = (["baseline"] if tree is not None else []) + list(MODES)
    print_table(["model", "B", *[f"{m} ms" for m in modes], "one/none", "all/none"],
                [[r["model"], r["batch"], *[r[m]["ms"] for m in modes], r["one"].get("vs_none", ""),
                  r["all"].get("vs_none", "")] for r in results.values()])
    print_table(["tokenizer", "tokenizer_s", *SCHEMAS], [[t, v["tokenizer_s"], *[v[s] for s in SCHEMAS]]
                                                         for t, v in compile_ms.items()])
    print("goals:", json.dumps(goals))
    path = write_result(args.out, {**env_info(), "benchmark": "structured", "threads": args.threads,
                                   "device": args.device, "dtype": args.dtype, "steps": args.steps,
                                   "repeats": args.repeats, "baseline_rev": args.baseline_rev or None,
                                   "schema": SCHEMAS[BENCH_SCHEMA][0], "results": results, "goals": goals,
                                   "compile_ms": compile_ms})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
