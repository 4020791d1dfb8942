"""engine/cpu_tuning.py: the one-row kernel choices kept on disk (KernelChoices) and their use at start-up.
(Thread choice and malloc tuning: tests/test_core_process.py; the auto dtype: tests/test_sizing.py.)"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import model.linear as L
from engine.cpu_tuning import KernelChoices
from engine.runner import ModelRunner
from tests.test_linear import needs_onednn, small_gpt


def test_choices_round_trip_per_cpu_torch_and_threads(tmp_path):
    cache = KernelChoices(tmp_path)
    assert cache.load() == {}
    cache.save({(96, 64): "mkl", (64, 64): "onednn"})
    cache.save({(256, 64): "onednn"})  # merged with what is there
    assert KernelChoices(tmp_path).load() == {(96, 64): "mkl", (64, 64): "onednn", (256, 64): "onednn"}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # timed at another thread count: not this key's
        assert KernelChoices(tmp_path).load() == {}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"KEY": {"64x64": "bogus", "axb": "mkl"}}'])
def test_a_file_that_does_not_parse_is_measured_again_and_rewritten(tmp_path, caplog, text):
    path = tmp_path / "kernels.json"
    path.write_text(text.replace("KEY", KernelChoices.machine_key()))
    cache = KernelChoices(tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert cache.load() == {}  # unknown shapes and choices are dropped too
    assert ("do not load" in caplog.text) == text.startswith(("{not", "["))
    cache.save({(64, 64): "onednn"})
    assert json.loads(path.read_text())[KernelChoices.machine_key()]["64x64"] == "onednn"


@needs_onednn
def test_tune_times_only_the_shapes_it_does_not_know(monkeypatch):
    model = small_gpt()
    L.convert(model, "none", keep_plain=True)
    timed = []
    monkeypatch.delenv("GPT_SMALL_LINEAR", raising=False)
    monkeypatch.setattr(L, "_mkl_over_onednn", lambda m, repeats, cold=False: timed.append(m.out_features) or 1.0)
    known = {(192, 64): "onednn", (64, 64): "onednn", (256, 64): "onednn", (64, 256): "onednn", (96, 64): "mkl"}
    assert L.tune(model, known={k: v for k, v in known.items() if k != (64, 64)}) == known | {(64, 64): "onednn"}
    assert timed == [64]
    assert [m.out_features for m in model.modules() if isinstance(m, L.PackedLinear) and m.column_major is not None] \
        == [96]  # a known "mkl" gets its copy as a measured one does


@needs_onednn
def test_a_second_engine_on_the_machine_times_no_kernel(tmp_path, monkeypatch):
    monkeypatch.delenv("GPT_SMALL_LINEAR", raising=False)
    timed = []
    real = L._mkl_over_onednn
    monkeypatch.setattr(L, "_mkl_over_onednn",
                        lambda m, repeats, cold=False: timed.append(m.out_features) or real(m, repeats))
    first = ModelRunner(small_gpt(), n_slots=2, vocab_size=96, prepack=True, compile_cache=str(tmp_path))
    assert len(timed) == len(first.kernels) > 0
    timed.clear()
    second = ModelRunner(small_gpt(), n_slots=2, vocab_size=96, prepack=True, compile_cache=str(tmp_path))
    assert timed == [] and second.kernels == first.kernels
    monkeypatch.setenv("GPT_SMALL_LINEAR", "mkl")  # the user's choice is not written as a measurement
    ModelRunner(small_gpt(), n_slots=2, vocab_size=96, prepack=True, compile_cache=str(tmp_path))
    assert KernelChoices(tmp_path).load() == first.kernels




def test_the_kernel_timings_come_after_the_engines_before_timing_hook(tmp_path, monkeypatch):
    """The core process waits there for its front's imports to end (engine.core_process.wait_quiet): every kernel
    timing comes after the hook, and the weights are already converted when it is called."""
    monkeypatch.delenv("GPT_SMALL_LINEAR", raising=False)
    events = []
    real = L._mkl_over_onednn
    monkeypatch.setattr(L, "_mkl_over_onednn",
                        lambda m, repeats, cold=False: events.append("timed") or real(m, repeats))
    model = small_gpt()

    def hook():
        events.append("hook")
        assert any(isinstance(m, L.PackedLinear) for m in model.modules())  # converted before the wait

    ModelRunner(model, n_slots=2, vocab_size=96, prepack=True, compile_cache=str(tmp_path), before_timing=hook)
    assert events[0] == "hook" and events.count("hook") == 1 and "timed" in events


def test_a_folder_that_cannot_be_written_keeps_the_choices_for_this_process(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    cache = KernelChoices(tmp_path / "a-file" / "cache")  # its folder cannot be made (even by root)
    with caplog.at_level(logging.WARNING, logger="engine"):
        cache.save({(64, 64): "onednn"})  # no exception: the engine starts, and times them again next time
    assert "not saved" in caplog.text and cache.load() == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no temporary file left behind
