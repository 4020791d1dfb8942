"""The chat fine-tuning loop: training/loop.py's BaseLoop (schedule, accumulation, clipping, time budget, progress
bar, logging, interrupts) on batches of encoded conversations (training/chat/data.py), the loss the mean
cross-entropy of the learned (assistant) tokens; at every eval_interval the same loss on the validation
conversations, and OUT/best by it. Each checkpoint carries the chat template and stop tokens."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.gpt import GPT
from model.tokenizer import Tokenizer
from training.chat.data import ChatSet, chat_batch
from training.checkpoints import rng_state, write_checkpoints
from training.config import FinetuneConfig
from training.distributed import Dist
from training.errors import FINETUNE_PROG
from training.example_sampler import ExampleSampler
from training.loop import BaseLoop
from training.optim import Optimizers


class ChatLoop(BaseLoop):
    prog = FINETUNE_PROG
    loss_terms = ("loss",)

    def __init__(self, cfg: FinetuneConfig, train: ChatSet, val: ChatSet, tokenizer: Tokenizer,
                 tokenizer_file: Path | None, chat_files: dict[str, bytes], out: Path, model: GPT,
                 optimizer: Optimizers, d: Dist, device: torch.device, use_bf16: bool,
                 state: dict[str, Any] | None, run_meta: dict[str, Any], quiet: bool) -> None:
        super().__init__(cfg, out, model, optimizer, d, device, use_bf16, state, quiet)
        self.train_set, self.val_set, self.tokenizer = train, val, tokenizer
        self.tokenizer_file, self.chat_files, self.run_meta = tokenizer_file, chat_files, run_meta
        self.best_loss, self.examples_seen = math.inf, 0
        if state is not None:
            self.best_loss, self.examples_seen = state["best_val_loss"], state["examples_seen"]
        self.sampler = ExampleSampler(len(train), cfg.batch_size, cfg.grad_accum, cfg.seed, d.rank, d.world)
        n_val = len(val) if cfg.eval_examples == 0 else min(cfg.eval_examples, len(val))
        self.val_rows = np.arange(n_val)
        self.examples_per_step = cfg.batch_size * cfg.grad_accum * d.world
        self.pad_id = tokenizer.eot_id
        # positions computed and learned tokens of the training batches since the last log (throughput)
        self.since_log = self.on_device(torch.zeros, 2, dtype=torch.float64)

    def open_log(self) -> None:
        cfg, d = self.cfg, self.d
        if not d.master:
            return
        tr, va = self.train_set.stats, self.val_set.stats
        self.open_metrics(n_params=self.raw_model.num_params(), device=str(self.device), world_size=d.world,
                          bf16=self.use_bf16, train_examples=len(self.train_set), val_examples=len(self.val_rows),
                          train_stats=tr, val_stats=va, examples_per_step=self.examples_per_step,
                          config=cfg.to_dict(), **self.run_meta)
        if not self.quiet:
            def counts(s: dict[str, int]) -> str:
                skipped = s.get("dropped_overlong", 0)
                cut = s.get("truncated", 0)
                return (f"{s['examples']:,} conversations ({s['tokens']:,} tokens, {s['learned_tokens']:,} learned)"
                        + (f", {skipped:,} longer than the context dropped" if skipped else "")
                        + (f", {cut:,} truncated" if cut else ""))
            print(f"{FINETUNE_PROG}: chat ({self.run_meta['chat_template']}); training {counts(tr)}; validation "
                  f"{counts(va)}; {self.raw_model.num_params() / 1e6:.2f}M parameters, {self.examples_per_step} "
                  f"conversations/step (epoch = {len(self.train_set) / self.examples_per_step:.0f} steps), device "
                  f"{self.device}{f', resuming at step {self.step}' if self.resumed else ''}", file=sys.stderr)

    def batch(self, data: ChatSet, rows) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = chat_batch([data.example(int(i)) for i in rows], self.pad_id)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def micro_step(self, micro: int) -> dict[str, torch.Tensor]:
        x, y = self.batch(self.train_set, self.sampler.indices(self.step, micro))
        with self.autocast():
            _, loss = self.train_model(x, y)  # targets -1 (context, padding) are ignored: assistant tokens only
        (loss / self.cfg.grad_accum).backward()
        self.since_log[0] += x.numel()  # in place on the device: no host sync per micro-step
        self.since_log[1] += (y >= 0).sum()
        return {"loss": loss.detach()}

    def after_step(self) -> None:
        self.examples_seen += self.examples_per_step

    def train_fields(self, means: dict[str, float], n_logged: int, seconds: float) -> tuple[dict, dict]:
        # rank 0's own batches (only rank 0 logs, so no collective here), times the number of ranks
        positions, learned = (v * self.d.world for v in self.since_log.tolist())
        self.since_log.zero_()
        fields = {"examples": self.examples_seen, "epoch": round(self.sampler.epoch(self.step), 3),
                  "examples_per_s": round(n_logged * self.examples_per_step / seconds, 2),
                  "positions_per_s": round(positions / seconds, 1), "learned_tokens_per_s": round(learned / seconds, 1),
                  "elapsed_s": round(self.elapsed(), 2), "cpu_s": round(self.cpu_seconds(), 1)}
        return fields, {"pos/s": f"{positions / seconds:,.0f}"}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy (nats) of the learned tokens of the validation conversations (rows split over the
        ranks, then summed)."""
        model, d, bs = self.eval_model, self.d, self.cfg.batch_size
        was_training = model.training
        model.eval()
        tot = self.on_device(torch.zeros, 2, dtype=torch.float64)
        rows = self.val_rows[d.rank::d.world]
        for i in range(0, len(rows), bs):
            x, y = self.batch(self.val_set, rows[i: i + bs])
            with self.autocast():
                logits, _ = model(x)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
            tot += torch.stack([ce.double(), (y >= 0).sum().double()])
        d.sum_(tot)
        model.train(was_training)
        return tot[0].item() / max(tot[1].item(), 1.0)

    def checkpoint(self) -> None:
        """Evaluate, log, and write OUT/best (if the validation loss improved) and OUT/last (with the training
        state); both carry the chat template and stop tokens."""
        cfg, d, step = self.cfg, self.d, self.step
        val = self.evaluate()
        rngs = d.gather(rng_state())  # collective: every rank takes part
        if not d.master:
            return
        improved = val < self.best_loss
        self.best_loss = min(self.best_loss, val)
        self.metrics.log("eval", step=step, val_loss=val, best_val_loss=self.best_loss, examples=self.examples_seen,
                         epoch=round(self.sampler.epoch(step), 3), elapsed_s=round(self.elapsed(), 2),
                         cpu_s=round(self.cpu_seconds(), 1))
        self.metrics.plot_losses()
        if not self.quiet:
            tqdm.write(f"step {step}: val loss {val:.4f} (nats per assistant token){' *best*' if improved else ''}",
                       file=sys.stderr)
        meta = {"step": step, "task": "chat", "val_loss": val, "examples_seen": self.examples_seen,
                "elapsed_s": round(self.elapsed(), 2), "cpu_s": round(self.cpu_seconds(), 1),
                "train_config": cfg.to_dict(), **self.run_meta}
        training_state = {"step": step, "optimizer": self.optimizer.state_dict(), "rng": rngs,
                          "best_val_loss": self.best_loss, "examples_seen": self.examples_seen,
                          "elapsed_s": self.elapsed(), "cpu_s": self.cpu_seconds(), "config": cfg.to_dict(),
                          "world_size": d.world, "run_meta": self.run_meta}
        write_checkpoints(self.out, self.raw_model, self.tokenizer, self.tokenizer_file, meta, training_state,
                          improved, extra_files=self.chat_files)

    def end_fields(self) -> dict[str, Any]:
        return {"best_val_loss": self.best_loss, "examples": self.examples_seen}

    def summary(self) -> str:
        return f"best val loss {self.best_loss:.4f} nats per assistant token"
