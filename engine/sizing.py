"""How many KV-cache slots the engine core gets: the one place the server's memory settings become a slot count."""

from __future__ import annotations

import torch

CPU_DEFAULT_BATCH = 32  # bench/stack.py and bench/serve.py: sampled traffic keeps scaling past 16 streams on 2 cores


def default_max_batch_size(n_layer: int, n_embd: int, block_size: int, device: torch.device, dtype: torch.dtype,
                           memory_fraction: float) -> int:
    """Slots that fit the device: on a GPU, `memory_fraction` of its free memory in full-length KV-cache slots
    (keys and values of every layer, plus the sampler's per-slot state), 8..256; on a CPU a fixed 32."""
    if device.type != "cuda":
        return CPU_DEFAULT_BATCH
    free, _total = torch.cuda.mem_get_info(device)
    kv = 2 * n_layer * block_size * n_embd * torch.empty((), dtype=dtype).element_size()
    # the sampler's rows (three fp32 vocabulary-wide workspaces and its seen-token set: ~0.7 MB for GPT-2's
    # 50k vocabulary) and the logits of a step: a 4 MiB allowance per slot covers vocabularies up to ~200k
    per_slot = kv + 4 * 1024 * 1024
    return max(8, min(256, int(free * memory_fraction) // per_slot))
