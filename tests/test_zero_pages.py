"""model.zero_pages and the lazily allocated KV cache (model.kv_cache `resident=False`, engine.cache_pages): zeros
that are not resident until used, made resident without losing what was written meanwhile."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

import pytest
import torch

from engine.cache_pages import ResidentFill
from model import zero_pages
from model.config import GPTConfig
from model.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not zero_pages.supported(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE)")

MB = 1 << 20


def resident_bytes(t: torch.Tensor) -> int:
    """The resident bytes under `t` (mincore: the kernel's page table, page by page; smaps would merge neighbouring
    mappings)."""
    page = mmap.PAGESIZE
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    n, addr = n + addr % page, addr - addr % page  # whole pages (an eager tensor need not start on one)
    pages = (n + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(addr, n, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


def test_untouched_zeros_cost_nothing_until_made_resident():
    t = zero_pages.untouched_zeros((16, 1024, 1024), torch.float32)  # 64 MB
    assert t.shape == (16, 1024, 1024) and t.dtype == torch.float32
    assert resident_bytes(t) == 0
    zero_pages.make_resident(t)
    assert resident_bytes(t) == 64 * MB
    assert not t.any()


def test_making_pages_resident_keeps_what_a_writer_wrote_meanwhile():
    t = zero_pages.untouched_zeros((64, 256, 1024), torch.bfloat16)  # 32 MB, faulted in while rows are written
    fill = threading.Thread(target=zero_pages.make_resident, args=(t,))
    fill.start()
    for i in range(64 * 256):
        t[i // 256, i % 256, (i * 37) % 1024] = 1.0
    fill.join()
    assert resident_bytes(t) == 32 * MB
    assert int(t.count_nonzero()) == 64 * 256


CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=512, vocab_size=128)


def test_a_lazy_cache_is_resident_after_its_fill_and_an_eager_one_from_the_start():
    lazy = KVCache(CONFIG, 8, resident=False)
    assert not lazy.resident and resident_bytes(lazy.k[0]) == 0
    lazy.k[1][3, :, :5] = 2.0
    fill = ResidentFill(lazy).start()
    assert fill.wait(30) and fill.error is None and fill.seconds is not None
    assert lazy.resident and all(resident_bytes(t) == t.nbytes for t in lazy.k + lazy.v)
    assert float(lazy.k[1].sum()) == 2.0 * 4 * 5 * 16
    assert KVCache(CONFIG, 8).resident


def test_where_the_kernel_cannot_the_cache_is_written_at_allocation(monkeypatch):
    monkeypatch.setattr(zero_pages, "supported", lambda: False)
    cache = KVCache(CONFIG, 4, resident=False)
    assert cache.resident and all(resident_bytes(t) >= t.nbytes for t in cache.k + cache.v)


def test_a_fill_the_kernel_refuses_leaves_the_cache_lazy_and_working(monkeypatch, caplog):
    cache = KVCache(CONFIG, 4, resident=False)

    def refuse(t):
        raise OSError(22, "madvise(MADV_POPULATE_WRITE): Invalid argument")

    monkeypatch.setattr(zero_pages, "make_resident", refuse)
    with caplog.at_level(logging.WARNING, logger="engine.cache_pages"):
        fill = ResidentFill(cache).start()
        assert fill.wait(30)
    assert fill.error == "OSError: [Errno 22] madvise(MADV_POPULATE_WRITE): Invalid argument"
    assert not cache.resident
    assert [r.getMessage() for r in caplog.records] == [
        "the KV cache stays lazily allocated (decodes slower): " + fill.error]
    cache.v[0][1, 2, 3, 4] = 1.5
    assert float(cache.v[0].sum()) == 1.5


def test_a_cache_the_host_cannot_map_is_a_sizing_error_naming_it(monkeypatch):
    """A mapping the kernel refuses (ENOMEM: larger than memory and swap) is the engine's sizing error, one line,
    as an allocation that fails was."""
    from engine.runner import ModelRunner
    from engine.sizing import SizingError
    from tests.helpers import tiny_model

    def refuse(shape, dtype):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(zero_pages, "untouched_zeros", refuse)
    with pytest.raises(SizingError, match=r"cannot allocate the KV cache \(4 slots x 32 tokens\): OSError: .*memory"):
        ModelRunner(tiny_model(0, vocab_size=64, block_size=32), n_slots=4, vocab_size=64)
