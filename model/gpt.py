"""The GPT module: embeddings, causal self-attention blocks, tied output head.

Two forward paths share every weight:
- `forward(idx, targets)`: full recompute over a (B, T) batch, for training and as
  the reference the cached path is tested against.
- `forward_cached(idx, cache, slots)`: appends T new tokens to each of the given
  KV-cache slots and returns next-token logits (prefill when T > 1, a decode step
  when T == 1).
Parameter names follow GPT-2 / nanoGPT (transformer.h.0.attn.c_attn, ...), which
keeps the Hugging Face import a transpose-and-copy.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ContextLengthError, GPTConfig
from model.kv_cache import CacheStep, KVCache
from model.linear import linear  # the matmul of every Linear: plain here, swapped formats for serving


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, layer_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                step: CacheStep | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = linear(x, self.c_attn).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if step is None:  # full sequence: plain causal attention
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:  # write the new keys into the cache, attend over everything the slot holds
            k, v = step.update(*layer_kv, k, v)  # (B, H, S, D), in the cache's dtype
            # a narrower cache (GPT_KV_CACHE_DTYPE=bf16 beside fp32 weights) is read as stored: widening the keys and
            # values on every read made 16 rows at 300 tokens 3.2x slower (bench: docs/api.md); step.attend casts
            y = step.attend(q, k, v).to(q.dtype)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(linear(y, self.c_proj))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2 uses the tanh approximation of GELU; exact GELU would break the HF logits parity
        self.act = nn.GELU(approximate="tanh") if config.activation == "gelu" else nn.ReLU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(linear(linear(x, self.c_fc, self.act), self.c_proj))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.pre_norm = config.norm == "pre"
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, layer_kv=None, step: CacheStep | None = None) -> torch.Tensor:
        if self.pre_norm:  # GPT-2: x + f(LN(x))
            x = x + self.attn(self.ln_1(x), layer_kv, step)
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.attn(x, layer_kv, step))  # post-norm: LN(x + f(x))
        return self.ln_2(x + self.mlp(x))


def sinusoidal_table(n_pos: int, dim: int) -> torch.Tensor:
    """Fixed position encodings of "Attention is all you need": sin on even, cos on odd dims."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)
    return table.float()


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            # post-norm blocks already end in a LayerNorm, so there is no final one
            ln_f=(nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
                  if config.norm == "pre" else nn.Identity()),
        ))
        if config.position == "learned":
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        else:  # not a parameter and not saved: it is recomputed from the config
            self.register_buffer("pos_table", sinusoidal_table(config.block_size, config.n_embd), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: P = softmax(h · W_eᵀ)

        if self.lm_head.weight.device.type == "meta":  # a skeleton: the weights come from a file (`skeleton`)
            return
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 · n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def skeleton(cls, config: GPTConfig) -> GPT:
        """The model's modules on the meta device, uninitialised: for tensors that come from a file
        (`load_state_dict(assign=True)`) or to count them. PyTorch's layers fill their weights at random as they are
        made, and the first random fill on the meta device imports torch's Python reference kernels: ~1.8 s of a
        server's start-up, so the fills are skipped here (as transformers' `no_init_weights` does; not thread-safe:
        `nn.init` is patched while the modules are made)."""
        names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
        saved = {name: getattr(nn.init, name) for name in names}
        try:
            for name in names:
                setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
            with torch.device("meta"):
                return cls(config)
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @torch.no_grad()
    def pad_vocab(self, size: int) -> None:
        """Grow the tied embedding / output head to `size` rows of zeros (an inference-time layout change).

        The sampler then reads the logits as whole blocks without copying them (nanoGPT pads GPT-2's
        50257 to 50304 for matmul speed the same way); the extra ids are never text and never sampled.
        For serving only: training on a padded model would give the padding rows probability mass.
        """
        wte = self.transformer.wte
        if size <= wte.num_embeddings:
            return
        if hasattr(wte, "pad_rows"):  # a quantized table (model/linear.py) grows itself and remakes its head
            wte.pad_rows(size)
            self.lm_head = wte.head
            self.config = dataclasses.replace(self.config, vocab_size=size)
            return
        weight = torch.empty(size, wte.embedding_dim, dtype=wte.weight.dtype, device=wte.weight.device)
        weight[: wte.num_embeddings] = wte.weight  # written once (zeros first: GPT-2's 154 MB twice at start-up)
        weight[wte.num_embeddings:] = 0
        wte.weight = nn.Parameter(weight, requires_grad=wte.weight.requires_grad)
        wte.num_embeddings = size
        self.lm_head.weight = wte.weight
        self.lm_head.out_features = size
        self.config = dataclasses.replace(self.config, vocab_size=size)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once (the head is tied); without position embeddings by default, as GPT-2 reports."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tok = self.transformer.wte(idx)  # (B, T, C)
        pos = self.transformer.wpe(positions) if "wpe" in self.transformer else self.pos_table[positions]
        return self.transformer.drop(tok + pos)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) → the final hidden states (B, T, n_embd), after the last LayerNorm: what the tied output
        head reads (forward's logits are `hidden(idx) @ W_eᵀ`), and a task head too (model/task_head.py)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ContextLengthError(f"sequence of {T} tokens exceeds block_size {self.config.block_size}")
        x = self._embed(idx, torch.arange(T, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) → logits (B, T, vocab) and, given targets (B, T), the mean cross-entropy (-1 = ignore)."""
        logits = linear(self.hidden(idx), self.lm_head)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def forward_cached(self, idx: torch.Tensor, cache: KVCache, slots: list[int],
                       all_logits: bool = False, hidden: bool = False) -> torch.Tensor:
        """Append idx (B, T) to the cache slots (one row per slot) and return logits.

        Returns (B, vocab) logits of each row's last token, or (B, T, vocab) with all_logits.
        Computing the head only for the last token saves a (T × vocab) matmul per prefill.
        hidden: return the final hidden states (B, T, n_embd) instead (after ln_f), for a caller that applies
        `head` itself in pieces (the prompt's log-probabilities, engine/core.py).
        """
        B, T = idx.shape
        if B != len(slots):
            raise ValueError(f"{B} rows of tokens for {len(slots)} slots")
        step = cache.plan(slots, T)
        x = self._embed(idx, step.positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, (cache.k[i], cache.v[i]), step)
        cache.advance(slots, T)
        if hidden:
            return self.transformer.ln_f(x)
        if not all_logits:
            x = x[:, -1, :]
        return linear(self.transformer.ln_f(x), self.lm_head)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (..., n_embd) from `forward_cached(..., hidden=True)`."""
        return linear(h, self.lm_head)

    def decode_static(self, idx: torch.Tensor, cache: KVCache, kv_len: int | None = None,
                      exact: bool = False) -> torch.Tensor:
        """idx (B, T): T tokens for each of slots 0..B-1, at their next positions → logits (B, vocab) for T = 1,
        (B, T, vocab) for several (a speculative verification pass), with static shapes (`KVCache.plan_static`,
        attending over the first kv_len cache entries, default all); the caller advances the cache. The body that a
        CUDA graph captures. exact: attention as the eager step's (a CPU's compiled step of quantized weights:
        `model.decode_attention.attend_as_eager`; one token a row)."""
        T = idx.size(1)
        step = cache.plan_static(idx.size(0), kv_len, exact, T)
        x = self._embed(idx, step.positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, (cache.k[i], cache.v[i]), step)
        return linear(self.transformer.ln_f(x[:, -1, :] if T == 1 else x), self.lm_head)
