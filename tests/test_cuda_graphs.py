"""CUDA-graph decode (engine/cuda_graphs.py): replays equal eager steps. Needs a CUDA device (CI has none);
the graph's body, `GPT.decode_static`, is checked against the dynamic step on CPU in test_model.py."""

from __future__ import annotations

import pytest
import torch

from engine.generate import decode_step, prefill
from model.kv_cache import KVCache
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_replays_equal_eager_decoding_without_host_syncs():
    from engine.cuda_graphs import GraphedDecode

    dev = torch.device("cuda")
    model = tiny_model(vocab_size=300).to(dev)
    caches = [KVCache(model.config, n_slots=8, device=dev) for _ in range(2)]
    for cache in caches:
        for slot, n in enumerate((3, 5, 4)):
            prefill(model, cache, slot, list(range(1, n + 1)))
    graphed = GraphedDecode(model, caches[0], 8)
    graphed.capture_all()
    tokens = torch.tensor([7, 8, 9], device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = graphed(tokens, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    b = decode_step(model, caches[1], [0, 1, 2], tokens)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
