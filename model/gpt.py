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
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig
from model.kv_cache import CacheStep, ContextLengthError, KVCache


def _onednn_linear_op():
    """oneDNN's fused linear (what inductor uses on CPU), or None where this torch build lacks it."""
    if os.environ.get("GPT_ONEDNN_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


# On CPU, fp32 nn.Linear goes to MKL, whose GEMV on this project's 2-core AMD machines uses one core
# (GPT-2 124M's 49 batch-1 matmuls: 36.8 ms, 13.6 GB/s) and whose small-batch GEMM is slow (batch 8:
# 56 ms). oneDNN's inner product reads the same (out, in) weights, no copy, over both threads: 21.4 ms
# (24 GB/s) and 30 ms (bench/README.md). It has no autograd formula, so it serves only passes that need
# no gradient: inference, and the full-recompute reference under no_grad. GPT_ONEDNN_LINEAR=0 turns it off.
ONEDNN_LINEAR = _onednn_linear_op()

# Which library wins at one to three rows depends on the CPU and the weight's shape: on an Intel Xeon with AVX-512 (2
# cores, 2026-11-24) MKL's GEMV ran GPT-2 124M's block matmuls faster than oneDNN at one row (c_fc 0.19 vs 0.24 ms,
# mlp c_proj 0.20 vs 0.32) but not the 50k-row output head (4.7 vs 4.3 ms), and oneDNN (packed) was ahead from 4
# rows up (the 48 block matmuls, cycling through the weights: 3 rows 14.5 vs 16.3 ms, 4 rows 22.8 vs 15.8; a batch-3
# decode step 26.0 -> 24.0-25.5 ms with 3 rows here); on the AMD EPYC above MKL's GEMV used one core. So calls with
# <= SMALL_ROWS rows pick, per weight shape, the faster of the two, timed once per process at the first such call
# (`GPT_SMALL_LINEAR`: auto, mkl or onednn for all).
SMALL_ROWS = 3
_FORCED_SMALL = {"mkl": "mkl", "onednn": "onednn"}.get(os.environ.get("GPT_SMALL_LINEAR", "auto"))
_small_backend: dict[tuple, str] = {}


def _pick_small_backend(x: torch.Tensor, w_mkl: torch.Tensor, w_onednn: torch.Tensor, b: torch.Tensor | None) -> str:
    """Time F.linear (MKL) against oneDNN, each on the weight it would read, with one row, interleaved; MKL only if
    clearly faster."""
    x1 = x.reshape(-1, x.shape[-1])[:1].contiguous()
    runs = {"mkl": lambda: F.linear(x1, w_mkl, b), "onednn": lambda: ONEDNN_LINEAR(x1, w_onednn, b, "none", [], "")}
    calls = max(1, min(5, int(5e6 // w_mkl.numel())))  # ~20 ms a backend at most, even for a large output head
    for f in runs.values():  # first calls set up threads and primitives
        for _ in range(2):
            f()
    ratios = []
    for _ in range(7):
        t = {}
        for name, f in runs.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            t[name] = time.perf_counter() - t0
        ratios.append(t["mkl"] / t["onednn"])
    return "mkl" if sorted(ratios)[len(ratios) // 2] < 0.9 else "onednn"


def _post_op(act: nn.Module | None) -> tuple[str, str] | None:
    """The oneDNN post-op computing `act` inside the matmul, or None where there is none."""
    if act is None:
        return "none", ""
    if type(act) is nn.GELU:
        return ("gelu", "tanh") if act.approximate == "tanh" else ("gelu", "none")
    if type(act) is nn.ReLU:
        return "relu", ""
    return None


def linear(x: torch.Tensor, layer: nn.Linear, act: nn.Module | None = None) -> torch.Tensor:
    """act(layer(x)), through oneDNN when no gradient is needed on a CPU fp32 tensor (same math, faster;
    the activation is fused into the matmul there), from the layer's prepacked weight where `prepack` made one."""
    if type(layer) is not nn.Linear:  # a swapped-in module (quantized, adapter, ...) does its own thing
        y = layer(x)
        return act(y) if act is not None else y
    w, b = layer.weight, layer.bias
    if (ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and w.dtype == torch.float32 and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        packed = layer.__dict__.get("_packed")
        if packed is not None and (packed.source is not w or packed.version != w._version):
            packed = None  # w changed since the copies were made: read it plain
        rows = x.numel() // x.shape[-1]
        if rows <= SMALL_ROWS:
            # one row: MKL's GEMV reads prepack's column-major copy faster than the plain weight (not at two rows)
            w_mkl = packed.column_major if packed is not None and rows == 1 else w
            key = (w.shape, w_mkl is not w)
            backend = _FORCED_SMALL or _small_backend.get(key)
            if backend is None:
                backend = _small_backend[key] = _pick_small_backend(x, w_mkl, packed.weight if packed else w, b)
            if backend == "mkl":
                y = F.linear(x, w_mkl, b)
                return act(y) if act is not None else y
        if packed is not None:
            w = packed.weight
        post = _post_op(act)
        if post is not None:
            return ONEDNN_LINEAR(x, w, b, post[0], [], post[1])
        return act(ONEDNN_LINEAR(x, w, b, "none", [], ""))
    y = F.linear(x, w, b)
    return act(y) if act is not None else y


class _PackedWeight:
    """A Linear weight in oneDNN's blocked layout and column-major (GPT.prepack), with the weight and version they
    were made from. An opaque tensor cannot be copied or pickled: a deep copy or a pickled model gets None (it reads
    plain weights)."""

    __slots__ = ("weight", "column_major", "source", "version")

    def __init__(self, w: torch.Tensor) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        self.column_major = w.detach().t().contiguous().t()  # the same (out, in) tensor, its transpose in memory
        self.source, self.version = w, w._version

    def __reduce__(self):
        return _no_packed_weight, ()


def _no_packed_weight() -> None:
    return None


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
            k, v = step.update(*layer_kv, k, v)  # (B, H, S, D)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, is_causal=step.is_causal)
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

        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 · n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

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
        weight = torch.zeros(size, wte.embedding_dim, dtype=wte.weight.dtype, device=wte.weight.device)
        weight[: wte.num_embeddings] = wte.weight
        wte.weight = nn.Parameter(weight, requires_grad=wte.weight.requires_grad)
        wte.num_embeddings = size
        self.lm_head.weight = wte.weight
        self.lm_head.out_features = size
        self.config = dataclasses.replace(self.config, vocab_size=size)

    @torch.no_grad()
    def prepack(self) -> int:
        """Give every nn.Linear a copy of its weight in oneDNN's blocked layout (CPU, fp32; an inference-time
        addition, as inductor's weight prepacking): above SMALL_ROWS rows `linear` reads that copy instead of
        reordering the plain weight on every call. Costs the weights' memory once more; a weight changed afterwards
        (in place or replaced) is noticed and read plain again. Returns the layers packed (0 where oneDNN is not used).

        Measured on 2 Xeon cores (GPT-2 124M, engine decode step, 2 threads): batch 16 51-53 -> 44 ms, batch 64
        104-109 -> 97 ms; up to SMALL_ROWS rows MKL may read the plain weight instead (below). Packing with a
        batch-size hint (inductor's static-shape case) did not help: a hint of 16 ran batch 16 no faster (45 ms), a
        hint of 1 was no better than plain weights at 16 and 64.

        Each weight also gets a column-major copy (the same (out, in) tensor, its transpose contiguous): at one row
        MKL's GEMV reads that layout faster. GPT-2 124M's 48 block matmuls, cycling through all weights as decode
        does: 12.0 -> 10.9 ms at one row (30 -> 33 GB/s), while at two rows it is 19.8 ms against 13.3 plain (so two
        rows keep reading the plain weight). A batch-1 decode step 23.1 -> 21.4 ms (medians of 40 steps, 3 per
        process, 3 processes per version, interleaved; 2 Xeon cores, 2026-11-24, /tmp/p20/b12.py); batch 2
        unchanged (24.7 -> 24.5). The price: the weights' memory a third time (GPT-2 124M: idle PSS 4.1 -> 4.5 GB),
        kept even where the one-row timing then picks oneDNN."""
        if ONEDNN_LINEAR is None:
            return 0
        n = 0
        for m in self.modules():
            if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
                m.__dict__["_packed"] = _PackedWeight(m.weight)
                n += 1
        return n

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

    def decode_static(self, idx: torch.Tensor, cache: KVCache, kv_len: int | None = None) -> torch.Tensor:
        """idx (B, 1): one token for each of slots 0..B-1 → logits (B, vocab), with static shapes
        (`KVCache.plan_static`, attending over the first kv_len cache entries, default all); the caller advances
        the cache. The body that a CUDA graph captures."""
        step = cache.plan_static(idx.size(0), kv_len)
        x = self._embed(idx, step.positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, (cache.k[i], cache.v[i]), step)
        return linear(self.transformer.ln_f(x[:, -1, :]), self.lm_head)
