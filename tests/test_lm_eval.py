"""lm-evaluation-harness, unmodified (pinned in the `eval` extra), scores the bundled checkpoint through our server
(`local-completions`: echo + logprobs for loglikelihoods, /tokenizer_info + /tokenize as its remote tokenizer,
greedy completions for generation) and through its own `hf` backend on the same weights exported by
`model.export_hf`. Both runs must give the same answers, and loglikelihoods within 1e-4 (fp32).

The tasks are local (task YAML + JSONL data written into the test's tmp dir), so nothing is downloaded. Slow:
two lm_eval runs of ~30 s each; `make test-slow` installs lm-eval first (docs/evaluation.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app_helpers import start_app_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (make test-slow installs .[eval])")

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "checkpoints" / "shakespeare"

MC = [  # multiple choice: which continuation is the Shakespeare model's
    {"question": "ROMEO: But soft, what light through yonder", "choices": [" window breaks", " banana phone",
                                                                         " quantum flux"], "answer": 0},
    {"question": "JULIET: O Romeo, Romeo! wherefore art thou", "choices": [" Romeo?", " a toaster?",
                                                                          " 42 km away?"], "answer": 0},
    {"question": "KING RICHARD III: A horse! a horse! my kingdom for a", "choices": [" horse!", " sandwich!",
                                                                                     " laptop!"], "answer": 0},
    {"question": "HAMLET: To be, or not to be, that is the", "choices": [" question:", " printer:", " zebra:"],
     "answer": 0},
    {"question": "First Citizen:\nBefore we proceed any further, hear me", "choices": [" speak.", " compile.",
                                                                                       " download."], "answer": 0},
]
GEN = [  # greedy generation up to a newline
    {"prompt": "ROMEO:\n", "target": "I"},
    {"prompt": "First Citizen:\nWe are accounted poor citizens, the patricians", "target": " good."},
    {"prompt": "KING HENRY:\nWhat is thy", "target": " name?"},
]

MC_YAML = """task: gptserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_YAML = """task: gptserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


def write_tasks(d: Path) -> Path:
    tasks = d / "tasks"
    tasks.mkdir()
    for name, rows, yaml in (("mc", MC, MC_YAML), ("gen", GEN, GEN_YAML)):
        data = d / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    return tasks


def run_lm_eval(model: str, model_args: str, tasks: Path, out: Path) -> tuple[dict[str, list[dict]], str]:
    """`python -m lm_eval` as a user runs it: the per-sample records of each task, and its log."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "OPENAI_API_KEY": "unused"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--tasks", "gptserve_mc,gptserve_gen", "--include_path", str(tasks), "--batch_size", "1",
           "--output_path", str(out), "--log_samples", "--seed", "1234", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples: dict[str, list[dict]] = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert set(samples) == {"gptserve_mc", "gptserve_gen"}, (list(out.rglob("*")), proc.stderr[-2000:])
    return samples, proc.stderr


def test_lm_eval_through_the_server_equals_its_hf_backend(tmp_path):
    hf_dir = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "model.export_hf", "--checkpoint", str(CKPT), "--out", str(hf_dir)],
                   cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    tasks = write_tasks(tmp_path)
    proc, url = start_app_process(CKPT, "--dtype", "fp32", "--max-batch-size", "4")
    try:
        # tokenizer_backend left to "auto": lm-eval finds /tokenizer_info and /tokenize and uses them
        served, log = run_lm_eval("local-completions", f"base_url={url}/v1/completions,model=shakespeare,"
                             "max_length=256,num_concurrent=1,max_retries=1,timeout=120", tasks, tmp_path / "api")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert "Using tokenizer remote" in log  # our /tokenizer_info and /tokenize passed lm-eval's checks
    local, _ = run_lm_eval("hf", f"pretrained={hf_dir},dtype=float32", tasks, tmp_path / "hf_out")

    mc_served, mc_local = served["gptserve_mc"], local["gptserve_mc"]
    assert len(mc_served) == len(mc_local) == len(MC)
    for a, b in zip(mc_served, mc_local):
        # resps: per choice [[loglikelihood, is_greedy]] (written as strings)
        lls_a = [float(r[0][0]) for r in a["resps"]]
        lls_b = [float(r[0][0]) for r in b["resps"]]
        assert lls_a == pytest.approx(lls_b, abs=1e-4), (a["doc"], lls_a, lls_b)
        assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]
        assert a["acc"] == b["acc"]
        assert max(range(len(lls_a)), key=lls_a.__getitem__) == max(range(len(lls_b)), key=lls_b.__getitem__)
    gen_served, gen_local = served["gptserve_gen"], local["gptserve_gen"]
    assert [s["filtered_resps"] for s in gen_served] == [s["filtered_resps"] for s in gen_local]
    assert all(s["filtered_resps"][0] for s in gen_served)  # something was generated
    assert sum(s["acc"] for s in mc_served) >= 3  # the model prefers Shakespeare: the scores mean something
