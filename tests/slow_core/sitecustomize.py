"""Test-only: a directory for PYTHONPATH. With GPT_TEST_STEP_DELAY_S set, every forward pass of model.gpt.GPT
sleeps that long first, in each process that imports it (the engine core process included, which the tests cannot
reach into), so a request cannot run to its end before an abort from the front reaches the core
(tests/test_core_process.py)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

DELAY_S = float(os.environ.get("GPT_TEST_STEP_DELAY_S") or 0)


def _slow_down(gpt_class) -> None:
    forward_cached = gpt_class.forward_cached

    @functools.wraps(forward_cached)
    def slow(self, *args, **kwargs):
        time.sleep(DELAY_S)
        return forward_cached(self, *args, **kwargs)

    gpt_class.forward_cached = slow


class _SlowGPTFinder(importlib.abc.MetaPathFinder):
    """Finds model.gpt as Python would and slows GPT down once the module has run (torch is not imported here)."""

    def find_spec(self, name, path, target=None):
        if name != "model.gpt":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_slow(module) -> None:
            exec_module(module)
            _slow_down(module.GPT)

        spec.loader.exec_module = exec_and_slow
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, _SlowGPTFinder())
