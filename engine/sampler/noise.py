"""Counter-based Gumbel noise, as vLLM's GPU sampler (`vllm/v1/worker/gpu/sample/gumbel.py`): the noise of token t
at step n of a request with seed s is a hash of (s, n, t), a pure function of the token id, so a seeded request gets
the same noise alone or in any batch."""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # Thomas Mueller's 32-bit mixer; < 2^27, so int64 products never overflow
STREAM_TOKEN, STREAM_BLOCK = 0, 1  # + 2 · round for the top-p redraws


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer on int64 tensors holding values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def seed_keys(seed: torch.Tensor) -> torch.Tensor:
    """A request seed (int64, < 2^63) folded into 32 well-mixed bits; computed once per request."""
    return _mix32(_mix32(seed & _M32) ^ ((seed >> 32) & _M32))


def row_keys(seed_key: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """(B,) keys of the random stream `stream` at generated position `position` of requests with these seed keys."""
    return _mix32(_mix32(seed_key ^ (position & _M32)) ^ (stream & _M32))


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise (B, N) float32 for ids (B, N) or (N,) under per-row keys (B,): a pure function."""
    x = _mix32(keys[:, None] ^ ids)
    x = _mix32(x ^ (keys[:, None] >> 7))
    u = (x.to(torch.float64) + 0.5) * 2.0**-32  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()

