"""Train (or fine-tune) the GPT of model/ on a prepared data directory.

Usage::

    python -m training.train --data data/shakespeare --out runs/shakespeare --config training/configs/shakespeare.json
    python -m training.train --data DIR --out OUT --resume                 # continue OUT/last exactly
    python -m training.train --data DIR --out OUT --init-from checkpoints/gpt2 --set learning_rate=3e-5
    torchrun --nproc_per_node 2 -m training.train --data DIR --out OUT   # data parallel (gloo on CPU, NCCL on GPU)

Writes OUT/last (newest; with training_state.pt for --resume), OUT/best (lowest
validation loss; weights only), OUT/metrics.jsonl and OUT/loss.png. Every
checkpoint write is atomic (model.checkpoint.save_checkpoint), so killing the
process at any moment leaves the previous checkpoint loadable.

Reproducibility: on CPU a run is a pure function of (config, data, seed, number
of processes and threads). Training batches are a pure function of (seed, rank,
step, micro-step) (training.data.BatchSampler), and the RNG states of torch,
numpy and python are saved with the optimizer, so `--resume` continues with
exactly the losses the uninterrupted run would have had.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from model.checkpoint import TRAINING_STATE, CheckpointError, load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import Tokenizer
from training.config import ARCH_KEYS, ConfigError, TrainConfig, build_config
from training.data import (
    BatchSampler,
    DataDir,
    DataError,
    check_split_size,
    fixed_eval_offsets,
    open_data_dir,
    window_batch,
)

PROG = "python -m training.train"
LAST, BEST, METRICS, PLOT = "last", "best", "metrics.jsonl", "loss.png"


class TrainError(RuntimeError):
    """A user-facing problem (bad flags, mismatched checkpoint or data); printed in one line."""


# --------------------------------------------------------------------------- #
# Distributed setup
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Dist:
    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world: int = 1

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(device_pref: str) -> tuple[Dist, torch.device]:
    """torchrun sets RANK/WORLD_SIZE: initialise DDP (NCCL on CUDA, gloo on CPU) and pick this rank's device."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        d = Dist(True, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"]))
    else:
        d = Dist()
    use_cuda = device_pref.startswith("cuda") or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise TrainError(f"device {device_pref!r} requested but CUDA is not available")
    if use_cuda:
        device = torch.device(f"cuda:{d.local_rank}" if d.enabled or device_pref in ("auto", "cuda")
                              else device_pref)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if d.enabled:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return d, device


# --------------------------------------------------------------------------- #
# Pieces
# --------------------------------------------------------------------------- #


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup for warmup_iters steps, then cosine decay to min_lr at decay_iters, then min_lr."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.decay_iters:
        return cfg.min_lr
    ratio = (step - cfg.warmup_iters) / max(1, cfg.decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on 2-D tensors (matmul weights, embeddings) only, never on biases or LayerNorm."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), **extra)


def tokenizers_match(a: Tokenizer, b: Tokenizer) -> bool:
    """Same ids for the same text: equal ranks and <|endoftext|> id (a named encoding equals its ranks file)."""
    if a.vocab_size != b.vocab_size or a.eot_id != b.eot_id:
        return False
    ra, rb = getattr(a.encoding, "_mergeable_ranks", None), getattr(b.encoding, "_mergeable_ranks", None)
    if ra is not None and rb is not None:
        return ra == rb
    return a.spec == b.spec


def padded_vocab(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def peak_flops(device: torch.device, cfg: TrainConfig) -> float | None:
    """Dense bf16 peak of the accelerator, for MFU (None on CPU or an unknown GPU without peak_tflops)."""
    if device.type != "cuda":
        return None
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    name = torch.cuda.get_device_name(device)
    for key, tflops in (("H200", 989), ("H100", 989), ("A100", 312), ("L40", 181), ("A10", 125), ("L4", 121),
                        ("4090", 165), ("3090", 71)):
        if key in name:
            return tflops * 1e12
    return None


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token (PaLM appendix B): 6·N + 12·L·d·T (attention scores)."""
    c = model.config
    return 6 * model.num_params() + 12 * c.n_layer * c.n_embd * c.block_size


def rng_state() -> dict[str, Any]:
    """The RNG states of torch (CPU and CUDA), numpy and python, in types torch.load(weights_only=True) reads."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, data: np.ndarray, offsets: np.ndarray, block_size: int,
                  device: torch.device, autocast, d: Dist) -> float:
    """Mean loss over the fixed evaluation windows (batches split across ranks, then summed)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for row in offsets[d.rank::d.world]:
        x, y = window_batch(data, row, block_size)
        with autocast():
            _, loss = model(x.to(device), y.to(device))
        total[0] += loss.double() * len(row)
        total[1] += len(row)
    if d.enabled:
        dist.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


@torch.no_grad()
def sample_text(model: GPT, tokenizer: Tokenizer, cfg: TrainConfig, device: torch.device) -> str:
    """A short sample (top-k, temperature), from its own generator: the training RNG is untouched."""
    if cfg.sample_tokens <= 0:
        return ""
    was_training = model.training
    model.eval()
    prompt = tokenizer.encode(cfg.sample_prompt, allow_special=False) if cfg.sample_prompt else [tokenizer.eot_id]
    prompt = prompt[-(model.config.block_size - 1):]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(cfg.sample_tokens):
        logits, _ = model(idx[:, -model.config.block_size:])
        logits = logits[0, -1, :tokenizer.vocab_size].float()  # padded vocabulary rows are never sampled
        if cfg.sample_temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / cfg.sample_temperature
            if cfg.sample_top_k:
                kth = torch.topk(logits, min(cfg.sample_top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if nxt == tokenizer.eot_id:
            break
        out.append(nxt)
        idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)
    model.train(was_training)
    return cfg.sample_prompt + tokenizer.decode(out)


class Metrics:
    """OUT/metrics.jsonl (one JSON object per event) and OUT/loss.png; rank 0 only."""

    def __init__(self, out: Path, keep_until_step: int | None) -> None:
        self.file = out / METRICS
        self.plot = out / PLOT
        self.events: list[dict[str, Any]] = []
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
        return ev

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
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        if train:
            ax.plot(*zip(*train), lw=0.8, alpha=0.6, label="train (batch)")
        if evals:
            ax.plot([e["step"] for e in evals], [e["train_loss"] for e in evals], "o-", ms=3, label="train (eval)")
            ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", ms=3, label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = self.plot.with_name(".loss.tmp.png")
        fig.savefig(tmp)
        plt.close(fig)
        os.replace(tmp, self.plot)

    def close(self) -> None:
        self._fh.close()


def recover_checkpoint_dirs(out: Path) -> None:
    """Tidy what a killed save_checkpoint can leave: a stale temp dir, or (without renameat2) the old version."""
    for name in (LAST, BEST):
        olds = sorted(out.glob(f".{name}.old-*"), key=lambda p: p.stat().st_mtime)
        if not (out / name).exists() and olds:
            os.rename(olds[-1], out / name)
        for p in list(out.glob(f".{name}.tmp-*")) + list(out.glob(f".{name}.old-*")):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train the GPT of model/ on a directory written by python -m training.prepare. "
                    "Config precedence: defaults < --config file < --set overrides (with --resume, the saved "
                    "config replaces the defaults).",
        epilog="Config keys (with defaults): "
               + ", ".join(f"{k}={json.dumps(v)}" for k, v in TrainConfig().to_dict().items())
               + ". Outputs: OUT/last (with training_state.pt), OUT/best, OUT/metrics.jsonl, OUT/loss.png. "
               "Multi-process: torchrun --nproc_per_node N -m training.train ... "
               "Exit status: 0 on success, 2 on a user error, 130 when interrupted.")
    p.add_argument("--data", required=True, metavar="DIR", help="prepared data directory (train.bin, val.bin, "
                                                               "meta.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory for checkpoints and logs")
    p.add_argument("--config", metavar="FILE", help="a .json or .toml file of TrainConfig keys")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set max_iters=500 --set dropout=0.2")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue exactly from OUT/last (optimizer, step, RNG)")
    g.add_argument("--init-from", metavar="CHECKPOINT",
                   help="start from an existing checkpoint's weights (fine-tuning; fresh optimizer); its tokenizer "
                        "must match the data's")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run even if OUT already holds one (its checkpoints are replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or samples on the terminal")
    return p


def run(args: argparse.Namespace) -> GPT:
    """Train; returns the trained model (this rank's copy, unwrapped)."""
    out = Path(args.out)
    if args.resume and args.init_from:
        raise TrainError("--resume and --init-from are exclusive")

    # ---- config (a resumed run starts from its saved config) ----
    state: dict[str, Any] | None = None
    if args.resume:
        if out.is_dir() and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 tidies
            recover_checkpoint_dirs(out)
        state_file = out / LAST / TRAINING_STATE
        if not state_file.is_file():
            raise TrainError(f"--resume: {state_file} not found (nothing to resume in {out})")
        try:
            state = torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise TrainError(f"{state_file}: cannot read training state ({type(e).__name__}: {e})") from e
        cfg = build_config(base=state["config"], file=args.config, overrides=args.set)
        saved = state["config"]
        changed = [k for k in (*ARCH_KEYS, "block_size", "vocab_multiple") if getattr(cfg, k) != saved[k]]
        if changed:
            raise TrainError(f"--resume: cannot change {', '.join(changed)} of a run "
                             f"(saved: {', '.join(f'{k}={saved[k]!r}' for k in changed)})")
    else:
        cfg = build_config(file=args.config, overrides=args.set)
        if (out / LAST).exists() and not args.overwrite:
            raise TrainError(f"{out} already holds a run ({out / LAST}); pass --resume to continue it, "
                             "--overwrite to start again, or choose another --out")

    data = open_data_dir(args.data)
    d, device = setup_distributed(cfg.device)
    try:
        return _train(args, cfg, state, data, d, device)
    finally:
        if d.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _train(args, cfg: TrainConfig, state, data: DataDir, d: Dist, device: torch.device) -> GPT:
    out = Path(args.out)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    use_bf16 = device.type == "cuda" and (cfg.dtype == "bfloat16" or
                                          (cfg.dtype == "auto" and torch.cuda.is_bf16_supported()))
    if cfg.dtype == "bfloat16" and device.type != "cuda":
        raise TrainError("dtype=bfloat16 needs a CUDA device (CPU training runs in float32)")

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    tokenizer = data.tokenizer
    init_meta: dict[str, Any] = {}

    # ---- model ----
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    if state is not None:  # the run's own last checkpoint: its config (vocab padding included) and weights
        try:
            last = load_checkpoint(out / LAST)
        except CheckpointError as e:
            raise TrainError(f"--resume: {e}") from e
        if not tokenizers_match(last.tokenizer, tokenizer):
            raise TrainError(f"--resume: the tokenizer of the data in {data.path} differs from the run's "
                             f"({last.tokenizer.spec})")
        model = GPT(dataclasses.replace(last.config, dropout=cfg.dropout))
        model.load_state_dict(last.model.state_dict())
        del last
    elif args.init_from:
        try:
            ck = load_checkpoint(args.init_from)
        except CheckpointError as e:
            raise TrainError(f"--init-from: {e}") from e
        if not tokenizers_match(ck.tokenizer, tokenizer):
            raise TrainError(f"--init-from: the checkpoint's tokenizer ({ck.tokenizer.spec}, "
                             f"{ck.tokenizer.vocab_size} tokens) differs from the data's ({tokenizer.spec}, "
                             f"{tokenizer.vocab_size} tokens) in {data.path}; prepare the data with the "
                             "checkpoint's tokenizer")
        conflicts = [f"{k}={getattr(ck.config, k)!r}" for k in ARCH_KEYS
                     if k in cfg.explicit and getattr(cfg, k) != getattr(ck.config, k)]
        if conflicts:
            raise TrainError(f"--init-from: the checkpoint has {', '.join(conflicts)}; architecture keys cannot "
                             "change when fine-tuning (leave them out of the config)")
        block = cfg.block_size if "block_size" in cfg.explicit else ck.config.block_size
        if block > ck.config.block_size:
            raise TrainError(f"--init-from: block_size {block} exceeds the checkpoint's {ck.config.block_size}")
        cfg = dataclasses.replace(cfg, block_size=block, **{k: getattr(ck.config, k) for k in ARCH_KEYS})
        mconf = dataclasses.replace(ck.config, block_size=block, dropout=cfg.dropout)
        model = GPT(mconf)
        sd = {k: v for k, v in ck.model.state_dict().items()}
        if "transformer.wpe.weight" in sd:
            sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:block]  # crop the position table
        model.load_state_dict(sd)
        init_meta = {"init_from": str(args.init_from)}
        del ck
    else:
        vocab = padded_vocab(tokenizer.vocab_size, cfg.vocab_multiple)
        try:
            mconf = GPTConfig(vocab_size=vocab, **{k: getattr(cfg, k) for k in (*ARCH_KEYS, "block_size",
                                                                                   "dropout")})
        except ValueError as e:
            raise TrainError(str(e)) from e
        model = GPT(mconf)
    for split in ("train", "val"):
        check_split_size(data.split(split), cfg.block_size, split)

    step, best_val, tokens_seen, elapsed_before, cpu_before = 0, float("inf"), 0, 0.0, 0.0
    if state is not None:
        step, best_val = state["step"], state["best_val_loss"]
        tokens_seen, elapsed_before = state["tokens_seen"], state["elapsed_s"]
        cpu_before = state.get("cpu_s", 0.0)
        init_meta = state.get("init_meta", {})
    model.to(device)
    raw_model = model

    optimizer = make_optimizer(raw_model, cfg, device)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        rngs = state["rng"]
        if d.rank < len(rngs):
            set_rng_state(rngs[d.rank])
        else:
            torch.manual_seed(cfg.seed + d.rank)
    else:
        torch.manual_seed(cfg.seed + d.rank)  # dropout noise differs per rank
        np.random.seed(cfg.seed + d.rank)
        random.seed(cfg.seed + d.rank)

    fwd_model: torch.nn.Module = torch.compile(raw_model) if cfg.compile else raw_model
    train_model = fwd_model
    # evaluation runs under no_grad, where model.gpt sends CPU fp32 matmuls to oneDNN's fused linear, an op
    # inductor cannot lower with non-constant weights: on CPU, evaluate the uncompiled model
    eval_model = fwd_model if device.type == "cuda" else raw_model
    if d.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(fwd_model, device_ids=[device.index] if device.type == "cuda" else None)

    sampler = BatchSampler(data.train, cfg.block_size, cfg.batch_size, cfg.seed, d.rank)
    eval_offsets = {s: fixed_eval_offsets(len(data.split(s)), cfg.block_size, cfg.batch_size, cfg.eval_iters)
                    for s in ("train", "val")}
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * d.world
    peak = peak_flops(device, cfg)
    fpt = flops_per_token(raw_model)

    metrics = None
    if d.master:
        out.mkdir(parents=True, exist_ok=True)
        recover_checkpoint_dirs(out)
        metrics = Metrics(out, keep_until_step=step if state is not None else None)
        metrics.log("start", step=step, resumed=state is not None, n_params=raw_model.num_params(),
                    device=str(device), world_size=d.world, bf16=use_bf16, tokens_per_step=tokens_per_step,
                    data=str(data.path), config=cfg.to_dict(), **init_meta)
        if not args.quiet:
            vocab_note = (f" (tokenizer {tokenizer.vocab_size}, padded to a multiple of {cfg.vocab_multiple})"
                          if raw_model.config.vocab_size != tokenizer.vocab_size else "")
            print(f"{PROG}: {raw_model.num_params() / 1e6:.2f}M parameters, vocab {raw_model.config.vocab_size}"
                  f"{vocab_note}, {tokens_per_step:,} tokens/step, device {device}"
                  f"{' bf16' if use_bf16 else ''}, {d.world} process(es)"
                  f"{f', resuming at step {step}' if state is not None else ''}", file=sys.stderr)

    t_start, t_cpu = time.time(), time.process_time()

    def elapsed() -> float:
        """Wall-clock seconds of training so far, over every invocation of the run."""
        return elapsed_before + time.time() - t_start

    def cpu_seconds() -> float:
        """CPU seconds (all threads) this rank's process spent on the run: the cost of training on a shared
        machine, where wall time depends on what else runs."""
        return cpu_before + time.process_time() - t_cpu

    def gather_rng_states() -> list[dict[str, Any]]:
        rngs: list[Any] = [rng_state()]
        if d.enabled:  # collective: every rank takes part
            rngs = [None] * d.world
            dist.all_gather_object(rngs, rng_state())
        return rngs

    def checkpoint(step: int) -> None:
        """Evaluate, log, sample, and write OUT/best (if improved) and OUT/last (with the training state)."""
        nonlocal best_val
        losses = {s: estimate_loss(eval_model, data.split(s), eval_offsets[s], cfg.block_size, device, autocast, d)
                  for s in ("train", "val")}
        rngs = gather_rng_states()
        if not d.master:
            return
        val = losses["val"]
        bpb = data.bits_per_byte("val", val)
        text = sample_text(raw_model, tokenizer, cfg, device)
        improved = val < best_val
        best_val = min(best_val, val)
        metrics.log("eval", step=step, train_loss=losses["train"], val_loss=val, val_bpb=bpb,
                    val_ppl=math.exp(min(val, 700)), best_val_loss=best_val, tokens=tokens_seen,
                    elapsed_s=round(elapsed(), 2), cpu_s=round(cpu_seconds(), 1), sample=text)
        metrics.plot_losses()
        if not args.quiet:
            tqdm.write(f"step {step}: train {losses['train']:.4f}, val {val:.4f} ({bpb:.4f} bits/byte)"
                       f"{' *best*' if improved else ''}\n--- sample ---\n{text}\n--------------", file=sys.stderr)
        meta = {"step": step, "val_loss": val, "val_bits_per_byte": bpb, "train_loss": losses["train"],
                "tokens_seen": tokens_seen, "elapsed_s": round(elapsed(), 2), "cpu_s": round(cpu_seconds(), 1),
                "data": str(data.path),
                "train_config": cfg.to_dict(), **init_meta}
        training_state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rngs, "best_val_loss": best_val,
                          "tokens_seen": tokens_seen, "elapsed_s": elapsed(), "cpu_s": cpu_seconds(),
                          "config": cfg.to_dict(),
                          "sampler": sampler.state(), "world_size": d.world, "init_meta": init_meta}
        if improved:  # best first: a kill between the two writes leaves last older, never best behind last
            save_checkpoint(out / BEST, raw_model, tokenizer, meta, tokenizer_file=data.tokenizer_file)
        save_checkpoint(out / LAST, raw_model, tokenizer, meta, tokenizer_file=data.tokenizer_file,
                        training_state=training_state)

    if state is None:
        checkpoint(step)  # step 0: the untrained baseline, and a first resumable checkpoint

    bar = tqdm(total=cfg.max_iters, initial=step, desc="train", file=sys.stderr, dynamic_ncols=True,
               disable=args.quiet or not d.master, mininterval=1.0)
    train_model.train()
    loss_sum = torch.zeros((), device=device)
    n_logged, t_log, stop_reason = 0, time.time(), "max_iters"
    deadline = None if cfg.max_minutes is None else t_start + cfg.max_minutes * 60
    last_eval_step = step
    try:
        while step < cfg.max_iters:
            stop = deadline is not None and time.time() >= deadline
            if d.enabled and deadline is not None:  # rank 0's clock decides: every rank stops at the same step
                flag = torch.tensor(float(stop), device=device)
                dist.broadcast(flag, 0)
                stop = bool(flag.item())
            if stop:
                stop_reason = "max_minutes"
                break
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro in range(cfg.grad_accum):
                x, y = sampler.batch(step, micro)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync = micro == cfg.grad_accum - 1
                ctx = train_model.no_sync() if d.enabled and not sync else contextlib.nullcontext()
                with ctx:
                    with autocast():
                        _, loss = train_model(x, y)
                    (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach().float() / cfg.grad_accum
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            n_logged += 1
            bar.update(1)

            if step % cfg.log_interval == 0 or step == cfg.max_iters:
                if d.enabled:
                    dist.all_reduce(loss_sum)
                    loss_sum /= d.world
                loss_val = (loss_sum / n_logged).item()
                now = time.time()
                tps = n_logged * tokens_per_step / max(now - t_log, 1e-9)
                if not math.isfinite(loss_val):
                    raise TrainError(f"loss is {loss_val} at step {step}; lower learning_rate or check the data")
                if d.master:
                    fields = {"step": step, "loss": loss_val, "lr": lr, "tokens": tokens_seen,
                              "tokens_per_s": round(tps, 1), "elapsed_s": round(elapsed(), 2),
                              "cpu_s": round(cpu_seconds(), 1)}
                    post = {"loss": f"{loss_val:.4f}", "tok/s": f"{tps:,.0f}"}
                    if peak:
                        fields["mfu"] = round(tps / d.world * fpt / peak, 4)
                        post["mfu"] = f"{fields['mfu'] * 100:.1f}%"
                    metrics.log("train", **fields)
                    bar.set_postfix(post, refresh=False)
                loss_sum.zero_()
                n_logged, t_log = 0, now
            if step % cfg.eval_interval == 0 or step == cfg.max_iters:
                checkpoint(step)
                last_eval_step = step
                t_log = time.time()  # evaluation time is not training throughput
    except KeyboardInterrupt:
        bar.close()
        if d.master:
            print(f"{PROG}: interrupted at step {step}; {out / LAST} holds step {last_eval_step} "
                  f"(continue with --resume)", file=sys.stderr)
        raise
    if last_eval_step != step:
        checkpoint(step)
    bar.close()
    if d.master:
        metrics.log("end", step=step, reason=stop_reason, best_val_loss=best_val, elapsed_s=round(elapsed(), 2),
                    cpu_s=round(cpu_seconds(), 1), tokens=tokens_seen)
        metrics.close()
        if not args.quiet:
            print(f"{PROG}: stopped at step {step} ({stop_reason}) after {elapsed() / 60:.1f} min "
                  f"({cpu_seconds() / 60:.1f} CPU-min); best val loss "
                  f"{best_val:.4f} ({data.bits_per_byte('val', best_val):.4f} bits/byte); "
                  f"checkpoints in {out / LAST} and {out / BEST}", file=sys.stderr)
    return raw_model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (TrainError, ConfigError, DataError, CheckpointError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
