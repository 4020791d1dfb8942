"""The compile cache's housekeeping: engine.compiled_decode writes one folder of packages per key (the weights, the
traced code, torch, the CPU, the threads), and nothing removed the folders no key names any more. An upgrade of
this code or of torch, or another thread count, left the old folder behind: GPT-2 124M's is 0.68 GB.

A server that installs its compiled steps marks their folder in use (`mark_in_use`: a shared `flock` on its USED
file, held while it serves, and the file touched), then `prune` removes, at idle priority (`CachePrune`), every
other key folder that no live process holds and that either holds the same model (its largest weight file, the
embedding, is the same file) in the same setup (`setup_of`: the same format, KV cache, buckets and threads, so an
older key of these weights: code or torch changed) and was not used for an hour, or was not used for
`MAX_IDLE_DAYS`; and the scratch folders of compiles that died (`inductor-*`, `tmp*` holding weights) older than a
day; and the compiled attention packages (engine.compiled_attention) not loaded for `MAX_IDLE_DAYS`. A folder
without a USED file (written before this) counts as used when it was last modified. Nothing else in the folder is
touched (`GPT_COMPILE_CACHE` may name one that holds other things).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import time
from pathlib import Path

from engine.compiled_attention import ATTENTION
from engine.compiled_decode import MANIFEST, WEIGHTS
from engine.idle_job import IdleJob

log = logging.getLogger("engine.compile_cache")

USED = ".used"
SETUP = ".setup"
MAX_IDLE_DAYS = 30
SCRATCH_MAX_AGE_S = 24 * 3600
# an older key of the same weights goes only once unused this long: another server's compile of them (another
# thread count) may have just written its folder and not yet installed (held) it
SAME_MODEL_GRACE_S = 3600
# only folders this code makes are ever removed (GPT_COMPILE_CACHE may name a folder holding other things): a key's
# (CompiledDecode.key: 24 hex digits, with its MANIFEST) and a compile's scratch ones (its inductor cache, and the
# temporary folder its packages are built in, with their WEIGHTS)
KEY_NAME = re.compile(r"[0-9a-f]{24}")


def setup_of(compiled, weights: dict) -> str:
    """What a folder's packages were built for besides the code and torch: the weights' format (`weights`:
    model.linear.convert's report; int8 and int4 share their embedding, the file `stale_folders` knows a model by)
    and the steps' setup (engine.compiled_decode.CompiledDecode.setup: buckets, verification positions, the cache's
    shape and dtype, the threads). Two folders of one model in different setups are two configurations (int8 over
    an fp32 and over a bf16 KV cache, say), not an older key and its successor."""
    return repr((weights.get("format"), weights.get("group"), *compiled.setup()))


def mark_in_use(folder: Path, setup: str | None = None) -> int | None:
    """Hold a shared lock on `folder`'s USED file and touch it; the file descriptor (keep it open while the folder's
    steps serve: a `prune` in another process then leaves the folder alone), or None where it cannot be made.
    `setup` (setup_of): written beside it once, for `stale_folders` to tell configurations from older keys."""
    if setup is not None and not (folder / SETUP).is_file():
        try:
            (folder / SETUP).write_text(setup)
        except OSError:
            pass  # read-only: prune then treats the folder as before, by its weights alone
    try:
        fd = os.open(folder / USED, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(fd)
    except OSError:
        os.close(fd)
        return None
    return fd


def _in_use(folder: Path) -> bool:
    """Whether a live process holds `folder` (its shared lock); False for a folder without a USED file."""
    try:
        fd = os.open(folder / USED, os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock


def _setup(folder: Path) -> str | None:
    try:
        return (folder / SETUP).read_text()
    except OSError:
        return None


def _last_used(folder: Path) -> float:
    try:
        return (folder / USED).stat().st_mtime
    except OSError:
        return folder.stat().st_mtime


def _largest_weight(folder: Path) -> str | None:
    """The name (a digest of its bytes) of the folder's largest shared constant: the embedding, for a GPT."""
    try:
        files = [(f.stat().st_size, f.name) for f in (folder / WEIGHTS).iterdir()]
    except OSError:
        return None
    return max(files)[1] if files else None


def _scratch(folder: Path) -> bool:
    return folder.name.startswith("inductor-") or (folder.name.startswith("tmp") and (folder / WEIGHTS).is_dir())


def _key(folder: Path) -> bool:
    return KEY_NAME.fullmatch(folder.name) is not None and (folder / MANIFEST).is_file()


def stale_folders(cache_dir: Path, current: Path, now: float | None = None) -> list[Path]:
    """The folders of `cache_dir` that `prune` removes, given that `current` serves."""
    now = time.time() if now is None else now
    model, setup = _largest_weight(current), _setup(current)
    out = []
    for folder in sorted(p for p in cache_dir.iterdir() if p.is_dir() and p != current):
        try:
            if _scratch(folder):
                if now - folder.stat().st_mtime > SCRATCH_MAX_AGE_S:
                    out.append(folder)
                continue
            if not _key(folder) or _in_use(folder):
                continue
            idle = now - _last_used(folder)
            # an older key of these weights: same model, and not known to be another setup of it
            other_setup = setup is not None and _setup(folder) not in (None, setup)
            older = model is not None and _largest_weight(folder) == model and not other_setup
            if (older and idle > SAME_MODEL_GRACE_S) or idle > MAX_IDLE_DAYS * 86400:
                out.append(folder)
        except OSError:  # removed meanwhile by another server's prune
            continue
    return out


def stale_packages(cache_dir: Path, now: float | None = None) -> list[Path]:
    """The compiled attention packages (engine.compiled_attention: ATTENTION/<key>.pt2, touched at every load) not
    loaded for MAX_IDLE_DAYS, and the temporary files of compiles that died, older than a day."""
    now = time.time() if now is None else now
    out = []
    for f in sorted((cache_dir / ATTENTION).glob("*.pt2")):
        try:
            age = now - f.stat().st_mtime
        except OSError:
            continue
        if (KEY_NAME.fullmatch(f.stem) and age > MAX_IDLE_DAYS * 86400) or (
                f.stem.startswith("tmp") and age > SCRATCH_MAX_AGE_S):
            out.append(f)
    return out


def prune(cache_dir: Path, current: Path) -> list[Path]:
    """Remove `stale_folders` and `stale_packages`; what was removed."""
    gone = []
    for folder in stale_folders(cache_dir, current):
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            gone.append(folder)
    for package in stale_packages(cache_dir):
        package.unlink(missing_ok=True)
        gone.append(package)
    return gone


class CachePrune(IdleJob):
    """`prune` in a background thread at idle priority: a step boundary never waits for the removal of a folder."""

    name = "compile-cache-prune"

    def __init__(self, cache_dir: Path, current: Path) -> None:
        super().__init__()
        self.cache_dir, self.current = cache_dir, current

    def work(self) -> list[Path]:
        gone = prune(self.cache_dir, self.current)
        if gone:
            log.info("compile cache: removed %d stale folder(s) of %s (%s)", len(gone), self.cache_dir,
                     ", ".join(p.name for p in gone))
        return gone

    def failed(self) -> None:
        log.warning("compile cache: pruning %s failed (%s)", self.cache_dir, self.error)
