"""How many KV-cache slots the engine core gets: the one place memory settings become a slot count.

A slot holds one full-length sequence: keys and values of every layer, `2 · n_layer · context · n_embd` elements in
the cache's dtype, plus the sampler's per-slot rows (a 4 MiB allowance). With a draft model (speculative decoding,
engine/spec_decode/draft.py) each slot also has the draft's own KV slot, in the same dtype, as long as the context
or the draft's block_size if shorter (`slot_kv_bytes`): start-up's fit check and the slot count both take a slot as
the two together. The budget for them (`GPT_KV_CACHE_MEMORY`) is bytes ("4GiB", "512MB", "1000000") or a fraction
(0 < x <= 1) of the memory available once the weights (a draft's too) are loaded: the GPU's free memory
(`torch.cuda.mem_get_info`) or, on a CPU, the kernel's MemAvailable. Left unset it is `kv_cache_memory_fraction`
(0.5) of that, as vLLM's `gpu_memory_utilization` / `VLLM_CPU_KVCACHE_SPACE` bound theirs.
The default slot count is then as many as the budget holds, up to 32 on a CPU (sampled traffic stops scaling
past that on 2 cores: bench/stack.py, bench/serve.py) and 256 on a GPU; a budget that holds no slot is a one-line
start-up error saying what would fit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the server's settings parse memory sizes before torch loads (app/config.py)
    import torch

CPU_DEFAULT_BATCH = 32
GPU_MAX_BATCH = 256
# the sampler's rows (three fp32 vocabulary-wide workspaces and its seen-token set: ~0.7 MB for GPT-2's 50k
# vocabulary) and the logits of a step: a 4 MiB allowance per slot covers vocabularies up to ~200k
SLOT_ALLOWANCE = 4 * 1024 * 1024
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class SizingError(ValueError):
    """The memory settings cannot give the engine one slot; one line saying what would fit."""


def parse_memory(value: str | float | int | None) -> tuple[str, float] | None:
    """None / "auto" → None; "0.3" → ("fraction", 0.3); "4GiB" / "512MB" / "1000000" → ("bytes", n)."""
    if value is None:
        return None
    text = str(value).strip().lower().replace(" ", "")
    if text in ("", "auto"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]i?b|b)?", text)
    if not m:
        raise SizingError(f"kv_cache_memory must be bytes (e.g. 4GiB, 512MB) or a fraction in (0, 1], got {value!r}")
    number, unit = float(m.group(1)), m.group(2) or ""
    if not unit and number <= 1:
        if number <= 0:
            raise SizingError(f"kv_cache_memory must be > 0, got {value!r}")
        return "fraction", number
    return "bytes", number * _UNITS[unit]


def available_memory(device: torch.device) -> int:
    """Bytes free for the cache now: the GPU's free memory, or on a CPU the kernel's MemAvailable, or less where this
    process's cgroup (a container's `--memory`, a pod's limit) leaves less: the host's MemAvailable does not see it."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = cgroup_headroom()
    return free if headroom is None else min(free, headroom)


def cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup may still use: its limit less what it holds that cannot be dropped
    (usage less inactive file pages, as `docker stats` counts); None without a limit. cgroup v2 (`memory.max`)
    or v1 (`memory/memory.limit_in_bytes`), read at the mount root as a container sees its own group."""
    for limit_f, usage_f, stat_f, inactive in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                               ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                                "memory/memory.stat", "total_inactive_file")):
        try:
            limit = (root / limit_f).read_text().strip()
            usage = int((root / usage_f).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:  # no limit (v1 writes one near 2^63)
            return None
        try:
            stat = dict(line.partition(" ")[::2] for line in (root / stat_f).read_text().splitlines())
        except OSError:
            stat = {}
        return max(0, int(limit) - (usage - int(stat.get(inactive, 0))))
    return None


def kv_bytes_per_slot(n_layer: int, n_embd: int, context: int, dtype: torch.dtype) -> int:
    import torch

    return 2 * n_layer * context * n_embd * torch.empty((), dtype=dtype).element_size()


def slot_kv_bytes(n_layer: int, n_embd: int, context: int, dtype: torch.dtype, draft=None) -> tuple[int, int]:
    """KV bytes of one full-length slot: (the served model's, the draft model's). `draft`: the draft's config
    (n_layer, n_embd, block_size) or None (0 bytes); its slot holds min(context, draft.block_size) tokens in the
    served cache's dtype (DraftProposer's cache, one slot per engine slot). The one rule for what a slot costs:
    `plan_slots` and start-up's fit check (engine/build.check_fits) both use it."""
    kv = kv_bytes_per_slot(n_layer, n_embd, context, dtype)
    if draft is None:
        return kv, 0
    return kv, kv_bytes_per_slot(draft.n_layer, draft.n_embd, min(context, draft.block_size), dtype)


@dataclass
class SlotPlan:
    slots: int
    per_slot: int  # KV bytes of one full-length slot (the served model's)
    budget: int  # bytes the cache may take
    available: int  # bytes free when the plan was made
    draft_per_slot: int = 0  # KV bytes of the draft model's slot beside each one (speculative decoding)

    @property
    def kv_bytes(self) -> int:
        return self.slots * (self.per_slot + self.draft_per_slot)


def gib(n: float) -> str:
    """n bytes in GiB; below 0.01 GiB (which would read 0.00) in MiB, or KiB."""
    if n >= 0.01 * 2**30 or n == 0:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 0.01 * 2**20 else f"{n / 2**10:.2f} KiB"


def plan_slots(n_layer: int, n_embd: int, context: int, device: torch.device, kv_dtype: torch.dtype, *,
               max_batch_size: int | None = None, kv_cache_memory: str | float | None = None,
               memory_fraction: float = 0.5, available: int | None = None, draft=None) -> SlotPlan:
    """Slots for the cache: `max_batch_size` when given (it must fit an explicit budget), else as many as the budget
    holds, capped (32 on a CPU, 256 on a GPU). `draft`: the draft model's config: a slot then costs its KV slot too
    (`slot_kv_bytes`). `available` overrides the measured free memory (tests)."""
    import torch

    free = available_memory(device) if available is None else available
    kv, draft_kv = slot_kv_bytes(n_layer, n_embd, context, kv_dtype, draft)
    per_slot = kv + draft_kv + SLOT_ALLOWANCE
    spec = parse_memory(kv_cache_memory)
    if spec is None:
        budget = int(free * memory_fraction)
    elif spec[0] == "fraction":
        budget = int(free * spec[1])
    else:
        budget = int(spec[1])
    fits = budget // per_slot
    if max_batch_size is not None:
        if spec is not None and max_batch_size > fits:
            raise SizingError(f"max_batch_size {max_batch_size} needs {gib(max_batch_size * per_slot)} of KV cache "
                              f"({gib(per_slot)} a full-length slot) but kv_cache_memory gives {gib(budget)}: "
                              f"{fits} slot(s) fit")
        return SlotPlan(max_batch_size, kv, budget, free, draft_kv)
    if fits < 1:
        with_draft = f", the draft model's {gib(draft_kv)} of it" if draft_kv else ""
        raise SizingError(
            f"the KV-cache budget ({gib(budget)} of {gib(free)} available) holds no full-length slot: one needs "
            f"{gib(per_slot)} ({n_layer} layers x {context} tokens x {n_embd} dims x 2 in "
            f"{str(kv_dtype).removeprefix('torch.')}{with_draft}); raise GPT_KV_CACHE_MEMORY"
            f"{', use GPT_KV_CACHE_DTYPE=bf16' if kv_dtype == torch.float32 else ''}, or free memory")
    cap = GPU_MAX_BATCH if device.type == "cuda" else CPU_DEFAULT_BATCH
    return SlotPlan(min(cap, fits), kv, budget, free, draft_kv)
