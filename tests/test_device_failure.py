"""A sticky device error (issue 41, item 4): after a CUDA error such as a device-side assert every later call fails,
so the engine must stop rather than fail each step forever behind a /live of 200. Injected on the CPU: the step's
requests get their error, the core process exits with DEVICE_FAILED_EXIT, the thread mode's /live turns 503; out
of memory still fails its step only."""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import asdict

import pytest
import torch

from engine.build import CoreConfig
from engine.core import is_fatal_device_error
from engine.core_process import DEVICE_FAILED_EXIT
from model.gpt import GPT
from tests.app_helpers import app_client, wait_until

pytestmark = pytest.mark.timeout(120)

ASSERT = "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."


def device_assert(*args, **kwargs):
    raise torch.AcceleratorError(ASSERT)


@pytest.mark.parametrize("error, fatal", [
    (torch.AcceleratorError(ASSERT), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),  # torch < 2.8's type
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (torch.AcceleratorError("CUDA error: out of memory"), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x3 and 4x5)"), False),
    (ValueError("CUDA error: in a message"), False),
])
def test_which_errors_end_the_engine(error, fatal):
    assert is_fatal_device_error(error) is fatal


def test_the_thread_mode_fails_the_request_and_live_turns_503(tiny_ckpt, monkeypatch):
    with app_client(tiny_ckpt) as c:
        assert c.get("/live").status_code == 200
        monkeypatch.setattr(GPT, "forward_cached", device_assert)
        r = c.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}})
        assert r.status_code >= 500 and "device-side assert" in r.text
        wait_until(lambda: c.get("/live").status_code == 503, timeout=10)


def run_core_with_a_device_assert(cfg: dict, address: str, conn, parent_pid: int) -> None:
    """The core process's main with every forward raising a CUDA error (spawned: the patch is made in the child)."""
    from engine.core_process import run_core_process

    GPT.forward_cached = device_assert
    run_core_process(cfg, address, conn, parent_pid)


def test_the_core_process_sends_the_error_then_exits_with_its_status(tiny_ckpt, tmp_path):
    import zmq

    from engine.params import SamplingParams
    from engine.request import EngineRequest
    from engine.wire import Add, Hello, Outputs, decode_to_front, encode

    cfg = CoreConfig(checkpoint=str(tiny_ckpt), device="cpu", dtype="fp32", torch_threads=1, warmup=False)
    address = f"ipc://{tmp_path / 'core.sock'}"
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_core_with_a_device_assert, args=(asdict(cfg), address, child, os.getpid()))
    proc.start()
    child.close()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    try:
        assert conn.poll(60) and conn.recv()[0] == "loaded"
        sock.connect(address)
        sock.send(encode(Hello()))
        sock.send(encode(Add(EngineRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=4), seed=1))))
        proc.join(60)
        assert proc.exitcode == DEVICE_FAILED_EXIT
        outputs = []
        while sock.poll(1000):
            msg = decode_to_front(sock.recv())
            if isinstance(msg, Outputs):
                outputs += msg.outputs
        failed = [o for o in outputs if o.request_id == "r1" and o.error is not None]
        assert failed and "device-side assert" in failed[0].message
    finally:
        if proc.is_alive():
            proc.kill()
        sock.close(linger=0)
        zctx.term()
