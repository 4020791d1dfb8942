"""Device choice (model/device.py) and the core's device set-up at load (engine/build.py load_model), on CPU
with mocks: a host whose GPU is reserved but unusable, and cuda:N made the current device."""

from __future__ import annotations

import pytest
import torch

import model.device as device_mod
from engine.build import CoreConfig, StartupError, load_model
from model.device import reserved_gpu, resolve_device


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(device_mod.glob, "glob", lambda pattern: [])


def test_auto_is_the_cpu_where_no_gpu_was_given(no_cuda, monkeypatch):
    assert reserved_gpu() is None
    assert resolve_device("auto") == torch.device("cpu")
    for off in ("void", "none", ""):  # the container runtime's ways of saying no GPU
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", off)
        assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("given", ["env", "node"])
def test_auto_fails_with_one_line_where_a_gpu_is_reserved_but_torch_cannot_use_it(no_cuda, monkeypatch, given):
    # issue 31: an image built for a newer driver (cu130 needs >= 580) quietly served on the CPU
    if given == "env":
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    else:
        monkeypatch.setattr(device_mod.glob, "glob", lambda pattern: ["/dev/nvidiactl", "/dev/nvidia0"])
    with pytest.raises(ValueError) as e:
        resolve_device("auto")
    msg = str(e.value)
    assert "\n" not in msg and "GPU is reserved" in msg and "--device cpu" in msg
    assert ("NVIDIA_VISIBLE_DEVICES=all" if given == "env" else "/dev/nvidia0") in msg
    assert resolve_device("cpu") == torch.device("cpu")  # asked for by name: served there
    with pytest.raises(StartupError, match="GPU is reserved"):  # the server's start-up says it in one line
        load_model(CoreConfig(checkpoint="unused"))


@pytest.mark.parametrize("name, current", [("cuda:1", torch.device("cuda:1")), ("cuda", None), ("cpu", None)])
def test_load_model_makes_cuda_n_the_current_device(monkeypatch, name, current):
    # issue 31: with --device cuda:1 the CUDA graphs' capture stream and pool were made on GPU 0
    import model.checkpoint

    made: list = []
    monkeypatch.setattr(device_mod, "resolve_device", lambda n: torch.device(n))
    monkeypatch.setattr(device_mod, "resolve_dtype", lambda n, d: torch.float32)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(torch.device(d)))
    monkeypatch.setattr(model.checkpoint, "load_checkpoint", lambda path, device, dtype: ("ckpt", device))
    ckpt, device, dtype, _ = load_model(CoreConfig(checkpoint="unused", device=name))
    assert device == torch.device(name) and ckpt == ("ckpt", device)
    assert made == ([current] if current is not None else [])


def test_load_model_keeps_the_int4_kernel_in_the_compile_cache(monkeypatch, tmp_path):
    # `--compile-cache DIR` (not only GPT_COMPILE_CACHE) is where a server builds our int4 kernel once a machine
    import model.checkpoint
    from model import int4_kernel

    monkeypatch.setattr(int4_kernel, "_folder", None)
    monkeypatch.delenv("GPT_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(model.checkpoint, "load_checkpoint", lambda path, device, dtype: "ckpt")
    load_model(CoreConfig(checkpoint="unused", device="cpu", compile_cache=str(tmp_path)))
    assert int4_kernel.cache_dirs()[0] == tmp_path / "kernels"
