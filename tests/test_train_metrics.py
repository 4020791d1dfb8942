"""training/metrics.py: the run log, and its TensorBoard mirror (`--tensorboard`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import TINY, make_corpus, write_byte_ranks
from training.errors import TrainError
from training.metrics import TENSORBOARD_MISSING, Metrics


def sets(*items: str) -> list[str]:
    return [arg for item in (*TINY, *items) for arg in ("--set", item)]


def read_events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in logdir → [(step, value)], as TensorBoard would show them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from training.prepare import prepare

    d = tmp_path_factory.mktemp("data")
    (d / "text.txt").write_text(make_corpus(300))
    write_byte_ranks(d / "bytes.tiktoken", [b"th", b"he", b"the"])
    prepare([str(d / "text.txt")], d / "prepared", str(d / "bytes.tiktoken"), 0.1, progress=False)
    return d / "prepared"


def test_tensorboard_missing_is_a_one_line_error(tmp_path, data_dir, monkeypatch, capsys):
    from training.train import main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(TrainError, match="pip install tensorboard"):
        Metrics(tmp_path, keep_until_step=None, tensorboard=True)
    for flag in (["--tensorboard"], ["--set", "tensorboard=true"]):
        capsys.readouterr()
        assert main(["--quiet", "--data", str(data_dir), "--out", str(tmp_path / "o"), *flag]) == 2
        err = capsys.readouterr().err
        assert err == f"python -m training.train: error: {TENSORBOARD_MISSING}\n"
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_tensorboard_key_has_a_did_you_mean_hint(tmp_path, data_dir, capsys):
    from training.train import main

    assert main(["--quiet", "--data", str(data_dir), "--out", str(tmp_path / "o"), "--set", "tensorbord=1"]) == 2
    assert "unknown config key 'tensorbord'; did you mean 'tensorboard'?" in capsys.readouterr().err


def test_tensorboard_mirrors_metrics_and_drops_redone_steps_on_resume(tmp_path, data_dir):
    pytest.importorskip("tensorboard")
    from training.train import main

    out = tmp_path / "run"
    common = ["--quiet", "--data", str(data_dir), "--out", str(out)]
    assert main([*common, "--tensorboard", *sets("max_iters=4", "eval_interval=2")]) == 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    tb = scalars(out / "tensorboard")
    train = [e for e in read_events(out) if e["event"] == "train"]
    evals = [e for e in read_events(out) if e["event"] == "eval"]
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in tb["train/loss"]] == pytest.approx([e["loss"] for e in train])
    assert [v for _, v in tb["train/lr"]] == pytest.approx([e["lr"] for e in train])
    assert [s for s, _ in tb["eval/val_loss"]] == [0, 2, 4]
    assert [v for _, v in tb["eval/val_loss"]] == pytest.approx([e["val_loss"] for e in evals])
    assert {"eval/val_bpb", "eval/train_loss", "train/tokens_per_s"} <= set(tb)

    # as if the run had gone on past its last checkpoint, then died: TensorBoard must not show those steps twice
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out / "tensorboard")) as w:
        w.add_scalar("train/loss", 1.0, 5)
    time.sleep(1.1)  # event files are read in name order, which starts with the time in seconds
    assert main([*common, "--resume", "--set", "max_iters=6"]) == 0  # the saved config keeps tensorboard on
    tb = scalars(out / "tensorboard")
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in tb["train/loss"]] == pytest.approx([e["loss"] for e in read_events(out)
                                                              if e["event"] == "train"])
