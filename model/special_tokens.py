"""Growing a model's vocabulary by special tokens: new tokenizer ids after its own, and new rows of the (tied)
embedding for them. Chat fine-tuning (training/finetune.py --task chat) adds its template's role tokens this
way, and model/task_head.py's add_task_tokens for [Start] [Delim] [Extract]."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from model.gpt import GPT
from model.tokenizer import Tokenizer


@torch.no_grad()
def add_special_tokens(model: GPT, tokenizer: Tokenizer, names: Sequence[str],
                       generator: torch.Generator | None = None) -> Tokenizer:
    """The tokenizer with `names` (those it lacks get the next free ids), and the model's tied embedding grown
    to hold every special id. Each new token's row is the mean of the ordinary tokens' rows plus N(0, 0.02²)
    noise: a token that looks like an average one, so the first steps' logits stay sane. Rows that exist
    already (vocabulary padding) but belong to a newly added token are re-initialised the same way."""
    tok = tokenizer.with_special_tokens(names)
    new = [tok.special_tokens[n] for n in names if n not in tokenizer.special_tokens]
    if not new:
        return tok
    wte = model.transformer.wte
    old = wte.weight
    size = max(old.size(0), max(tok.special_tokens.values()) + 1)
    weight = torch.empty(size, old.size(1), dtype=old.dtype, device=old.device)
    weight[: old.size(0)] = old
    mean = old[: min(old.size(0), tokenizer.vocab_size)].float().mean(0)
    for i in range(old.size(0), size):  # any id between the old rows and the new tokens: an unused row
        weight[i] = mean.to(old.dtype)
    for i in new:
        noise = torch.randn(old.size(1), generator=generator) * 0.02
        weight[i] = (mean + noise.to(mean.device)).to(old.dtype)
    wte.weight = nn.Parameter(weight, requires_grad=old.requires_grad)
    wte.num_embeddings = size
    model.lm_head.weight = wte.weight
    model.lm_head.out_features = size
    model.config = dataclasses.replace(model.config, vocab_size=size)
    return tok
