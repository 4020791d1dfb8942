"""`make gpu-check`: the first-run verification of a CUDA machine, in one command.

    python -m bench.gpu_check [--new-tokens 64] [--batches 1,16,64] [--out gpu-check] [--tolerance 0.1]

Stages, in order; the first that fails ends the run with one line on stderr (exit 1), the report says how far it got:
1. cuda      torch sees a CUDA device (a CPU build or a driver too old for the build fails here);
2. tests     the CUDA tests (`pytest -m "not slow" -k "cuda or graph or device"`: graph replays equal eager decoding
             without host syncs, ...);
3. serve     `python -m app` on the GPU with its defaults (the random GPT-2 124M of bench.common): start-up with
             warm-up and CUDA graphs captured (/info says so), a /generate and a /generate_stream request;
4. engine    the engine core, bf16, CUDA graphs on and off side by side at each batch: decode tok/s, time to first
             token, and greedy tokens compared by a tolerance on log-probabilities (`compare_greedy`): random
             bf16 weights have near-ties, and the graph and eager steps run different attention kernels, so the
             first differing token is accepted when the graphs-off run found it within `tolerance` nats of its own
             choice (the sequences part there and are not compared further);
5. train     a few steps of training.train on a tiny corpus, bf16 autocast;
6. finetune  a few steps of training.finetune from that checkpoint, bf16 autocast.

One JSON report: bench/results/<out>.json. The pieces are importable; tests/test_gpu_check.py runs on CPU what can
run there (the stage runner, the comparison, the report, the no-CUDA exit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import REPO, env_info, random_gpt2, write_result

TOLERANCE = 0.1  # nats: bf16 logits of a GPT-2 124M differ by a few hundredths between attention kernels


class CheckFailed(Exception):
    """A stage's failure, in one line."""


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_stages(stages: list[tuple[str, Callable[[], dict]]], report: dict) -> str | None:
    """Run stages in order into report["stages"]; stop at the first failure and return its one line (None: all
    passed). A stage returns a dict of results or raises (CheckFailed: its own words)."""
    report.setdefault("stages", {})
    report["ok"] = False
    for name, run in stages:
        t0 = time.perf_counter()
        try:
            result = run()
        except Exception as e:  # noqa: BLE001 -- any failure is a stage failure, said in one line
            msg = str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
            line = one_line(f"gpu-check failed at {name}: {msg}")
            report["stages"][name] = {"ok": False, "error": line, "seconds": round(time.perf_counter() - t0, 2)}
            report["failed"] = name
            return line
        report["stages"][name] = {"ok": True, **(result or {}), "seconds": round(time.perf_counter() - t0, 2)}
    report["ok"] = True
    return None


def require_cuda() -> dict:
    import torch

    if not torch.cuda.is_available():
        raise CheckFailed(f"needs a CUDA device and a CUDA build of torch (torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda}: torch.cuda.is_available() is False)")
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "capability": list(torch.cuda.get_device_capability())}


def run_tests() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-k",
                           "cuda or graph or device", "tests/"], cwd=REPO, capture_output=True, text=True)
    tail = proc.stdout[-2000:]
    if proc.returncode != 0:
        raise CheckFailed(f"the CUDA tests failed: {tail.strip().splitlines()[-1] if tail.strip() else proc.stderr}")
    return {"tail": tail.strip().splitlines()[-1] if tail.strip() else ""}


# ---------------------------------------------------------------------------------------------- serve
def serve_check(ck_dir: Path, timeout: float = 600) -> dict:
    """`python -m app` with its defaults on this machine (device auto → the GPU), then /info and two requests."""
    import httpx

    from bench.harness import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "app", "--checkpoint", str(ck_dir), "--host", "127.0.0.1",
                             "--port", str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    t0 = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise CheckFailed(f"python -m app exited with {proc.returncode}: {log.read()[-300:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise CheckFailed(f"python -m app not ready after {timeout:.0f} s")
            time.sleep(0.5)
        ready_s = time.perf_counter() - t0
        info = httpx.get(url + "/info", timeout=10).json()
        engine = info.get("engine") or {}
        if info.get("model_device_type") != "cuda":
            raise CheckFailed(f"the server runs on {info.get('device')!r}, not the GPU")
        if not engine.get("cuda_graphs"):
            raise CheckFailed("the server decodes without CUDA graphs (their capture failed or was refused at "
                              "warm-up: see its log)")
        params = {"max_new_tokens": 16, "temperature": 0}
        r = httpx.post(url + "/generate", json={"inputs": "The first request", "parameters": params}, timeout=60)
        if r.status_code != 200 or not r.json().get("generated_text"):
            raise CheckFailed(f"/generate answered {r.status_code}: {r.text[:200]}")
        events = []
        with httpx.stream("POST", url + "/generate_stream", json={"inputs": "A streamed request",
                                                                  "parameters": params}, timeout=60) as s:
            if s.status_code != 200:
                raise CheckFailed(f"/generate_stream answered {s.status_code}")
            events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
        if len(events) != params["max_new_tokens"] or not events[-1].get("generated_text"):
            raise CheckFailed(f"/generate_stream gave {len(events)} events, not {params['max_new_tokens']} ending "
                              f"in the text")
        return {"ready_s": round(ready_s, 1), "device": info.get("device"), "dtype": info.get("dtype"),
                "cuda_graphs": engine.get("cuda_graphs"), "max_batch_size": info.get("max_batch_size"),
                "generated_text": r.json()["generated_text"], "stream_events": len(events)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ---------------------------------------------------------------------------------------------- engine
def compare_greedy(on: list[tuple[int, float]], off: list[tuple[int, float, list[tuple[int, float]]]],
                   tol: float = TOLERANCE) -> dict:
    """Greedy tokens of a graphs-on run against a graphs-off one, by log-probabilities: `on` is (token, logprob)
    per step, `off` (token, logprob, top alternatives) per step. Up to the first differing token both runs must
    give the same tokens with log-probabilities within tol; at it, the graphs-off run must have found the graphs-on
    token within tol of its own (a near-tie, not a bug). After it the sequences part and are not compared."""
    worst = 0.0
    for i, ((t_on, lp_on), (t_off, lp_off, top)) in enumerate(zip(on, off)):
        if t_on == t_off:
            worst = max(worst, abs(lp_on - lp_off))
            if abs(lp_on - lp_off) > tol:
                return {"agree": False, "step": i, "max_logprob_diff": round(worst, 4),
                        "reason": f"step {i}: token {t_on} has logprob {lp_on:.4f} with graphs, {lp_off:.4f} without"}
            continue
        alt = dict(top).get(t_on)
        gap = None if alt is None else lp_off - alt
        ok = gap is not None and gap <= tol
        return {"agree": ok, "step": i, "first_mismatch": i, "gap": None if gap is None else round(gap, 4),
                "max_logprob_diff": round(worst, 4),
                "reason": "" if ok else (f"step {i}: graphs chose {t_on}, which the eager run does not rank near its "
                                         f"{t_off} ({'not in its top' if gap is None else f'{gap:.4f} nats below'})")}
    if len(on) != len(off):
        return {"agree": False, "step": min(len(on), len(off)), "max_logprob_diff": round(worst, 4),
                "reason": f"{len(on)} tokens with graphs, {len(off)} without"}
    return {"agree": True, "step": len(on), "first_mismatch": None, "max_logprob_diff": round(worst, 4), "reason": ""}


def engine_run(ck_dir: Path, batch: int, new_tokens: int, graphs: bool, top_n: int = 5) -> dict:
    import torch

    from engine.core import EngineCore
    from engine.params import SamplingParams
    from engine.request import EngineRequest
    from model.checkpoint import load_checkpoint

    ck = load_checkpoint(ck_dir, device="cuda", dtype=torch.bfloat16)
    core = EngineCore(ck.model, n_slots=max(batch, 1), vocab_size=ck.tokenizer.vocab_size, eos_id=None,
                      cuda_graphs=graphs)
    core.warmup()
    if core.warmup_error:
        raise CheckFailed(core.warmup_error)
    if graphs and not core.stats()["cuda_graphs"]:
        raise CheckFailed(f"CUDA graphs were not captured at batch {batch} (see the log)")
    prompt = ck.tokenizer.encode("The service had been running for three days when the first request arrived")
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    steps: dict[str, list] = {}
    for r in range(2):  # the first round warms the allocator and the graph buckets up
        for i in range(batch):
            core.add(EngineRequest(f"{r}-{i}", prompt, params, seed=i, top_n=top_n if i == 0 else 0))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = None
        n = 0
        while core.has_work():
            outs = core.step()
            n += sum(len(o.token_ids) for o in outs)
            if first is None and outs:
                first = time.perf_counter() - t0
            for o in outs:
                if o.error is not None:
                    raise CheckFailed(f"request {o.request_id} failed: {o.message}")
                tops = o.top or [[]] * len(o.token_ids)
                steps.setdefault(o.request_id, []).extend(zip(o.token_ids, o.logprobs, tops))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    del core, ck
    torch.cuda.empty_cache()
    return {"batch": batch, "cuda_graphs": graphs, "tok_s": round(n / wall, 1), "ttft_ms": round(1000 * first, 2),
            "wall_s": round(wall, 3), "first_request": steps.get("1-0", [])}


def engine_check(ck_dir: Path, batches: list[int], new_tokens: int, tol: float) -> dict:
    rows = []
    for b in batches:
        on = engine_run(ck_dir, b, new_tokens, True)
        off = engine_run(ck_dir, b, new_tokens, False)
        cmp = compare_greedy([(t, lp) for t, lp, _ in on["first_request"]], off["first_request"], tol)
        for row in (on, off):
            row["tokens_first_request"] = [t for t, _, _ in row.pop("first_request")]
        print(f"batch {b:3d}: graphs on {on['tok_s']:9.1f} tok/s (TTFT {on['ttft_ms']} ms), off {off['tok_s']:9.1f} "
              f"tok/s (TTFT {off['ttft_ms']} ms); tokens {'agree' if cmp['agree'] else 'DIFFER'} "
              f"(first mismatch {cmp.get('first_mismatch')})", flush=True)
        rows.append({"batch": b, "graphs_on": on, "graphs_off": off, "comparison": cmp})
        if not cmp["agree"]:
            raise CheckFailed(f"batch {b}: graphs-on tokens differ from graphs-off beyond {tol} nats: {cmp['reason']}")
    return {"dtype": "bf16", "tolerance_nats": tol, "results": rows}


# ---------------------------------------------------------------------------------------------- training
def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise CheckFailed(f"python -m {module} exited with {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return proc


def last_event(run_dir: Path, kind: str) -> dict:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    found = [e for e in events if e.get("event") == kind]
    if not found:
        raise CheckFailed(f"{run_dir / 'metrics.jsonl'} has no {kind!r} event")
    return found[-1]


def train_check(work: Path, steps: int = 6, device: str = "cuda") -> dict:
    """A few steps of training.train on the GPU with bf16 autocast (fp32 on a CPU: the offline check's dry run),
    from a tiny corpus and tokenizer."""
    words = "the a my thy love night day sweet fair death light star heaven hath doth art thou shall".split()
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(8)) for i in range(400)))
    cli("training.tokenizer", "--input", str(corpus), "--vocab-size", "300", "--out", str(work / "tok.tiktoken"),
        "--quiet")
    cli("training.prepare", "--input", str(corpus), "--out", str(work / "prepared"), "--tokenizer",
        str(work / "tok.tiktoken"), "--quiet")
    out = work / "train"
    sets = ["n_layer=2", "n_head=2", "n_embd=64", "block_size=64", "batch_size=8", "eval_iters=2", "log_interval=1",
            f"max_iters={steps}", f"eval_interval={steps}", f"device={device}", f"dtype={train_dtype(device)}",
            "sample_tokens=8"]
    cli("training.train", "--quiet", "--data", str(work / "prepared"), "--out", str(out),
        *[x for s in sets for x in ("--set", s)])
    start, train = last_event(out, "start"), last_event(out, "train")
    if device == "cuda" and not start.get("bf16"):
        raise CheckFailed("training did not run under bf16 autocast")
    loss = train.get("loss")
    if loss is None or loss != loss:
        raise CheckFailed(f"training loss is {loss}")
    return {"steps": train.get("step"), "loss": loss, "device": start.get("device"), "checkpoint": str(out / "best"),
            "tokens_per_s": train.get("tokens_per_s")}


def train_dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def finetune_check(work: Path, base: Path, steps: int = 6, device: str = "cuda") -> dict:
    """A few steps of training.finetune (classification) from the train stage's checkpoint, bf16 autocast."""
    import random

    rng = random.Random(0)
    words = "apple river stone cloud quiet green table window paper light".split()
    for name, n in (("train", 64), ("val", 32)):
        rows = []
        for _ in range(n):
            ws = rng.choices(words, k=6)
            rows.append({"text": " ".join(ws), "label": "yes" if "quiet" in ws else "no"})
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = work / "finetune"
    sets = ["batch_size=8", "log_interval=1", f"max_iters={steps}", f"eval_interval={steps}", f"device={device}",
            f"dtype={train_dtype(device)}", "sample_tokens=0"]
    cli("training.finetune", "--quiet", "--task", "classification", "--train", str(work / "train.jsonl"), "--val",
        str(work / "val.jsonl"), "--init-from", str(base), "--out", str(out), *[x for s in sets for x in ("--set", s)])
    ev = last_event(out, "eval")
    return {"steps": ev.get("step"), "val_acc": ev.get("val_acc"), "val_loss": ev.get("val_loss"),
            "checkpoint": str(out / "best")}


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="nats (see compare_greedy)")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {**env_info(), "benchmark": "gpu-check"}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    ck: dict[str, Path] = {}

    def checkpoint() -> Path:
        if "gpt2" not in ck:
            ck["gpt2"] = random_gpt2()[1]
        return ck["gpt2"]

    stages = [
        ("cuda", require_cuda),
        ("tests", run_tests),
        ("serve", lambda: serve_check(checkpoint())),
        ("engine", lambda: engine_check(checkpoint(), [int(x) for x in args.batches.split(",")], args.new_tokens,
                                        args.tolerance)),
        ("train", lambda: train_check(work)),
        ("finetune", lambda: finetune_check(work, Path(report["stages"]["train"]["checkpoint"]))),
    ]
    try:
        failure = run_stages(stages, report)
    finally:  # the stages' checkpoints and training runs: what they found is in the report
        shutil.rmtree(work, ignore_errors=True)
    path = write_result(args.out, report)
    if failure is not None:
        print(f"{failure} (report: {path})", file=sys.stderr)
        return 1
    print(f"gpu-check passed; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
