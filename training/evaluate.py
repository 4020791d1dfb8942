"""Loss, perplexity and bits per byte of a checkpoint on a text.

Usage::

    python -m training.evaluate --checkpoint checkpoints/shakespeare --input val.txt [--block-size N]
        [--batch-size B] [--stride S] [--kv-cache-dtype bf16]

Prints one JSON object: loss (mean nats per predicted token), perplexity
(exp(loss)), bits_per_byte (total nats / (bytes · ln 2)), tokens, predicted_tokens,
bytes, block_size, stride.

Windows (strided, "sliding window" evaluation): every token after the first is
predicted exactly once. Window k feeds the tokens t[a : a+W] (W = block size,
a = k·stride) and scores only the targets not scored by an earlier window, so each
scored token sees at least W - stride + 1 tokens of context (the first W tokens see
all the text before them). stride = W gives non-overlapping windows (the first target
of each window then has one token of context). The last window is moved back to
end at the last token, so it has a full W of context. The very first token of the
text has no context and is not predicted: predicted_tokens = tokens - 1, and its
bytes still count in `bytes` (a negligible bias for any real text).

`--kv-cache-dtype`: score as the server decodes: each window token by token through a KV cache of that dtype
(`GPT_KV_CACHE_DTYPE`), attended by the server's compiled decode attention on a CPU (model/decode_attention.py),
so what a 16-bit cache costs in quality is measured on the path that serves it. Default: one forward pass a window.

Inputs are read like training.prepare: files and folders (every *.txt below),
UTF-8, streamed and encoded in chunks, with <|endoftext|> between files;
`bytes` counts the text only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from model import decode_attention
from model.checkpoint import CheckpointError, load_checkpoint
from model.device import DTYPES
from model.kv_cache import KVCache
from model.linear import DEFAULT_INT4_GROUP, FORMATS, INT4_GROUPS, FormatError, convert
from training.lm.data import DataError, encode_stream
from training.text import resolve_inputs

PROG = "python -m training.evaluate"


def plan_windows(n_tokens: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """(start a, length L, first scored index k): inputs t[a:a+L], targets t[a+1:a+L+1], scored from k on.

    Scores every target position 1..n_tokens-1 exactly once.
    """
    if not 1 <= stride <= block_size:
        raise ValueError(f"stride must be in [1, block_size={block_size}], got {stride}")
    last = n_tokens - 1  # the last target position
    windows, scored, a = [], 0, 0
    while scored < last:
        length = min(block_size, last - a)
        if length < block_size:  # the last window: move it back for a full context
            a = max(0, last - block_size)
            length = last - a
        k = scored + 1 - (a + 1)
        windows.append((a, length, k))
        scored = a + length
        a += stride
    return windows


def window_logits(model, x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """Logits (B, T, V) of the windows x (B, T): one forward pass, or through `cache` as the server decodes them:
    one token a step in slots 0..B-1, each attending to the keys and values stored in the cache's dtype (by its
    decode attention, if set), after the first two tokens as a two-token prompt (the server's shortest decode
    attends to two keys)."""
    if cache is None:
        return model(x)[0]
    rows = list(range(x.size(0)))
    for r in rows:
        cache.reset(r)
    first = min(2, x.size(1))
    return torch.cat([model.forward_cached(x[:, :first], cache, rows, all_logits=True)]
                     + [model.forward_cached(x[:, t:t + 1], cache, rows, all_logits=True)
                        for t in range(first, x.size(1))], dim=1)


@torch.inference_mode()  # as the server decodes
def evaluate_tokens(model, tokens: np.ndarray, block_size: int, stride: int, batch_size: int,
                    device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None) -> tuple[float, int]:
    """Total nats over all predicted tokens, and their number (`window_logits`: `kv_dtype` scores through a KV
    cache)."""
    windows = plan_windows(len(tokens), block_size, stride)
    t = torch.from_numpy(tokens.astype(np.int64))
    total, count = 0.0, 0
    cache = None
    if kv_dtype is not None:  # one cache of every window's shape: the compiled attention is built for it once (~10 s)
        cache = KVCache(model.config, batch_size, block_size, dtype=kv_dtype, device=device)
        if cache.device.type == "cpu":  # the server's one-token attention on a CPU
            cache.decode_attention = decode_attention.build(cache.k[0])
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        length = group[0][1]  # every window has the same length (only a lone window may be shorter)
        x = torch.stack([t[a:a + length] for a, _, _ in group]).to(device)
        y = torch.stack([t[a + 1:a + 1 + length] for a, _, _ in group]).to(device)
        mask = torch.stack([torch.arange(length, device=device) >= k for _, _, k in group])
        logits = window_logits(model, x, cache)
        nll = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
        nll = nll.view(len(group), length)
        total += nll[mask].double().sum().item()
        count += int(mask.sum())
    return total, count


def evaluate(checkpoint: str, inputs: list[str], block_size: int | None = None, batch_size: int = 8,
             stride: int | None = None, device: str = "cpu", quantize: str = "none",
             int4_group: int = DEFAULT_INT4_GROUP, dtype: str = "fp32", kv_cache_dtype: str | None = None) -> dict:
    """Bits per byte of the checkpoint on the inputs, served in a weight format (`quantize`: the server's
    model.linear.convert, so a format's quality is measured on the code that serves it) and dtype."""
    files = resolve_inputs(inputs)
    ck = load_checkpoint(checkpoint, device=device, dtype=DTYPES[dtype])
    if quantize != "none":
        convert(ck.model, quantize, int4_group)
    W = block_size or ck.config.block_size
    if not 1 <= W <= ck.config.block_size:
        raise DataError(f"--block-size must be in [1, {ck.config.block_size}] (the model's context), got {W}")
    S = stride or max(1, W // 2)
    if not 1 <= S <= W:
        raise DataError(f"--stride must be in [1, block size {W}], got {S}")
    if batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {batch_size}")
    parts, n_bytes = [], 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        if parts:
            parts.append(np.array([ck.tokenizer.eot_id], dtype=np.int64))
        parts.extend(encode_stream(ck.tokenizer, f))
        n_bytes += size
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if n_bytes == 0:
        raise DataError(f"input is empty: no text in {', '.join(map(str, files))}")
    if len(tokens) < 2:
        raise DataError(f"the input is {len(tokens)} token(s) long; at least 2 are needed (one to predict)")
    t0 = time.perf_counter()
    total, count = evaluate_tokens(ck.model.eval(), tokens, W, S, batch_size, device,
                                   DTYPES[kv_cache_dtype] if kv_cache_dtype else None)
    loss = total / count
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": total / (n_bytes * math.log(2)),
        "tokens": int(len(tokens)),
        "predicted_tokens": count,
        "bytes": n_bytes,
        "block_size": W,
        "stride": S,
        "checkpoint": str(checkpoint),
        "format": quantize, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
        "int4_group": int4_group if quantize == "int4" else None,
        "input": [str(f) for f in files],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Evaluate a checkpoint on UTF-8 text: prints one JSON object with loss (nats/token), "
                    "perplexity, bits_per_byte, tokens, predicted_tokens and bytes. Strided windows: every token "
                    "but the first is predicted once, with at least block_size - stride + 1 tokens of context.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint directory (e.g. OUT/best)")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="UTF-8 text files and/or folders (every *.txt below), joined with <|endoftext|>")
    p.add_argument("--block-size", type=int, metavar="N", help="window length (default: the model's block_size)")
    p.add_argument("--stride", type=int, metavar="S",
                   help="window step (default: block size // 2; = block size for non-overlapping windows)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="windows per forward pass (default: 8)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--quantize", choices=FORMATS, default="none",
                   help="score the weights in this format, as the server's --quantize serves them")
    p.add_argument("--int4-group-size", type=int, default=DEFAULT_INT4_GROUP, choices=INT4_GROUPS)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (default: fp32)")
    p.add_argument("--kv-cache-dtype", choices=("fp32", "bf16", "fp16"),
                   help="score as the server decodes: token by token through a KV cache of this dtype (slower; "
                        "default: one forward pass a window)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{PROG}: error: --device {device}: CUDA is not available", file=sys.stderr)
        return 2
    if not (device == "cpu" or device.startswith("cuda")):
        print(f"{PROG}: error: --device must be auto, cpu, cuda or cuda:N, got {device!r}", file=sys.stderr)
        return 2
    try:
        result = evaluate(args.checkpoint, args.input, args.block_size, args.batch_size, args.stride, device,
                          args.quantize, args.int4_group_size, args.dtype, args.kv_cache_dtype)
    except (DataError, CheckpointError, FormatError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{PROG}: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
