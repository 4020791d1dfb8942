"""A run's log on rank 0: OUT/metrics.jsonl (one JSON object per event), the OUT/loss.png plot, and with
`--tensorboard` the same numbers as TensorBoard event files in OUT/tensorboard."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from training.errors import PROG, TrainError

METRICS, PLOT, TENSORBOARD = "metrics.jsonl", "loss.png", "tensorboard"
TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install tensorboard"


def summary_writer_class() -> type:
    """torch.utils.tensorboard.SummaryWriter, or a one-line TrainError when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise TrainError(TENSORBOARD_MISSING) from e
    return SummaryWriter


class Metrics:
    """OUT/metrics.jsonl (one JSON object per event), OUT/loss.png and, optionally, OUT/tensorboard; rank 0 only.

    keep_until_step: resuming from that step; events logged after it are dropped (those steps are redone),
    from metrics.jsonl and from what TensorBoard shows.
    """

    def __init__(self, out: Path, keep_until_step: int | None, tensorboard: bool = False) -> None:
        self.file = out / METRICS
        self.plot = out / PLOT
        self.events: list[dict[str, Any]] = []
        self.tb = None
        if tensorboard:
            writer = summary_writer_class()
            purge = None if keep_until_step is None else keep_until_step + 1
            self.tb = writer(log_dir=str(out / TENSORBOARD), purge_step=purge)
        if keep_until_step is not None and self.file.exists():
            # resuming: drop what was logged after the checkpoint (those steps are redone)
            for line in self.file.read_text().splitlines():
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if ev.get("step", 0) <= keep_until_step and ev.get("event") in ("train", "eval"):
                    self.events.append(ev)
        tmp = self.file.with_name(f".{METRICS}.tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in self.events))
        os.replace(tmp, self.file)
        self._fh = self.file.open("a")
        self._plt = None

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        ev = {"event": event, **fields, "time": round(time.time(), 3)}
        self._fh.write(json.dumps(ev) + "\n")
        self._fh.flush()
        if event in ("train", "eval"):
            self.events.append(ev)
        if self.tb is not None:
            self._tensorboard(ev)
        return ev

    def _tensorboard(self, ev: dict[str, Any]) -> None:
        """Numbers of train and eval events as scalars `event/key`, the sample and the start event as text."""
        event, step, t = ev["event"], ev.get("step", 0), ev["time"]
        if event == "start":
            self.tb.add_text("start", "    " + json.dumps(ev, indent=2).replace("\n", "\n    "), step, walltime=t)
        elif event in ("train", "eval"):
            for k, v in ev.items():
                if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool):
                    self.tb.add_scalar(f"{event}/{k}", v, step, walltime=t)
            if ev.get("sample"):
                self.tb.add_text("sample", "    " + ev["sample"].replace("\n", "\n    "), step, walltime=t)
        if event != "train":
            self.tb.flush()

    def plot_losses(self) -> None:
        if self._plt is None:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt
            except ImportError:
                self._plt = False
                print(f"{PROG}: note: matplotlib is not installed; {self.plot} is not written", file=sys.stderr)
                return
            self._plt = plt
        if self._plt is False:
            return
        plt = self._plt
        train = [(e["step"], e["loss"]) for e in self.events if e["event"] == "train"]
        evals = [e for e in self.events if e["event"] == "eval"]

        def series(key: str) -> list[tuple[int, float]]:  # (step, value) of the evals that have a value
            return [(e["step"], e[key]) for e in evals if e.get(key) is not None]

        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        if train:
            ax.plot(*zip(*train), lw=0.8, alpha=0.6, label="train (batch)")
        for key, label in (("train_loss", "train (eval)"), ("val_loss", "val")):
            if series(key):
                ax.plot(*zip(*series(key)), "o-", ms=3, label=label)
        ax.set_xlabel("step")
        task = any("val_acc" in e for e in evals)  # a fine-tuning run: task loss, and accuracy on a second axis
        ax.set_ylabel("loss (nats per example)" if task else "loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
        if task:
            acc = ax.twinx()
            acc.plot(*zip(*series("val_acc")), "s-", ms=3, color="tab:green", label="val accuracy")
            if series("majority_acc"):
                acc.plot(*zip(*series("majority_acc")), "--", color="tab:gray", label="majority baseline")
            acc.set_ylabel("accuracy")
            acc.set_ylim(0, 1)
            acc.legend(loc="upper right")
        fig.tight_layout()
        tmp = self.plot.with_name(".loss.tmp.png")
        fig.savefig(tmp)
        plt.close(fig)
        os.replace(tmp, self.plot)

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()
