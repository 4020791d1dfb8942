"""Language-model pre-training's loop (python -m training.train): training/loop.py's BaseLoop on random windows
of the token files, the loss on fixed evaluation windows, a sample at each evaluation, OUT/best by validation loss."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model.gpt import GPT
from training.checkpoints import rng_state, write_checkpoints
from training.config import TrainConfig
from training.distributed import Dist
from training.errors import PROG
from training.lm.data import BatchSampler, DataDir, fixed_eval_offsets
from training.lm.measure import estimate_loss
from training.loop import BaseLoop
from training.measure import flops_per_token, peak_flops, sample_text
from training.optim import Optimizers


class Loop(BaseLoop):
    """Language-model training on a prepared data directory: random windows, loss on fixed evaluation windows,
    a sample at each evaluation, OUT/best by validation loss."""

    def __init__(self, cfg: TrainConfig, data: DataDir, out: Path, model: GPT, optimizer: Optimizers,
                 d: Dist, device: torch.device, use_bf16: bool, state: dict[str, Any] | None,
                 init_meta: dict[str, Any], quiet: bool) -> None:
        super().__init__(cfg, out, model, optimizer, d, device, use_bf16, state, quiet)
        self.data = data
        self.best_val, self.tokens_seen = float("inf"), 0
        self.init_meta = init_meta
        if state is not None:
            self.best_val, self.tokens_seen = state["best_val_loss"], state["tokens_seen"]
            self.init_meta = state.get("init_meta", {})
        self.sampler = BatchSampler(data.train, cfg.block_size, cfg.batch_size, cfg.seed, d.rank)
        self.eval_offsets = {s: fixed_eval_offsets(len(data.split(s)), cfg.block_size, cfg.batch_size,
                                                   cfg.eval_iters) for s in ("train", "val")}
        self.tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * d.world
        self.peak = peak_flops(device, cfg)
        self.fpt = flops_per_token(model)

    def open_log(self) -> None:
        """Rank 0: the run directory, its metrics log with a `start` event, and a line on the terminal."""
        cfg, d, model = self.cfg, self.d, self.raw_model
        if not d.master:
            return
        self.open_metrics(n_params=model.num_params(), device=str(self.device), world_size=d.world,
                          bf16=self.use_bf16, tokens_per_step=self.tokens_per_step, data=str(self.data.path),
                          config=cfg.to_dict(), **self.init_meta)
        if not self.quiet:
            vocab = self.data.tokenizer.vocab_size
            vocab_note = (f" (tokenizer {vocab}, padded to a multiple of {cfg.vocab_multiple})"
                          if model.config.vocab_size != vocab else "")
            print(f"{PROG}: {model.num_params() / 1e6:.2f}M parameters, vocab {model.config.vocab_size}"
                  f"{vocab_note}, {self.tokens_per_step:,} tokens/step, device {self.device}"
                  f"{' bf16' if self.use_bf16 else ''}, {d.world} process(es)"
                  f"{f', resuming at step {self.step}' if self.resumed else ''}", file=sys.stderr)

    def checkpoint(self) -> None:
        """Evaluate, log, sample, and write OUT/best (if improved) and OUT/last (with the training state)."""
        cfg, d, data, step = self.cfg, self.d, self.data, self.step
        losses = {s: estimate_loss(self.eval_model, data.split(s), self.eval_offsets[s], cfg.block_size,
                                   self.device, self.autocast, d) for s in ("train", "val")}
        rngs = d.gather(rng_state())  # collective: every rank takes part
        if not d.master:
            return
        val = losses["val"]
        bpb = data.bits_per_byte("val", val)
        text = sample_text(self.raw_model, data.tokenizer, cfg)
        improved = val < self.best_val
        self.best_val = min(self.best_val, val)
        self.metrics.log("eval", step=step, train_loss=losses["train"], val_loss=val, val_bpb=bpb,
                         val_ppl=math.exp(min(val, 700)), best_val_loss=self.best_val, tokens=self.tokens_seen,
                         elapsed_s=round(self.elapsed(), 2), cpu_s=round(self.cpu_seconds(), 1), sample=text)
        self.metrics.plot_losses()
        if not self.quiet:
            tqdm.write(f"step {step}: train {losses['train']:.4f}, val {val:.4f} ({bpb:.4f} bits/byte)"
                       f"{' *best*' if improved else ''}\n--- sample ---\n{text}\n--------------", file=sys.stderr)
        meta = {"step": step, "val_loss": val, "val_bits_per_byte": bpb, "train_loss": losses["train"],
                "tokens_seen": self.tokens_seen, "elapsed_s": round(self.elapsed(), 2),
                "cpu_s": round(self.cpu_seconds(), 1), "data": str(data.path),
                "train_config": cfg.to_dict(), **self.init_meta}
        training_state = {"step": step, "optimizer": self.optimizer.state_dict(), "rng": rngs,
                          "best_val_loss": self.best_val, "tokens_seen": self.tokens_seen,
                          "elapsed_s": self.elapsed(), "cpu_s": self.cpu_seconds(), "config": cfg.to_dict(),
                          "sampler": self.sampler.state(), "world_size": d.world, "init_meta": self.init_meta}
        write_checkpoints(self.out, self.raw_model, data.tokenizer, data.tokenizer_file, meta, training_state,
                          improved)

    def micro_step(self, micro: int) -> dict[str, torch.Tensor]:
        x, y = self.sampler.batch(self.step, micro)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with self.autocast():
            _, loss = self.train_model(x, y)
        (loss / self.cfg.grad_accum).backward()
        return {"loss": loss.detach()}

    def after_step(self) -> None:
        self.tokens_seen += self.tokens_per_step

    def train_fields(self, means: dict[str, float], n_logged: int, seconds: float) -> tuple[dict, dict]:
        tps = n_logged * self.tokens_per_step / seconds
        fields = {"tokens": self.tokens_seen, "tokens_per_s": round(tps, 1), "elapsed_s": round(self.elapsed(), 2),
                  "cpu_s": round(self.cpu_seconds(), 1)}
        post = {"tok/s": f"{tps:,.0f}"}
        if self.peak:
            fields["mfu"] = round(tps / self.d.world * self.fpt / self.peak, 4)
            post["mfu"] = f"{fields['mfu'] * 100:.1f}%"
        return fields, post

    def end_fields(self) -> dict[str, Any]:
        return {"best_val_loss": self.best_val, "tokens": self.tokens_seen}

    def summary(self) -> str:
        return (f"best val loss {self.best_val:.4f} "
                f"({self.data.bits_per_byte('val', self.best_val):.4f} bits/byte)")
