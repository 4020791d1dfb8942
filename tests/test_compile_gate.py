"""Whether a compiled decode step pays (engine/compile_gate.py): the one-row timing reads both steps and leaves the
live cache as it was; a compile is refused where it would not fit in memory. The engine's use of both (auto drops a
slower step, a compile that would not fit is not started): tests/test_compiled_decode.py."""

from __future__ import annotations

import time

import pytest
import torch

import engine.compile_gate as gate
from engine.compile_gate import CompileMemoryError, StepTiming, check_compile_memory, compile_memory, time_one_row
from engine.sizing import gib
from model.kv_cache import KVCache
from tests.helpers import tiny_model


class FakeCompiled:
    """What time_one_row reads of engine.compiled_decode.CompiledDecode: buckets, contexts, steps, inputs(1); the
    step is the eager model over Step's inputs, `delay` seconds slower."""

    def __init__(self, model, cache, delay: float) -> None:
        self.buckets, self.contexts = [1], [cache.max_len]
        self.calls = 0

        def step(tokens, lengths_t, *rest):  # Step's inputs: the draw's six, then one slot's keys and values
            self.calls += 1
            time.sleep(delay)
            assert len(rest) == 6 + 2 * model.config.n_layer and rest[6].shape == (1, *cache.k[0].shape[1:])
            assert lengths_t.tolist() == [63]
            return torch.zeros(1, model.config.vocab_size)

        self.steps = {(1, cache.max_len, None): step}
        self._draw = [torch.zeros(1) for _ in range(6)]

    def inputs(self, b: int) -> tuple:
        return (None, None, *self._draw)


@pytest.mark.parametrize("delay", [0.0, 0.01])
def test_the_one_row_timing_reads_both_steps_and_leaves_the_live_cache_as_it_was(delay):
    model = tiny_model(0, vocab_size=96, block_size=64).eval()
    cache = KVCache(model.config, 2, 64)
    with torch.inference_mode():
        model.forward_cached(torch.arange(10)[None], cache, [0])
    before = [t.clone() for t in cache.k + cache.v], list(cache.lengths), cache.lengths_t.clone()
    compiled = FakeCompiled(model, cache, delay)
    timing = time_one_row(model, compiled, cache, rounds=2, steps=3)
    assert compiled.calls == 1 + 2 * 3 and timing.length == 63 and timing.eager_ms > 0
    assert (timing.compiled_ms >= 10) == (delay > 0) and timing.pays == (timing.compiled_ms <= 0.95 * timing.eager_ms)
    assert all(torch.equal(a, b) for a, b in zip(before[0], cache.k + cache.v))
    assert cache.lengths == before[1] and torch.equal(cache.lengths_t, before[2])


def test_a_step_is_kept_only_when_clearly_faster():
    assert StepTiming(0.9, 1.0, 200).pays and StepTiming(0.95, 1.0, 200).pays
    assert not StepTiming(0.96, 1.0, 200).pays and not StepTiming(1.2, 1.0, 200).pays
    assert StepTiming(0.5, 1.0, 200).as_dict() == {"compiled_ms": 0.5, "eager_ms": 1.0, "length": 200, "kept": True}


def test_a_compile_that_would_not_fit_is_refused_naming_both_sizes(monkeypatch):
    cpu = torch.device("cpu")
    gpt2 = 4 * 124_000_000
    need = compile_memory(gpt2)
    assert compile_memory(0) < need < compile_memory(2 * gpt2)
    monkeypatch.setattr(gate, "available_memory", lambda device: need + 2**30)
    check_compile_memory(gpt2, cpu)  # fits
    with pytest.raises(CompileMemoryError) as e:
        check_compile_memory(gpt2, cpu, pending=2 * 2**30)  # a KV cache still to be made resident takes 2 GiB
    assert str(e.value) == f"its compile needs about {gib(need)}, {gib(need - 2**30)} available"
    monkeypatch.setattr(gate, "available_memory", lambda device: 0)
    with pytest.raises(MemoryError, match=r"0\.00 GiB available"):
        check_compile_memory(0, cpu, pending=10)
