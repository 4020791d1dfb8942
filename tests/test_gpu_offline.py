"""scripts/gpu-check.sh (bench/gpu_offline.py), the offline GPU check, on the CPU: the budgeted stage runner (skips
with the reason, failures that do not stop the run, dependencies), the carried wheels' install, a fast smoke of
the script itself, and (slow) the whole dry run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.gpu_offline as go

REPO = Path(__file__).resolve().parents[1]


def stage(name, needs=0.0, after=(), result=None, error=None):
    def run():
        if error is not None:
            raise error
        return result or {"note": name}
    return go.Stage(name, needs, run, after)


def test_a_stage_that_does_not_fit_the_budget_is_skipped_with_the_reason_and_the_rest_run():
    report: dict = {}
    failures = go.run_stages([stage("a"), stage("big", needs=1e6), stage("b")], go.Budget(60), report)
    st = report["stages"]
    assert failures == [] and st["a"]["status"] == st["b"]["status"] == "ok"
    assert st["big"]["status"] == "skipped" and "it needs about 1000000 s" in st["big"]["reason"]


def test_a_failure_is_one_line_later_stages_run_and_those_that_need_it_are_skipped():
    report: dict = {}
    boom = RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")
    stages = [stage("a", error=boom), stage("needs_a", after=("a",)), stage("other"),
              stage("quiet", error=go.Skip("no GPU here"))]
    failures = go.run_stages(stages, go.Budget(60), report)
    st = report["stages"]
    assert failures == ["a: RuntimeError: CUDA error: device-side assert triggered Compile with TORCH_USE_CUDA_DSA"]
    assert st["a"]["status"] == "failed" and "\n" not in st["a"]["error"]
    assert st["needs_a"] == {"status": "skipped", "reason": "needs a, which did not pass"}
    assert st["other"]["status"] == "ok"
    assert st["quiet"]["status"] == "skipped" and st["quiet"]["reason"] == "no GPU here"


def test_a_stage_whose_parts_failed_keeps_what_the_others_measured():
    report: dict = {}
    parts = {"errors": ["int4: RuntimeError: x"], "parts": {"bf16": {"tok_s": 9.0}, "int4": {"error": "x"}}}
    failures = go.run_stages([stage("engine", error=go.PartsFailed(parts))], go.Budget(60), report)
    assert failures and report["stages"]["engine"]["parts"]["bf16"] == {"tok_s": 9.0}


def test_the_carried_wheels_go_first_on_the_path_on_python_312_and_are_only_checked_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "requirements.txt").write_text("a==1.0\n")
    monkeypatch.setattr(go, "CARRY", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    calls = []

    def pip(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    for version, here in (((3, 11), False), ((3, 12), True)):
        calls.clear()
        monkeypatch.setattr(sys, "version_info", version + (0, "final", 0))
        r = go.wheels_stage(pip)
        cmd = calls[0]
        assert (cmd[cmd.index("--target") + 1] == str(tmp_path / "site")) is here and r["target"] == (
            str(tmp_path / "site") if here else None)
        assert {"--no-index", "--no-deps"} <= set(cmd) and cmd[-1].endswith("a-1.0-py3-none-any.whl")
        assert ("--python-version" in cmd) is not here  # elsewhere: installed for 3.12, into a scratch folder
        assert here or not Path(cmd[cmd.index("--target") + 1]).exists()  # ... which is removed after the check
        assert (sys.path[0] == str(tmp_path / "site")) is here
        assert os.environ["PYTHONPATH"].startswith(str(tmp_path / "site")) is here
    monkeypatch.setattr(sys, "version_info", (3, 12, 0, "final", 0))
    calls.clear()
    assert go.wheels_stage(pip)["note"] == "already installed" and calls == []  # the stamp matches the pins


def test_a_pip_failure_fails_the_stage_with_pips_words(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(go, "CARRY", tmp_path)
    fail = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: a-1.0 is not a valid wheel")  # noqa: E731
    scratch = []
    monkeypatch.setattr(go.tempfile, "mkdtemp", lambda prefix: scratch.append(tmp_path / prefix) or
                        (tmp_path / prefix).mkdir() or str(tmp_path / prefix))
    with pytest.raises(RuntimeError, match="not a valid wheel"):
        go.wheels_stage(fail)
    assert scratch and not scratch[0].exists()  # this Python's scratch install goes with the failure


def run_script(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    proc = subprocess.run(["scripts/gpu-check.sh", "--device", "cpu", "--out", str(out), *args], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=timeout)
    return proc, json.loads((out / "gpu-check.json").read_text())


def test_the_script_runs_on_the_cpu_and_writes_its_report(tmp_path):
    """The fast smoke: the shell entry point, the runner and the report, on the stages that take seconds."""
    proc, report = run_script(tmp_path, "--only", "device,checkpoint", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = report["stages"]
    assert st["device"]["status"] == st["checkpoint"]["status"] == "ok"
    assert st["serve"] == {"status": "skipped", "reason": "not in --only"}
    assert "gpu-check (cpu): PASSED" in proc.stdout and f"report: {tmp_path / 'out' / 'gpu-check.json'}" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_dry_run_passes_end_to_end_on_the_cpu(tmp_path):
    proc, report = run_script(tmp_path, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    st = report["stages"]
    for name in ("imports", "device", "checkpoint", "engine", "serve", "train", "finetune", "classify"):
        assert st[name]["status"] == "ok", (name, st[name])
    assert st["tests"]["status"] == "skipped" and st["tests"]["reason"]
    assert st["imports"]["failed"] == {} and "app.main" in st["imports"]["skipped"]
    parts = st["engine"]["parts"]
    assert all("error" not in p for p in parts.values()), parts
    assert parts["seeded_alone_vs_batched"]["equal"] and parts["speculation_on_vs_off"]["equal"] == 4
    assert st["serve"]["stream_events"] == 8 and (tmp_path / "out" / "server.log").stat().st_size > 0
    assert st["train"]["resumed_to_step"] == 5 and st["classify"]["answer"]
