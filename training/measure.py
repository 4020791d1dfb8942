"""What a run measures besides its batch losses: the loss on fixed evaluation windows, a short sample, the
FLOP counts behind MFU, and (task fine-tuning) a task model's predictions and losses on labelled examples."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch
import torch.nn.functional as F

from engine.generate import generate
from engine.params import MAX_SEED, SamplingParams
from model.gpt import GPT
from model.task_head import TaskHead, make_batch, special_ids, task_logits
from model.tokenizer import Tokenizer
from training.config import TrainConfig
from training.data import window_batch
from training.distributed import Dist
from training.task_data import TaskSet


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, data: np.ndarray, offsets: np.ndarray, block_size: int,
                  device: torch.device, autocast: Callable[[], AbstractContextManager], d: Dist) -> float:
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
    d.sum_(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


def sample_text(model: GPT, tokenizer: Tokenizer, cfg: TrainConfig) -> str:
    """A short sample (top-k, temperature) from engine.generate. Its sampler draws counter-based noise keyed by
    cfg.seed, never from a global generator: the training RNG is untouched, and every evaluation of a run
    samples with the same noise.

    Prompt and sample fit in the context (block_size): the sample is cut to the room the prompt leaves, but
    keeps at least half the context, for which the prompt loses its start. None with a one-token context.
    """
    block = model.config.block_size
    if cfg.sample_tokens <= 0 or block < 2:
        return ""
    prompt = tokenizer.encode(cfg.sample_prompt, allow_special=False) if cfg.sample_prompt else [tokenizer.eot_id]
    new = min(cfg.sample_tokens, max(block - len(prompt), block // 2))
    prompt = prompt[-(block - new):]
    params = SamplingParams(max_new_tokens=new, temperature=min(cfg.sample_temperature, 100.0),
                            top_k=cfg.sample_top_k, seed=cfg.seed % (MAX_SEED + 1))
    was_training = model.training
    model.eval()
    try:
        seq = generate(model, tokenizer, [prompt], params)[0]  # <|endoftext|> ends it, without adding text
    finally:
        model.train(was_training)
    return cfg.sample_prompt + seq.text


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


@torch.no_grad()
def score_task_set(model: GPT, head: TaskHead, kind: str, tset: TaskSet, rows: np.ndarray, tokenizer: Tokenizer,
                   batch_size: int, device: torch.device,
                   autocast: Callable[[], AbstractContextManager] | None = None) -> dict[str, np.ndarray | float]:
    """The examples `rows` of tset in eval mode: "pred" (arg-max output per row), "loss" (summed task
    cross-entropy), "lm_loss" and "lm_tokens" (summed LM cross-entropy over the text tokens, and their count)."""
    special = special_ids(tokenizer)
    was = model.training, head.training
    model.eval()
    head.eval()
    preds, loss, lm_sum, lm_tokens = [], 0.0, 0.0, 0
    try:
        for b in range(0, len(rows), batch_size):
            idx = rows[b:b + batch_size]
            batch = make_batch([tset.encoded[i] for i in idx], special).to(device)
            with autocast() if autocast is not None else contextlib.nullcontext():
                logits, lm = task_logits(model, head, kind, batch, lm=True)
            y = torch.from_numpy(tset.labels[idx]).to(device)
            loss += F.cross_entropy(logits.float(), y, reduction="sum").item()
            n = int((batch.targets >= 0).sum())
            lm_sum += lm.item() * n
            lm_tokens += n
            preds.append(logits.argmax(-1).cpu().numpy())
    finally:
        model.train(was[0])
        head.train(was[1])
    return {"pred": np.concatenate(preds) if preds else np.zeros(0, np.int64), "loss": loss, "lm_loss": lm_sum,
            "lm_tokens": lm_tokens}
