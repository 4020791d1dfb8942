"""Data parallel plumbing: torchrun/DDP setup (NCCL on GPU, gloo on CPU), rank checks and the few collectives
the training loop needs, each a no-op in a single process."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from training.errors import TrainError


@dataclasses.dataclass
class Dist:
    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world: int = 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place."""
        if self.enabled:
            dist.all_reduce(t)
        return t

    def mean_(self, t: torch.Tensor) -> torch.Tensor:
        """Average t over the ranks, in place."""
        if self.enabled:
            dist.all_reduce(t)
            t /= self.world
        return t

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order (collective: every rank takes part)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def rank0_decides(self, flag: bool, device: torch.device) -> bool:
        """Rank 0's flag on every rank (collective), so that all ranks take the same branch."""
        if not self.enabled:
            return flag
        t = torch.tensor(float(flag), device=device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The model to train: DistributedDataParallel around it when distributed, else itself."""
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def no_sync(self, model: torch.nn.Module, sync: bool):
        """Skip DDP's gradient all-reduce on micro-batches before the last one of a step."""
        return model.no_sync() if self.enabled and not sync else contextlib.nullcontext()

    def finish(self) -> None:
        """Wait for every rank at the end of training (rank 0 may still be saving) before the group is torn down: a
        rank tearing gloo down while its peer was still at work aborted ("terminate called without an active
        exception") in a CI run. Only after a run that ended well: a failed peer would never arrive."""
        if self.enabled and dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def launched_as_rank0() -> bool:
    """True in a single process and in torchrun's rank 0 (readable before the process group exists)."""
    return os.environ.get("RANK", "0") == "0"


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
