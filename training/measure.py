"""What any run measures besides its batch losses: a short sample and the FLOP counts behind MFU. Each trainer's
own measurements are beside its loop: training/lm/measure.py (the evaluation loss), training/task/measure.py
(a task model's predictions and losses)."""

from __future__ import annotations

import torch

from engine.generate import generate
from engine.params import MAX_SEED, SamplingParams
from model.gpt import GPT
from model.tokenizer import Tokenizer
from training.config import TrainConfig


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
