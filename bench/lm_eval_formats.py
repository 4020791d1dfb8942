"""lm-evaluation-harness through the server, once per weight format: what int8 / int4 / bf16 cost in task scores.

    python -m bench.lm_eval_formats [--formats fp32,bf16,int8,int4] [--items 400] [--out lm-eval-formats]

For each format it starts the server as a user would (`python -m app --checkpoint checkpoints/shakespeare --dtype
D --quantize Q`) and runs lm-eval unmodified against it (`local-completions`: echo + logprobs, the server's own
tokenizer through /tokenizer_info), on a local multiple-choice task built from the bundled model's held-out text
(the last 10% of tinyshakespeare, which it never trained on): three lines of a play, then which of four lines of
speech comes next (the true one and three drawn from elsewhere in the split, seeded; never a speaker's name).
Reported per format: accuracy (lm-eval's `acc`, and `acc_norm`, normalised by the choice's length), and against
fp32 the mean and largest |Δ loglikelihood| over every (item, choice) and the share of items whose chosen answer
is the same. Needs lm-eval (`pip install -e ".[eval]"`, docs/evaluation.md); writes bench/results/<out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO, env_info, write_result
from bench.formats import SHAKESPEARE, VAL_BYTES
from bench.harness import Server, free_port

FORMATS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "int8": ("fp32", "int8"), "int4": ("fp32", "int4")}
CKPT = REPO / "checkpoints" / "shakespeare"
TASK = "shakespeare_next_line"
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def next_line_items(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n items from the held-out split: three consecutive lines as context, the fourth among three other lines."""
    text = SHAKESPEARE.read_bytes()[-VAL_BYTES:].decode("utf-8", errors="ignore")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    speech = [ln for ln in lines if not ln.endswith(":")]  # not a speaker's name
    rng = random.Random(seed)
    items = []
    starts = [i for i in range(len(lines) - 4) if not lines[i + 3].endswith(":")]
    for start in rng.sample(starts, n):
        context, true = lines[start:start + 3], lines[start + 3]
        pool = [ln for ln in rng.sample(speech, 12) if ln != true][:3]
        choices = pool + [true]
        rng.shuffle(choices)
        items.append({"context": "\n".join(context) + "\n", "choices": choices, "answer": choices.index(true)})
    return items


def run_format(fmt: str, tasks: Path, out: Path, threads: int | None) -> dict[str, Any]:
    dtype, quantize = FORMATS[fmt]
    port = free_port()
    argv = [sys.executable, "-m", "app", "--checkpoint", str(CKPT), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--dtype", dtype, "--quantize", quantize, "--log-level", "warning"]
    argv += ["--torch-threads", str(threads)] if threads else []
    server = Server(fmt, argv, {}, out.with_suffix(".log"), port)
    server.start()
    try:
        server.wait_ready(300)
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "OPENAI_API_KEY": "unused"}
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"base_url={server.url}/v1/completions,model=shakespeare,max_length=256,num_concurrent=4,"
               "max_retries=1,timeout=300", "--tasks", TASK, "--include_path", str(tasks), "--batch_size", "8",
               "--output_path", str(out), "--log_samples", "--seed", "1234"]
        proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"lm_eval exited with {proc.returncode} against the {fmt} server: {last}")
    finally:
        server.stop()
    (samples,) = list(out.rglob(f"samples_{TASK}_*.jsonl"))
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in rows]
    return {"acc": sum(s["acc"] for s in rows) / len(rows), "acc_norm": sum(s["acc_norm"] for s in rows) / len(rows),
            "loglikelihoods": lls}


def compare(lls: list[list[float]], ref: list[list[float]]) -> dict[str, float]:
    deltas = [abs(a - b) for xs, ys in zip(lls, ref) for a, b in zip(xs, ys)]
    same = sum(max(range(len(xs)), key=xs.__getitem__) == max(range(len(ys)), key=ys.__getitem__)
               for xs, ys in zip(lls, ref))
    return {"mean_abs_delta_ll": round(sum(deltas) / len(deltas), 5), "max_abs_delta_ll": round(max(deltas), 4),
            "same_choice": round(same / len(ref), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lm_eval_formats", description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="lm-eval-formats")
    args = p.parse_args(argv)
    fmts = args.formats.split(",")
    unknown = [f for f in fmts if f not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {', '.join(unknown)}: use {', '.join(FORMATS)}")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("error: lm-eval is not installed: pip install -e '.[eval]' (docs/evaluation.md)", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tasks = Path(d) / "tasks"
        tasks.mkdir()
        data = Path(d) / "items.jsonl"
        data.write_text("".join(json.dumps(it) + "\n" for it in next_line_items(args.items)))
        (tasks / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=data))
        for f in fmts:
            try:
                results[f] = run_format(f, tasks, Path(d) / f, args.threads)
            except RuntimeError as e:  # the server did not start, or lm_eval failed: one line, not a traceback
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(f"{f}: acc {results[f]['acc']:.3f} acc_norm {results[f]['acc_norm']:.3f}", flush=True)
    ref = results.get("fp32")
    summary: dict[str, Any] = {}
    for f, r in results.items():  # the per-choice loglikelihoods stay out of the file (~50 KB a format)
        summary[f] = {k: v for k, v in r.items() if k != "loglikelihoods"}
        if ref is not None and f != "fp32":
            summary[f]["vs_fp32"] = compare(r["loglikelihoods"], ref["loglikelihoods"])
        print(f, summary[f])
    data = {"env": env_info(), "model": "checkpoints/shakespeare", "task": f"{TASK}: {args.items} items, 4 choices",
            "chance": 0.25, "formats": summary}
    print(f"wrote {write_result(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
