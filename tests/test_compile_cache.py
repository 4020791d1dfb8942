"""The compile cache's housekeeping (engine/compile_cache.py): a served folder is held in use, and the folders of
older keys of the same weights, long-unused folders and dead compiles' scratch folders are removed; nothing it did
not make."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from engine.compile_cache import (
    MAX_IDLE_DAYS,
    SETUP,
    USED,
    _in_use,
    mark_in_use,
    prune,
    setup_of,
    stale_folders,
    stale_packages,
)
from engine.compiled_attention import ATTENTION
from engine.compiled_decode import MANIFEST, WEIGHTS


def ago(path: Path, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(path, (when, when))


def key_folder(cache: Path, label: str, weights: dict[str, int], age_days: float = 0.0) -> Path:
    """A key folder as CompiledDecode writes one (24 hex digits, a manifest, shared constants `weights`: digest name
    → size in bytes), last used `age_days` ago."""
    folder = cache / hashlib.sha256(label.encode()).hexdigest()[:24]
    (folder / WEIGHTS).mkdir(parents=True)
    for digest, size in weights.items():
        (folder / WEIGHTS / digest).write_bytes(b"\0" * size)
    (folder / "b1-c64-logits.so").write_bytes(b"package")
    (folder / MANIFEST).write_text("{}")
    (folder / USED).touch()
    ago(folder / USED, age_days * 86400)
    return folder


def test_older_keys_of_the_same_weights_and_long_unused_folders_go_the_rest_stay(tmp_path):
    cache = tmp_path / "compiled"
    current = key_folder(cache, "current", {"emb": 4096, "ln-ones": 64})
    older_same = key_folder(cache, "older-same", {"emb": 4096, "ln-ones": 64}, age_days=0.5)  # an upgrade's leftover
    other = key_folder(cache, "other-model", {"emb2": 8192, "ln-ones": 64}, age_days=3)  # shares only a small one
    ancient = key_folder(cache, "ancient", {"emb3": 4096}, age_days=MAX_IDLE_DAYS + 1)
    held = key_folder(cache, "held-same", {"emb": 4096}, age_days=2)  # another live server's, same weights
    fresh = key_folder(cache, "fresh-same", {"emb": 4096}, age_days=0.01)  # another server's compile, just written
    fd = mark_in_use(held)
    old_scratch, new_scratch, old_build = cache / "inductor-abc", cache / "tmpxyz", cache / "tmpold"
    for d in (old_scratch, new_scratch, old_build / WEIGHTS):
        d.mkdir(parents=True)
    ago(old_scratch, 2 * 86400)
    ago(old_build, 2 * 86400)
    (cache / "kernels.json").write_text("{}")  # files are not folders of keys
    # not made by this code, however old: a folder of the user's, a temporary folder without weights, a folder named
    # like a key without a manifest
    foreign = [cache / "photos", cache / "tmp-other", cache / ("0" * 24)]
    for d in foreign:
        d.mkdir()
        ago(d, (MAX_IDLE_DAYS + 5) * 86400)
    try:
        assert _in_use(held) and not _in_use(older_same)
        stale = {ancient, old_scratch, old_build, older_same}
        assert set(stale_folders(cache, current)) == stale
        assert set(prune(cache, current)) == stale
        assert not any(p.exists() for p in stale)
        assert all(p.is_dir() for p in [current, other, held, fresh, new_scratch, *foreign])
        assert (cache / "kernels.json").is_file()
    finally:
        os.close(fd)
    assert not _in_use(held)  # the lock went with its holder: a prune takes it once an hour unused
    assert stale_folders(cache, current) == []  # (held was just touched, fresh just written)
    ago(held / USED, 2 * 3600)
    assert stale_folders(cache, current) == [held]


def test_another_setup_of_the_same_weights_is_kept_an_older_key_of_the_same_setup_goes(tmp_path):
    """int8 weights over an fp32 and over a bf16 KV cache (or int8 and int4, which share their int8 embedding) are
    folders of one embedding: a server of one removed the other's packages an hour after its last use (a ~15-minute
    compile for GPT-2 at the next start of the other). Folders written before setups were recorded go by their
    weights alone, as before."""
    cache = tmp_path / "compiled"
    current = key_folder(cache, "int8-over-bf16", {"emb": 4096})
    other_setup = key_folder(cache, "int8-over-fp32", {"emb": 4096}, age_days=2)
    older = key_folder(cache, "int8-over-bf16-old-code", {"emb": 4096}, age_days=2)
    unrecorded = key_folder(cache, "before-setups", {"emb": 4096}, age_days=2)
    for folder, setup in ((current, "bf16"), (other_setup, "fp32"), (older, "bf16")):
        os.close(mark_in_use(folder, setup))
        ago(folder / USED, 0 if folder is current else 2 * 86400)
    assert (other_setup / SETUP).read_text() == "fp32"
    assert set(stale_folders(cache, current)) == {older, unrecorded}
    ago(other_setup / USED, (MAX_IDLE_DAYS + 1) * 86400)  # unused for a month: goes like any folder
    assert other_setup in stale_folders(cache, current)
    (current / SETUP).unlink()  # the serving folder's setup unknown: by its weights, as before
    assert set(stale_folders(cache, current)) == {older, unrecorded, other_setup}
    # a setup is written once: marking again does not rewrite it
    os.close(mark_in_use(older, "fp32"))
    assert (older / SETUP).read_text() == "bf16"


def test_a_setup_names_the_format_the_cache_the_buckets_the_verification_pass_and_the_threads():
    import torch

    from engine.compiled_decode import CompiledDecode
    from model.kv_cache import KVCache
    from tests.helpers import tiny_model

    model = tiny_model(0, vocab_size=96, block_size=64)

    def compiled(dtype=torch.float32, threads=2, contexts=(32, 64), verify_most=0):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # the engine's threads, as a CompiledDecode reads them when made
        try:
            return CompiledDecode(model, KVCache(model.config, 4, dtype=dtype), 1, contexts=contexts,
                                  verify_most=verify_most)
        finally:
            torch.set_num_threads(before)

    int8, int4 = {"format": "int8", "swapped": 48, "group": None}, {"format": "int4", "swapped": 48, "group": 32}
    base = setup_of(compiled(), int8)
    assert base == setup_of(compiled(), dict(int8))
    assert len({base, setup_of(compiled(), int4), setup_of(compiled(), {**int4, "group": 128}),
                setup_of(compiled(torch.bfloat16), int8), setup_of(compiled(threads=1), int8),
                setup_of(compiled(contexts=(64,)), int8), setup_of(compiled(verify_most=9), int8)}) == 7


def test_a_folder_from_before_the_used_file_counts_as_used_when_last_modified(tmp_path):
    cache = tmp_path / "compiled"
    current = key_folder(cache, "current", {"emb": 16})
    legacy = key_folder(cache, "legacy", {"other": 16})
    (legacy / USED).unlink()
    assert stale_folders(cache, current) == []
    ago(legacy, (MAX_IDLE_DAYS + 1) * 86400)
    assert stale_folders(cache, current) == [legacy]


def test_marking_a_folder_touches_its_used_file(tmp_path):
    folder = key_folder(tmp_path, "k", {"emb": 16}, age_days=10)
    fd = mark_in_use(folder)
    try:
        assert fd is not None and time.time() - (folder / USED).stat().st_mtime < 60
    finally:
        os.close(fd)
    assert mark_in_use(tmp_path / "missing") is None  # a folder that is not there: nothing held, no error


def test_attention_packages_unused_for_long_and_dead_compiles_files_go_the_rest_stay(tmp_path):
    """engine.compiled_attention keeps ATTENTION/<key>.pt2 and touches it at every load: one not loaded for
    MAX_IDLE_DAYS goes (an older torch's or code's), as does a dead compile's temporary file after a day."""
    cache = tmp_path / "compiled"
    current = key_folder(cache, "current", {"emb": 16})
    (cache / ATTENTION).mkdir()
    fresh, old, other = (cache / ATTENTION / f"{hashlib.sha256(n).hexdigest()[:24]}.pt2" for n in (b"a", b"b", b"c"))
    dead, young, foreign = (cache / ATTENTION / n for n in ("tmpab12cd.pt2", "tmpef34gh.pt2", "mine.pt2"))
    for f in (fresh, old, other, dead, young, foreign):
        f.write_bytes(b"package")
    for f, days in ((old, MAX_IDLE_DAYS + 1), (other, MAX_IDLE_DAYS - 1), (dead, 2), (young, 0.5),
                    (foreign, MAX_IDLE_DAYS + 1)):
        ago(f, days * 86400)
    assert stale_packages(cache) == sorted([old, dead])
    assert sorted(prune(cache, current)) == sorted([old, dead])
    assert sorted(p.name for p in (cache / ATTENTION).iterdir()) == sorted(
        f.name for f in (fresh, other, young, foreign))
