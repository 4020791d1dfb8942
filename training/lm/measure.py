"""The language model's evaluation loss: the mean loss over fixed windows of a split (training and bench)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from training.distributed import Dist
from training.lm.data import window_batch


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
