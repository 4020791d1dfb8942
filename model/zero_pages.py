"""Zeroed host memory that costs nothing until it is touched, and made resident later without a write.

A server's KV cache on a CPU is gigabytes of zeros (GPT-2 124M, 32 slots of 1,024 fp32 positions: 2.4 GB), and
writing them at allocation was the largest item of its start (0.7-0.85 s on a 2-vCPU VM: the kernel zeroes every
4 KiB page it faults in). Here the tensor lies on a fresh anonymous mapping (the kernel's zero pages, untouched) and
`make_resident` faults its pages in with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14), which writes nothing a
thread has written meanwhile, so it can run in the background while the cache is in use. A cache left untouched
decoded 16 streams ~7% slower (docs/performance.md, 2025-11-25): the pages are made resident, only later.
Elsewhere (another OS, an older kernel): `untouched_zeros` returns None and the caller allocates as before.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from functools import cache

import torch

MADV_POPULATE_WRITE = 23  # <asm-generic/mman-common.h>, Linux 5.14+
CHUNK_BYTES = 32 << 20  # one madvise call: a reader of the mapping's lock never waits on more than this


@cache
def _madvise():
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # a CDLL call releases the GIL
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _populate(addr: int, nbytes: int) -> None:
    fn = _madvise()
    if fn is None:
        raise OSError("madvise is not available")
    for off in range(0, nbytes, CHUNK_BYTES):
        if fn(addr + off, min(CHUNK_BYTES, nbytes - off), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")


@cache
def supported() -> bool:
    """Whether this host can make a mapping resident without writing it (probed once on one page)."""
    if _madvise() is None:
        return False
    page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = torch.frombuffer(page, dtype=torch.uint8)
        _populate(view.data_ptr(), mmap.PAGESIZE)
        return True
    except OSError:
        return False
    finally:
        del view
        page.close()


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zero tensor on its own anonymous mapping, none of it resident yet; None where `make_resident` cannot work."""
    numel = math.prod(shape)
    if numel == 0 or not supported():
        return None
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it alive
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def make_resident(t: torch.Tensor) -> None:
    """Fault in every page under `t` (from `untouched_zeros`) without changing what is there: safe beside a thread
    that writes into it. OSError if the kernel refuses."""
    _populate(t.data_ptr(), t.numel() * t.element_size())
