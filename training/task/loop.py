"""The fine-tuning loop: training/loop.py's BaseLoop (schedule, accumulation, clipping, time budget, progress bar,
logging, interrupts) on batches of labelled examples, with L = L_task + lm_weight · L_LM, and at every
eval_interval the validation accuracy (against the majority baseline) and OUT/best by validation accuracy."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.task_head import Task, TaskModel, make_batch, special_ids
from model.tokenizer import Tokenizer
from training.checkpoints import rng_state, write_checkpoints
from training.config import FinetuneConfig
from training.distributed import Dist
from training.errors import FINETUNE_PROG
from training.example_sampler import ExampleSampler
from training.loop import BaseLoop
from training.measure import sample_text
from training.optim import Optimizers
from training.task.data import TaskSet
from training.task.measure import score_task_set


class FinetuneLoop(BaseLoop):
    prog = FINETUNE_PROG
    loss_terms = ("loss", "task_loss", "lm_loss")

    def __init__(self, cfg: FinetuneConfig, task: Task, train: TaskSet, val: TaskSet, majority: int,
                 tokenizer: Tokenizer, tokenizer_file: Path | None, out: Path, model: TaskModel,
                 optimizer: Optimizers, d: Dist, device: torch.device, use_bf16: bool,
                 state: dict[str, Any] | None, run_meta: dict[str, Any], quiet: bool) -> None:
        super().__init__(cfg, out, model, optimizer, d, device, use_bf16, state, quiet)
        self.task, self.train_set, self.val_set, self.tokenizer = task, train, val, tokenizer
        self.tokenizer_file, self.run_meta = tokenizer_file, run_meta
        self.special = special_ids(tokenizer)
        if cfg.lm_weight == 0:  # no LM loss is computed
            self.loss_terms = ("loss", "task_loss")
        self.best_acc, self.best_loss, self.examples_seen = -1.0, math.inf, 0
        if state is not None:
            self.best_acc, self.best_loss = state["best_val_acc"], state["best_val_loss"]
            self.examples_seen = state["examples_seen"]
        self.sampler = ExampleSampler(len(train), cfg.batch_size, cfg.grad_accum, cfg.seed, d.rank, d.world)
        n_val = len(val) if cfg.eval_examples == 0 else min(cfg.eval_examples, len(val))
        self.val_rows = np.arange(n_val)
        self.majority = majority
        self.majority_acc = float((val.labels[:n_val] == majority).mean())
        self.examples_per_step = cfg.batch_size * cfg.grad_accum * d.world
        # task loss and correct answers of the training batches since the last evaluation
        self.since_eval = self.on_device(torch.zeros, 3, dtype=torch.float64)

    @property
    def gpt(self):
        return self.raw_model.gpt

    def open_log(self) -> None:
        cfg, d = self.cfg, self.d
        if not d.master:
            return
        t = self.task
        self.open_metrics(n_params=self.gpt.num_params(), device=str(self.device), world_size=d.world,
                          bf16=self.use_bf16, train_examples=len(self.train_set),
                          val_examples=len(self.val_rows), examples_per_step=self.examples_per_step,
                          majority_acc=self.majority_acc, config=cfg.to_dict(), **self.run_meta)
        if not self.quiet:
            labels = f"labels {', '.join(t.labels)}" if t.labels else "answers scored one by one"
            print(f"{FINETUNE_PROG}: {t.kind} ({labels}); {len(self.train_set):,} training examples "
                  f"({self.train_set.n_tokens:,} tokens), {len(self.val_rows):,} validation examples; "
                  f"{self.gpt.num_params() / 1e6:.2f}M parameters + head {t.n_outputs}x{self.gpt.config.n_embd}, "
                  f"lm_weight {cfg.lm_weight}, {self.examples_per_step} examples/step (epoch = "
                  f"{len(self.train_set) / self.examples_per_step:.0f} steps), device {self.device}"
                  f"{f', resuming at step {self.step}' if self.resumed else ''}", file=sys.stderr)

    def micro_step(self, micro: int) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        rows = self.sampler.indices(self.step, micro)
        batch = make_batch([self.train_set.encoded[i] for i in rows], self.special).to(self.device)
        y = torch.from_numpy(self.train_set.labels[rows]).to(self.device)
        with self.autocast():
            logits, lm = self.train_model(batch, lm=cfg.lm_weight > 0)
        task_loss = F.cross_entropy(logits.float(), y)
        loss = task_loss + cfg.lm_weight * lm if lm is not None else task_loss
        (loss / cfg.grad_accum).backward()
        with torch.no_grad():
            self.since_eval += torch.stack([task_loss.detach().double() * len(rows),
                                            (logits.argmax(-1) == y).sum().double(),
                                            self.on_device(torch.tensor, float(len(rows)), dtype=torch.float64)])
        lm_val = lm.detach() if lm is not None else self.on_device(torch.zeros, ())
        return {"loss": loss.detach(), "task_loss": task_loss.detach(), "lm_loss": lm_val}

    def after_step(self) -> None:
        self.examples_seen += self.examples_per_step

    def train_fields(self, means: dict[str, float], n_logged: int, seconds: float) -> tuple[dict, dict]:
        eps = n_logged * self.examples_per_step / seconds
        fields = {"examples": self.examples_seen, "epoch": round(self.sampler.epoch(self.step), 3),
                  "examples_per_s": round(eps, 2), "elapsed_s": round(self.elapsed(), 2),
                  "cpu_s": round(self.cpu_seconds(), 1)}
        return fields, {"ex/s": f"{eps:,.1f}"}

    def evaluate(self) -> dict[str, float]:
        """Task loss, accuracy and LM loss on the validation rows (split over the ranks, then summed)."""
        d = self.d
        rows = self.val_rows[d.rank::d.world]
        r = score_task_set(self.gpt, self.task.head, self.task.kind, self.val_set, rows, self.tokenizer,
                           self.cfg.batch_size, self.device, self.autocast)
        correct = float((r["pred"] == self.val_set.labels[rows]).sum())
        tot = self.on_device(torch.tensor, [r["loss"], correct, float(len(rows)), r["lm_loss"], float(r["lm_tokens"])],
                             dtype=torch.float64)
        d.sum_(tot)
        n = max(tot[2].item(), 1.0)
        return {"val_loss": tot[0].item() / n, "val_acc": tot[1].item() / n,
                "val_lm_loss": tot[3].item() / max(tot[4].item(), 1.0)}

    def checkpoint(self) -> None:
        """Evaluate, log, and write OUT/best (if the validation accuracy improved; ties: lower task loss) and
        OUT/last (with the training state)."""
        cfg, d, step = self.cfg, self.d, self.step
        ev = self.evaluate()
        d.sum_(self.since_eval)
        seen = self.since_eval.tolist()
        self.since_eval.zero_()
        rngs = d.gather(rng_state())  # collective: every rank takes part
        if not d.master:
            return
        acc, loss = ev["val_acc"], ev["val_loss"]
        improved = acc > self.best_acc or (acc == self.best_acc and loss < self.best_loss)
        if improved:
            self.best_acc, self.best_loss = acc, loss
        train = {"train_loss": seen[0] / seen[2], "train_acc": seen[1] / seen[2]} if seen[2] else {
            "train_loss": None, "train_acc": None}
        text = sample_text(self.gpt, self.tokenizer, cfg) if cfg.sample_tokens > 0 else ""
        self.metrics.log("eval", step=step, **ev, majority_acc=self.majority_acc, best_val_acc=self.best_acc,
                         **train, examples=self.examples_seen, epoch=round(self.sampler.epoch(step), 3),
                         elapsed_s=round(self.elapsed(), 2), cpu_s=round(self.cpu_seconds(), 1),
                         **({"sample": text} if text else {}))
        self.metrics.plot_losses()
        if not self.quiet:
            tr = (f"; train (batches since last eval) acc {train['train_acc']:.3f}, loss {train['train_loss']:.4f}"
                  if seen[2] else "")
            tqdm.write(f"step {step}: val acc {acc:.4f} (majority baseline {self.majority_acc:.4f}), val task loss "
                       f"{loss:.4f}, val LM loss {ev['val_lm_loss']:.4f}{tr}{' *best*' if improved else ''}"
                       + (f"\n--- sample ---\n{text}\n--------------" if text else ""), file=sys.stderr)
        meta = {"step": step, "task": self.task.kind, "val_acc": acc, "val_task_loss": loss,
                "val_lm_loss": ev["val_lm_loss"], "majority_acc": self.majority_acc,
                "examples_seen": self.examples_seen, "elapsed_s": round(self.elapsed(), 2),
                "cpu_s": round(self.cpu_seconds(), 1), "train_config": cfg.to_dict(), **self.run_meta}
        training_state = {"step": step, "optimizer": self.optimizer.state_dict(), "rng": rngs,
                          "best_val_acc": self.best_acc, "best_val_loss": self.best_loss,
                          "examples_seen": self.examples_seen, "elapsed_s": self.elapsed(),
                          "cpu_s": self.cpu_seconds(), "config": cfg.to_dict(), "world_size": d.world,
                          "run_meta": self.run_meta}
        write_checkpoints(self.out, self.gpt, self.tokenizer, self.tokenizer_file, meta, training_state, improved,
                          extra_files=self.task.files())

    def end_fields(self) -> dict[str, Any]:
        return {"best_val_acc": self.best_acc, "majority_acc": self.majority_acc, "examples": self.examples_seen}

    def summary(self) -> str:
        return f"best val accuracy {self.best_acc:.4f} (majority baseline {self.majority_acc:.4f})"
