"""The process heap (glibc's malloc): freed memory kept resident for a server's steady state, and given back once
after loading or a compile. Called before torch loads (engine.core_process), so nothing here imports it."""

from __future__ import annotations

import ctypes
import os


def keep_freed_memory() -> bool:
    """glibc's malloc: blocks up to 32 MiB come from the heap, and what is freed stays there (no trim below 1 GiB),
    so a prefill's activations (~6 MiB each for a 512-token GPT-2 prompt) reuse pages already mapped. By default
    glibc maps such blocks afresh and unmaps them when freed (its threshold only moves up after a free), so a
    prompt longer than the last ones pays a page fault for every 4 KiB it touches (docs/performance.md has the
    timings). The heap keeps its peak afterwards (a server's working set). Skipped where the user set glibc's
    own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, and where mallopt does not exist (not glibc). Returns
    whether it applied."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def release_freed_memory() -> None:
    """Give the heap's free pages back to the kernel once (glibc's malloc_trim), after loading: the weights as
    stored (fp32) are freed when the engine swaps in their served copy (packed, int8, int4), but `keep_freed_memory`
    keeps freed blocks resident (docs/performance.md: the idle memory it gives back)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
