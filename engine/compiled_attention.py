"""The compiled decode attention of a CPU's KV cache (model.decode_attention: one token a row, at every batch), built
in the background and kept on disk.

AOTInductor's compile of the attention takes ~12 s, so, like the compiled decode steps (engine.compiled_decode), it
runs in a thread at idle priority while the engine serves with its per-row SDPA calls, and the engine hands the
result to its cache at a step boundary (ModelRunner.poll_compiled). The package is kept in the compile cache
(`ATTENTION`/<key>.pt2, the key: the cache's shape and dtype, the queries' dtype, this CPU and ATen's capability on
it, the threads, torch and the code), so a restart loads it in milliseconds; one that does not load is compiled
again. A compile that fails leaves SDPA in place, with one log line.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

from engine import compiled_decode
from engine.compiled_decode import COMPILE_LOCK, code_digest, one_line, probe_vec_isa, scratch_inductor_cache
from engine.idle_job import IdleJob
from model import decode_attention
from model.cpu_support import cpu_flags
from model.kv_cache import KVCache

log = logging.getLogger(__name__)

ATTENTION = "attention"  # the compile cache's folder of attention packages


def wanted(cache: KVCache, mode: str) -> bool:
    """Whether this cache's decode attention is compiled: a cache on a CPU in 16 bits or fp32, unless compiling is
    off."""
    return mode != "off" and cache.device.type == "cpu" and cache.k[0].element_size() in (2, 4)


class AttentionBuild(IdleJob):
    """One background compile of `model.decode_attention` for `cache`, after the decode steps' compile if one runs
    (COMPILE_LOCK: dynamo traces one thing at a time): `fn` once done, else `error`."""

    name = "compile-attention"

    def __init__(self, cache: KVCache, q_dtype: torch.dtype = torch.float32,
                 cache_dir: str | Path | None = None) -> None:
        super().__init__(lock=COMPILE_LOCK)
        self.cache, self.q_dtype = cache, q_dtype  # the model's: its queries' dtype (the loops are built for it)
        self.cache_dir = compiled_decode.default_cache_dir() if cache_dir is None else Path(cache_dir)
        self.source: str | None = None  # "compiled" or "cache"
        self._threads = torch.get_num_threads()  # the engine's: inductor sizes the loops' parallelism by it

    def key(self) -> str:
        k = self.cache.k[0]
        code = code_digest(Path(decode_attention.__file__).read_text())
        # ATen's CPU capability beside the flags: inductor's vector ISA follows it (ATEN_CPU_CAPABILITY=avx2 on an
        # AVX-512 host makes other loops; decode_attention._check once caught such a kernel returning 1e23)
        return hashlib.sha256(repr((tuple(k.shape), k.dtype, self.q_dtype, sorted(cpu_flags()),
                                    torch.backends.cpu.get_cpu_capability(), self._threads, torch.__version__,
                                    sys.version_info[:2])).encode() + code).hexdigest()[:24]

    def work(self):
        torch.set_num_threads(self._threads)  # a new thread starts with every core
        probe_vec_isa(self.cache_dir)  # before the scratch folder: its builds kept (a load waited 11-22 s for them)
        # inductor's own cache folder for the compile, deleted after it: the package is the copy kept
        with scratch_inductor_cache(Path(tempfile.gettempdir())):
            return self._load_or_compile()

    def _load_or_compile(self):
        k = self.cache.k[0]
        package = self.cache_dir / ATTENTION / f"{self.key()}.pt2"
        if package.is_file():
            try:
                loops = decode_attention.build(k, self.q_dtype, package)
                os.utime(package)  # in use (engine.compile_cache prunes packages unused for long)
                self.source = "cache"
                return loops
            except Exception as e:  # noqa: BLE001 - a corrupt or foreign package: compile it again
                log.warning("compiled decode attention %s does not load (%s); compiling it again", package,
                            one_line(e))
                with contextlib.suppress(OSError):  # a read-only cache keeps it: compiled for this process below
                    package.unlink(missing_ok=True)
        try:
            package.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=package.parent)
            os.close(fd)
        except OSError:  # a read-only cache: compiled for this process only
            loops = decode_attention.build(k, self.q_dtype)
        else:
            try:
                os.unlink(tmp)  # AOTInductor writes the file itself
                loops = decode_attention.build(k, self.q_dtype, tmp)
                os.replace(tmp, package)  # whole or not at all
            finally:
                Path(tmp).unlink(missing_ok=True)
        self.source = "compiled"
        return loops

    @property
    def fn(self):
        return self.result
