"""Device and dtype choice shared by the CLIs and the server: the GPU when present, bf16 there."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} GPU(s) are present")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":  # bf16 halves weight reads on the GPU; CPUs are fastest (and exact) in fp32
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]
