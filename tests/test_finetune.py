"""training/finetune.py (and its loop, training/task/loop.py, and data, training/task/data.py): a learnable
generated task reaches >= 95% validation accuracy, resume is bit-exact, the result is a normal checkpoint with
a task head, and bad input is one line naming FILE:LINE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.generate import SamplingParams, generate
from model.checkpoint import TRAINING_STATE, load_checkpoint, save_checkpoint
from model.task_head import HEAD_FILE, load_task
from model.tokenizer import Tokenizer
from tests.helpers import tiny_model, write_byte_ranks
from tests.task_fixtures import one_line_error, word_task_lines, write_jsonl, write_task_checkpoint
from training.config import ConfigError, FinetuneConfig, build_config
from training.example_sampler import ExampleSampler
from training.task.data import TaskDataError, read_task_file

REPO = Path(__file__).resolve().parents[1]
TINY = ["learning_rate=3e-3", "min_lr=3e-4", "warmup_iters=5", "batch_size=16", "log_interval=5", "num_threads=1",
        "dropout=0.1"]


def sets(*items: str) -> list[str]:
    return [x for item in (*TINY, *items) for x in ("--set", item)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ft")
    ranks = write_byte_ranks(d / "bytes.tiktoken", [b"th", b"he"])
    tok = Tokenizer.from_ranks_file(ranks)
    base = save_checkpoint(d / "base", tiny_model(seed=0, vocab_size=tok.vocab_size, block_size=48), tok,
                           tokenizer_file=ranks)
    return {"base": base, "train": write_jsonl(d / "train.jsonl", word_task_lines(300, seed=1)),
            "val": write_jsonl(d / "val.jsonl", word_task_lines(100, seed=2))}


def finetune(files, out: Path, *args: str, task: str = "classification", train=None, val=None) -> int:
    from training.finetune import main

    return main(["--quiet", "--task", task, "--train", str(train or files["train"]), "--val", str(val or files["val"]),
                 "--out", str(out), *args])


def events(out: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def test_learns_a_learnable_task_and_saves_a_normal_checkpoint_with_a_head(tmp_path, files):
    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(files["base"]), *sets("max_iters=80", "eval_interval=40",
                                                                         "dropout=0.0")) == 0
    evals = events(out, "eval")
    assert [e["step"] for e in evals] == [0, 40, 80]
    assert evals[-1]["val_acc"] >= 0.95 and evals[-1]["majority_acc"] == 0.5
    assert evals[0]["train_loss"] is None and evals[-1]["train_acc"] > 0.9
    assert {"val_loss", "val_lm_loss", "best_val_acc"} <= set(evals[-1])
    train = events(out, "train")
    assert len(train) == 16 and {"loss", "task_loss", "lm_loss", "lr"} <= set(train[-1])
    assert train[-1]["loss"] == pytest.approx(train[-1]["task_loss"] + 0.5 * train[-1]["lm_loss"], rel=1e-5)
    assert (out / "loss.png").is_file()

    best = out / "best"
    ck = load_checkpoint(best)  # a normal checkpoint: it loads and generates
    assert ck.metadata["val_acc"] == max(e["val_acc"] for e in evals) and ck.metadata["task"] == "classification"
    assert ck.config.vocab_size == ck.tokenizer.vocab_size == 259 + 3  # 258 ranks + <|endoftext|> + 3 task tokens
    seq = generate(ck.model, ck.tokenizer, [ck.tokenizer.encode("the")], SamplingParams(max_new_tokens=6, seed=0))[0]
    assert len(seq.tokens) >= 1
    task = load_task(best, ck.model)
    assert task.kind == "classification" and task.labels == ["no", "yes"]
    probs = task.predict(ck.model, ck.tokenizer, ["apple quiet lemon", "apple mango lemon"])
    assert probs[0]["yes"] > 0.5 and probs[1]["no"] > 0.5
    assert not (best / TRAINING_STATE).exists() and (out / "last" / TRAINING_STATE).exists()


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, files):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("eval_interval=3", "lr_decay_iters=8", "grad_accum=2", "eval_examples=20", "log_interval=1")
    init = ("--init-from", str(files["base"]))
    assert finetune(files, full, *init, *sets("max_iters=8", *common)) == 0
    assert finetune(files, part, *init, *sets("max_iters=4", *common)) == 0
    assert torch.load(part / "last" / TRAINING_STATE, weights_only=True)["step"] == 4
    assert finetune(files, part, "--resume", "--set", "max_iters=8") == 0

    a, b = events(full, "train"), events(part, "train")
    assert [e["step"] for e in b] == list(range(1, 9))  # the resumed log continues, without duplicates
    assert [e["loss"] for e in a] == [e["loss"] for e in b]  # bit-for-bit equal
    for name in ("model.safetensors", HEAD_FILE):
        wa, wb = load_file(full / "last" / name), load_file(part / "last" / name)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
    va = {e["step"]: e["val_acc"] for e in events(full, "eval")}
    vb = {e["step"]: e["val_acc"] for e in events(part, "eval")}
    assert va[8] == vb[8] and all(va[k] == vb[k] for k in va)  # the interrupted run also evaluated at step 4


def test_lm_weight_zero_trains_the_task_loss_only(tmp_path, files):
    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(files["base"]), "--lm-weight", "0",
                    *sets("max_iters=2", "eval_interval=2")) == 0
    train = events(out, "train")[-1]
    assert "lm_loss" not in train and train["loss"] == train["task_loss"]
    assert events(out, "start")[0]["config"]["lm_weight"] == 0.0


@pytest.mark.parametrize("kind,lines", [
    ("entailment", [{"premise": "a b", "hypothesis": "b", "label": "yes"},
                    {"premise": "a", "hypothesis": "c d", "label": "no"}] * 8),
    ("similarity", [{"text_a": "a b", "text_b": "b", "label": "same"},
                    {"text_a": "a", "text_b": "c d", "label": "other"}] * 8),
    ("multiple_choice", [{"context": "a b", "answers": ["x", "y", "z"], "label": 2},
                         {"context": "c", "answers": ["x", "y"], "label": 0}] * 8),
])
def test_every_task_kind_fine_tunes(tmp_path, files, kind, lines):
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(files["base"]), *sets("max_iters=2", "eval_interval=2",
                                                                         "batch_size=4"),
                    task=kind, train=data, val=data) == 0
    ck = load_checkpoint(out / "last")
    task = load_task(out / "last", ck.model)
    assert task.kind == kind
    item = {k: v for k, v in lines[0].items() if k != "label"}
    assert len(task.predict(ck.model, ck.tokenizer, [item])[0]) == (3 if kind == "multiple_choice" else 2)


@pytest.mark.parametrize("content,message", [
    ('{"text": "a", "label": "x"}\n{"text": "b"}\n', ':2: missing "label"'),
    ('{"text": "a", "label": "x"}\n\n{nope\n', ":3: not valid JSON"),
    ('{"txt": "a", "label": "x"}\n', ":1: expected {\"text\": ...} or a string, got keys ['txt']"),
    ('{"text": 5, "label": "x"}\n', ":1: text must be a string, got int"),
    ('{"text": "a", "label": 1}\n', ":1: label must be a non-empty string"),
    ('[1, 2]\n', ":1: expected a JSON object, got list"),
    ("", ": no examples"),
])
def test_bad_jsonl_is_one_line_naming_file_and_line(tmp_path, files, capsys, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    err = one_line_error(capsys, lambda: finetune(files, tmp_path / "o", "--init-from", str(files["base"]), train=bad))
    assert err.startswith("python -m training.finetune: error: ")
    assert f"{bad}{message}" in err


def test_other_task_data_errors(tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text('{"context": "a", "answers": ["x", "y"], "label": 2}\n')
    with pytest.raises(TaskDataError, match=r"mc.jsonl:1: label must be the index of the right answer, an integer in "
                                            r"\[0, 2\), got 2"):
        read_task_file(mc, "multiple_choice")
    bad = tmp_path / "utf.jsonl"
    bad.write_bytes(b'{"text": "a", "label": "x"}\n{"text": "\xff", "label": "y"}\n')
    with pytest.raises(TaskDataError, match="utf.jsonl:2: invalid UTF-8"):
        read_task_file(bad, "classification")


def test_cli_errors(tmp_path, files, capsys):
    def err(*args, **kw) -> str:
        return one_line_error(capsys, lambda: finetune(files, tmp_path / "o", *args, **kw))

    init = ("--init-from", str(files["base"]))
    assert "unknown config key 'lm_weigth'; did you mean 'lm_weight'?" in err(*init, "--set", "lm_weigth=1")
    assert "lm_weight must be >= 0" in err(*init, "--lm-weight", "-1")
    assert "checkpoint directory not found" in err("--init-from", str(tmp_path / "none"))
    assert "nothing to resume" in err("--resume")
    assert "block_size 100 exceeds the checkpoint's 48" in err(*init, "--set", "block_size=100")
    one_label = write_jsonl(tmp_path / "one.jsonl", [{"text": "a", "label": "x"}])
    assert "needs at least 2 different labels" in err(*init, train=one_label)
    unseen = write_jsonl(tmp_path / "unseen.jsonl", [{"text": "a", "label": "maybe"}])
    assert f"{unseen}:1: label 'maybe' is not one of the task's labels ['no', 'yes']" in err(*init, val=unseen)


def test_resume_refuses_changed_data_or_another_task(tmp_path, files, capsys):
    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(files["base"]), *sets("max_iters=1", "eval_interval=1",
                                                                         "eval_examples=4")) == 0
    capsys.readouterr()
    assert finetune(files, out, "--resume", task="entailment") == 2
    assert "fine-tunes a classification task, not entailment" in capsys.readouterr().err
    other = write_jsonl(tmp_path / "t.jsonl", word_task_lines(300, seed=5))
    assert finetune(files, out, "--resume", train=other) == 2
    assert "differs from the file the run started with" in capsys.readouterr().err
    assert finetune(files, out, "--init-from", str(files["base"])) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_cli_subprocess_error_has_no_traceback(tmp_path, files):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": ["x"]}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "training.finetune", "--init-from", str(files["base"]), "--task",
                           "classification", "--train", str(bad), "--val", str(files["val"]), "--out",
                           str(tmp_path / "o")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"python -m training.finetune: error: {bad}:2: label must be a non-empty string "
                                   "(a label name), got ['x']")


def test_finetune_config_extends_train_config(tmp_path):
    cfg = build_config(overrides=["lm_weight=0.25", "max_iters=7"], cls=FinetuneConfig)
    assert isinstance(cfg, FinetuneConfig) and cfg.lm_weight == 0.25 and cfg.max_iters == 7
    assert cfg.learning_rate == FinetuneConfig().learning_rate and {"lm_weight", "max_iters"} <= cfg.explicit
    f = tmp_path / "c.json"
    f.write_text('{"lm_weight": "high"}')
    with pytest.raises(ConfigError, match="c.json: lm_weight must be float, got 'high'"):
        build_config(file=f, cls=FinetuneConfig)
    with pytest.raises(ConfigError, match="unknown config key 'lm_weight'"):
        build_config(overrides=["lm_weight=1"])  # not a pre-training key


def test_example_sampler_is_a_pure_function_of_step_and_covers_epochs():
    s = ExampleSampler(10, batch_size=4, grad_accum=1, seed=3)
    first = np.concatenate([s.indices(step, 0) for step in range(5)])  # 20 examples = 2 epochs
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert np.array_equal(ExampleSampler(10, 4, 1, seed=3).indices(3, 0), s.indices(3, 0))
    r0, r1 = (ExampleSampler(10, 2, 1, seed=3, rank=r, world=2) for r in (0, 1))
    assert not set(r0.indices(0, 0)) & set(r1.indices(0, 0))


def test_fixture_helper_writes_a_checkpoint_with_a_head(tmp_path):
    ck_dir = write_task_checkpoint(tmp_path / "a", "multiple_choice")
    again = write_task_checkpoint(tmp_path / "b", "multiple_choice")
    assert load_file(ck_dir / HEAD_FILE)["weight"].equal(load_file(again / HEAD_FILE)["weight"])  # deterministic
    assert load_task(ck_dir, load_checkpoint(ck_dir).model).kind == "multiple_choice"
