"""bench/gpu_check.py on CPU: what `make gpu-check` decides without a GPU (the stage runner and its one-line
failure, the graphs-on/off comparison by log-probabilities, the report, the exit without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

import bench.gpu_check as gc


def test_equal_runs_agree_and_logprob_drift_is_bounded():
    on = [(5, -1.0), (7, -0.5), (9, -2.0)]
    off = [(5, -1.01, []), (7, -0.52, []), (9, -2.0, [])]
    r = gc.compare_greedy(on, off, tol=0.05)
    assert r["agree"] and r["first_mismatch"] is None and r["max_logprob_diff"] == pytest.approx(0.02)
    r = gc.compare_greedy(on, [(5, -1.0, []), (7, -0.9, []), (9, -2.0, [])], tol=0.05)
    assert not r["agree"] and r["step"] == 1 and "logprob" in r["reason"]


def test_a_near_tie_at_the_first_mismatch_is_accepted_and_nothing_after_it_is_compared():
    on = [(5, -1.0), (8, -0.70), (1, -0.1)]  # graphs chose 8 where eager chose 7, 0.03 nats apart
    off = [(5, -1.0, [(5, -1.0)]), (7, -0.68, [(7, -0.68), (8, -0.71)]), (3, -5.0, [])]
    r = gc.compare_greedy(on, off, tol=0.1)
    assert r["agree"] and r["first_mismatch"] == 1 and r["gap"] == pytest.approx(0.03)


@pytest.mark.parametrize("top, why", [([(7, -0.2), (8, -1.5)], "1.3000 nats below"), ([(7, -0.2)], "not in its top")])
def test_a_real_disagreement_fails(top, why):
    r = gc.compare_greedy([(8, -1.5)], [(7, -0.2, top)], tol=0.1)
    assert not r["agree"] and why in r["reason"]
    assert not gc.compare_greedy([(1, 0.0)], [], tol=0.1)["agree"]  # a run cut short


def test_stages_stop_at_the_first_failure_with_one_line():
    ran = []

    def ok(name):
        return lambda: ran.append(name) or {"x": name}

    def boom():
        raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")

    report: dict = {}
    line = gc.run_stages([("a", ok("a")), ("b", boom), ("c", ok("c"))], report)
    assert ran == ["a"] and "\n" not in line
    assert line.startswith("gpu-check failed at b: RuntimeError: CUDA error: device-side assert triggered")
    assert report["ok"] is False and report["failed"] == "b"
    assert report["stages"]["a"]["ok"] and report["stages"]["a"]["x"] == "a"
    assert not report["stages"]["b"]["ok"] and "c" not in report["stages"]
    report = {}
    assert gc.run_stages([("a", ok("a"))], report) is None and report["ok"] is True


def test_without_cuda_it_exits_1_with_one_line_and_writes_the_report(monkeypatch, tmp_path, capsys):
    written = {}

    def write(name, data):
        written[name] = json.loads(json.dumps(data))
        return tmp_path / f"{name}.json"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gc, "write_result", write)
    monkeypatch.setattr(gc, "run_tests", lambda: pytest.fail("ran past the CUDA check"))
    assert gc.main(["--out", "probe"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu-check failed at cuda: needs a CUDA device")
    report = written["probe"]
    assert report["ok"] is False and report["failed"] == "cuda" and report["benchmark"] == "gpu-check"
    assert list(report["stages"]) == ["cuda"]
