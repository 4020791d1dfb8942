"""The training loop: precision, gradient accumulation, clipping, the schedule, periodic logging, and at every
eval_interval an evaluation, a sample and a checkpoint; stops at max_iters or after max_minutes.

BaseLoop is what every run shares (the step loop, accumulation, clipping, the LR schedule, the time budget,
the progress bar, train-loss logging, interrupts); each trainer subclasses it: training/lm/loop.py's Loop
(language-model pre-training), training/task/loop.py's FinetuneLoop (supervised task fine-tuning) and
training/chat/loop.py's ChatLoop (chat fine-tuning).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model import cpu_support
from training.checkpoints import BEST, LAST, recover_checkpoint_dirs
from training.config import TrainConfig
from training.distributed import Dist
from training.errors import PROG, TrainError
from training.metrics import Metrics
from training.optim import Optimizers


def setup_precision(cfg: TrainConfig, device: torch.device) -> bool:
    """Threads and TF32; whether the run autocasts to bf16: on CUDA where supported (`auto` or `bfloat16`); on a CPU
    only when asked (`bfloat16`) and where the CPU computes bf16 in hardware (avx512_bf16 / AMX), since `auto` on a
    CPU keeps fp32 so a recipe gives the same losses on every host (measured 1.8x faster forward+backward on an
    avx512_bf16 EPYC at the bundled model's shape: docs/training.md)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and torch.cuda.is_bf16_supported())
    if cfg.dtype != "bfloat16":
        return False
    if not cpu_support.support().native_bf16:
        raise TrainError("dtype=bfloat16 on this CPU: no bf16 in hardware (avx512_bf16 / amx_bf16 with "
                         f"{cpu_support.PACKED_BF16_NEEDS}), where bf16 math is emulated and slower than float32; "
                         "use dtype=float32")
    return True


class BaseLoop:
    """One invocation of a run, from its first step (or the resumed one) to the last; rank 0 logs and saves.

    A subclass says what a micro-batch is (`micro_step`), what an evaluation and a checkpoint are
    (`checkpoint`), what the log shows (`open_log`, `train_fields`, `end_fields`, `summary`).
    """

    prog = PROG
    loss_terms: tuple[str, ...] = ("loss",)  # what micro_step returns; the first is the one checked for NaN

    def __init__(self, cfg: TrainConfig, out: Path, model: torch.nn.Module, optimizer: Optimizers,
                 d: Dist, device: torch.device, use_bf16: bool, state: dict[str, Any] | None, quiet: bool) -> None:
        self.cfg, self.out, self.raw_model, self.optimizer = cfg, out, model, optimizer
        self.d, self.device, self.use_bf16, self.resumed, self.quiet = d, device, use_bf16, state is not None, quiet
        self.step, self.elapsed_before, self.cpu_before = 0, 0.0, 0.0
        if state is not None:
            self.step, self.elapsed_before = state["step"], state["elapsed_s"]
            self.cpu_before = state.get("cpu_s", 0.0)

        # torch.compile(DDP(model)), not DDP(torch.compile(model)): compiled around DDP, the graph breaks at its
        # gradient buckets, so their all-reduce overlaps the rest of the backward pass
        wrapped = d.wrap(model, device)
        self.train_model: torch.nn.Module = torch.compile(wrapped) if cfg.compile else wrapped
        # evaluation runs under no_grad, where model.gpt sends CPU fp32 matmuls to oneDNN's fused linear, an op
        # inductor cannot lower with non-constant weights: on CPU, evaluate the uncompiled model. Ranks evaluate
        # different numbers of batches, so never through DDP (its forward may sync buffers: a collective)
        if not cfg.compile or device.type != "cuda":
            self.eval_model = model
        else:
            self.eval_model = self.train_model if wrapped is model else torch.compile(model)
        self.metrics: Metrics | None = None

    # ---- what a subclass provides ----
    def micro_step(self, micro: int) -> dict[str, torch.Tensor]:
        """Forward and backward (of loss / grad_accum) of micro-batch `micro` of this step; the detached loss
        terms, named as loss_terms."""
        raise NotImplementedError

    def after_step(self) -> None:
        """Bookkeeping after an optimizer step (counters)."""

    def checkpoint(self) -> None:
        """Evaluate, log, and write the checkpoints (collective: every rank calls it)."""
        raise NotImplementedError

    def open_log(self) -> None:
        raise NotImplementedError

    def train_fields(self, means: dict[str, float], n_logged: int, seconds: float) -> tuple[dict, dict]:
        """(fields of the `train` event besides step, the loss terms and lr; the progress bar's postfix)."""
        return {}, {}

    def end_fields(self) -> dict[str, Any]:
        return {}

    def summary(self) -> str:
        return ""

    # ---- shared ----
    def on_device(self, make, *args, **kwargs) -> torch.Tensor:
        """make(*args, **kwargs) on the model's device (make: torch.tensor, torch.zeros, ...): the one way a loop
        builds a tensor, so none is left on the CPU beside CUDA ones (torch.stack of both fails the first step on a
        GPU). tests/test_training_devices.py fails on a tensor constructor in training/ without a device."""
        return make(*args, device=self.device, **kwargs)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.use_bf16 else contextlib.nullcontext()

    def elapsed(self) -> float:
        """Wall-clock seconds of training so far, over every invocation of the run."""
        return self.elapsed_before + time.time() - self.t_start

    def cpu_seconds(self) -> float:
        """CPU seconds (all threads) this rank's process spent on the run: the cost of training on a shared
        machine, where wall time depends on what else runs."""
        return self.cpu_before + time.process_time() - self.t_cpu

    def open_metrics(self, **start_fields: Any) -> None:
        """Rank 0: the run directory and its metrics log with a `start` event."""
        self.out.mkdir(parents=True, exist_ok=True)
        recover_checkpoint_dirs(self.out)
        self.metrics = Metrics(self.out, keep_until_step=self.step if self.resumed else None,
                               tensorboard=self.cfg.tensorboard)
        self.metrics.log("start", step=self.step, resumed=self.resumed, **start_fields)

    def train_step(self) -> float:
        """One optimizer step of grad_accum micro-batches; returns its learning rate."""
        cfg, d, model = self.cfg, self.d, self.train_model
        lr = self.optimizer.schedule(self.step, cfg)
        for micro in range(cfg.grad_accum):
            with d.no_sync(model, sync=micro == cfg.grad_accum - 1):
                terms = self.micro_step(micro)
            for k in self.loss_terms:
                self.loss_sums[k] += terms[k].float() / cfg.grad_accum
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.after_step()
        return lr

    def log_train(self, lr: float, n_logged: int, t_log: float, bar: tqdm) -> float:
        """The mean losses of the last n_logged steps (over the ranks) to the log and the bar; returns the time."""
        d, step = self.d, self.step
        means = {}
        for k in self.loss_terms:
            d.mean_(self.loss_sums[k])
            means[k] = (self.loss_sums[k] / n_logged).item()
        now = time.time()
        first = means[self.loss_terms[0]]
        if not math.isfinite(first):
            raise TrainError(f"loss is {first} at step {step}; lower learning_rate or check the data")
        if d.master:
            extra, post_extra = self.train_fields(means, n_logged, max(now - t_log, 1e-9))
            fields = {"step": step, **means, "lr": lr, **extra}
            post = {k: f"{v:.4f}" for k, v in means.items()}
            post.update(post_extra)
            self.metrics.log("train", **fields)
            bar.set_postfix(post, refresh=False)
        for t in self.loss_sums.values():
            t.zero_()
        return now

    def run(self) -> torch.nn.Module:
        """Train to max_iters (or max_minutes); returns this rank's model, unwrapped."""
        cfg, d, out = self.cfg, self.d, self.out
        self.open_log()
        self.t_start, self.t_cpu = time.time(), time.process_time()
        if not self.resumed:
            self.checkpoint()  # step 0: the untrained baseline, and a first resumable checkpoint

        bar = tqdm(total=cfg.max_iters, initial=self.step, desc="train", file=sys.stderr, dynamic_ncols=True,
                   disable=self.quiet or not d.master, mininterval=1.0)
        self.train_model.train()
        self.loss_sums = {k: self.on_device(torch.zeros, ()) for k in self.loss_terms}
        n_logged, t_log, stop_reason = 0, time.time(), "max_iters"
        deadline = None if cfg.max_minutes is None else self.t_start + cfg.max_minutes * 60
        last_eval_step = self.step
        try:
            while self.step < cfg.max_iters:
                stop = deadline is not None and time.time() >= deadline
                if deadline is not None:  # rank 0's clock decides: every rank stops at the same step
                    stop = d.rank0_decides(stop, self.device)
                if stop:
                    stop_reason = "max_minutes"
                    break
                lr = self.train_step()
                n_logged += 1
                bar.update(1)
                if self.step % cfg.log_interval == 0 or self.step == cfg.max_iters:
                    t_log = self.log_train(lr, n_logged, t_log, bar)
                    n_logged = 0
                if self.step % cfg.eval_interval == 0 or self.step == cfg.max_iters:
                    self.checkpoint()
                    last_eval_step = self.step
                    t_log = time.time()  # evaluation time is not training throughput
        except KeyboardInterrupt:
            bar.close()
            if d.master:
                self.metrics.close()
                print(f"{self.prog}: interrupted at step {self.step}; {out / LAST} holds step {last_eval_step} "
                      f"(continue with --resume)", file=sys.stderr)
            raise
        if last_eval_step != self.step:
            self.checkpoint()
        bar.close()
        if d.master:
            self.metrics.log("end", step=self.step, reason=stop_reason, **self.end_fields(),
                             elapsed_s=round(self.elapsed(), 2), cpu_s=round(self.cpu_seconds(), 1))
            self.metrics.close()
            if not self.quiet:
                print(f"{self.prog}: stopped at step {self.step} ({stop_reason}) after {self.elapsed() / 60:.1f} "
                      f"min ({self.cpu_seconds() / 60:.1f} CPU-min); {self.summary()}; checkpoints in "
                      f"{out / LAST} and {out / BEST}", file=sys.stderr)
        return self.raw_model
