"""Device and dtype choice shared by the CLIs and the server: the GPU when present, bf16 there."""

from __future__ import annotations

import glob
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the server's settings parse these names before the engine core's process
# starts, and a front that imports torch first started the core ~2 s later (docs/performance.md, "Start-up")
NAMES = ("fp32", "bf16", "fp16")  # DTYPES' keys


def __getattr__(name: str):
    """DTYPES (short name → torch dtype) and DTYPE_NAMES (its inverse), made on first use (PEP 562)."""
    if name in ("DTYPES", "DTYPE_NAMES"):
        import torch

        dtypes = dict(zip(NAMES, (torch.float32, torch.bfloat16, torch.float16)))
        globals().update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dtypes() -> dict:
    return globals().get("DTYPES") or __getattr__("DTYPES")

DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's names (training configs use them)


def device_name(name: str) -> str:
    """The one parser of device names (the server's settings, the CLIs, training configs): auto, cpu, cuda or cuda:N,
    any case → lower case; ValueError otherwise. Whether that device exists is resolve_device's question."""
    n = name.strip().lower()
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", n):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return n


def dtype_name(name: str) -> str:
    """The one parser of dtype names: auto, fp32 / bf16 / fp16 or torch's float32 / bfloat16 / float16, any case →
    auto or the short name; ValueError otherwise."""
    n = name.strip().lower()
    n = DTYPE_ALIASES.get(n, n)
    if n != "auto" and n not in NAMES:
        raise ValueError(f"dtype must be auto, {', '.join(NAMES)} (or {', '.join(DTYPE_ALIASES)}), got {name!r}")
    return n


def reserved_gpu() -> str | None:
    """What says this process was given an NVIDIA GPU (a device node, or the container runtime's
    NVIDIA_VISIBLE_DEVICES naming one), or None."""
    nodes = sorted(p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia"):].isdigit())
    if nodes:
        return nodes[0]
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if visible and visible.lower() not in ("void", "none"):
        return f"NVIDIA_VISIBLE_DEVICES={visible}"
    return None


def resolve_device(name: str = "auto") -> torch.device:
    """auto: the GPU when torch can use one, else the CPU, except where a GPU was given to this process but torch
    cannot use it (a CPU build of torch, or a CUDA build newer than the driver): that is a deployment error, not a
    reason to serve on the CPU at a fraction of the speed, so it fails with one line (ValueError); --device cpu
    says the CPU is meant."""
    import torch

    name = device_name(name)
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        gpu = reserved_gpu()
        if gpu is not None:
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
            raise ValueError(f"a GPU is reserved ({gpu}) but torch {torch.__version__} ({build}) cannot use it "
                             f"(torch.cuda.is_available() is False: a driver older than the build needs, or no "
                             f"CUDA build); install a torch build this driver runs (the image: --build-arg "
                             f"TORCH_VARIANT=cu128 or cu126) or pass --device cpu to serve on the CPU")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} GPU(s) are present")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    name = dtype_name(name)
    if name == "auto":  # bf16 halves weight reads on the GPU; CPUs are fastest (and exact) in fp32
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return _dtypes()[name]
