"""The engine core in its own process: it owns the device and the weights; the HTTP fronts talk to it over ZMQ.

    core = CoreProcess(CoreConfig.from_settings(settings))
    core.start(); info = core.wait_loaded()     # a bad checkpoint: StartupError with one line
    ... fronts connect ProcessEngineClient(core.address, ...) ...
    core.stop()

Why a process: with the model loop and the HTTP front in one interpreter, the decode step waited for the GIL
after every torch op while the event loop encoded JSON and walked Starlette's send chain (12–18 ms steps in the
server vs 7 ms alone, issue 16). Here the core's process does nothing but schedule, compute and send one
MessagePack frame per step and front (`engine/wire.py`); detokenizing, stop strings and SSE stay in the fronts.

The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group: the front drains and then tells
the core to stop), ends its requests and exits 0 on SIGTERM or a `Shutdown` message, and gets SIGTERM when its
parent dies (Linux `PR_SET_PDEATHSIG`), so it never outlives the server. Its socket lives in a private temporary
directory that the parent removes.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from engine.spec_decode.config import (  # torch-free: the fronts import this module
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_K,
    DEFAULT_MAX_BATCH,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
)

log = logging.getLogger("engine")


DEVICE_FAILED_EXIT = 3  # the core process's status after a sticky device error (1: it could not start)


class StartupError(RuntimeError):
    """The server cannot start; the message is one line."""


@dataclass
class CoreConfig:
    """What the engine core needs from the server's settings (plain values: it crosses a process boundary)."""

    checkpoint: str
    device: str = "auto"
    dtype: str = "auto"
    torch_threads: int | None = None
    max_batch_size: int | None = None
    kv_cache_memory_fraction: float = 0.5
    prefill_chunk: int = 128
    idle_prefill_chunk: int = 2048
    prefix_cache: bool = True
    prefix_cache_min_tokens: int = 16
    prepack_weights: bool = True
    quantize: str = "none"
    int4_group_size: int = 32
    kv_cache_memory: str | None = None
    kv_cache_dtype: str = "auto"
    warmup: bool = True
    cuda_graphs: bool | None = None
    compile: str = "auto"
    compile_max_batch: int = 1
    log_level: str = "info"
    speculative: str = "off"
    num_speculative_tokens: int = DEFAULT_K
    speculative_ngram_min: int = DEFAULT_NGRAM_MIN
    speculative_ngram_max: int = DEFAULT_NGRAM_MAX
    speculative_max_batch: int = DEFAULT_MAX_BATCH
    speculative_draft_p_min: float = DEFAULT_DRAFT_P_MIN

    @classmethod
    def from_settings(cls, s) -> CoreConfig:
        """The fields of a settings object (the server's `Settings`) that share a name with ours."""
        values = {f.name: getattr(s, f.name) for f in fields(cls) if hasattr(s, f.name)}
        values["checkpoint"] = str(values["checkpoint"])
        return cls(**values)


# ---------------------------------------------------------------------------------------------- building
def load_model(cfg: CoreConfig):
    """Resolve device and dtype and load the checkpoint: (checkpoint, device, dtype, seconds); StartupError
    with a one-line reason on failure."""
    import torch

    from model.checkpoint import CheckpointError, load_checkpoint
    from model.device import resolve_device, resolve_dtype

    t0 = time.perf_counter()
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    try:
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
    except ValueError as e:
        raise StartupError(str(e)) from None
    dtype = serving_dtype(cfg, device, dtype)[0]
    if device.type == "cuda" and device.index is not None:
        # cuda:N is this process's current device: what is made without an explicit device (CUDA graphs' capture
        # stream and memory pool, cuBLAS workspaces, torch.cuda.synchronize()) lands there, not on GPU 0
        torch.cuda.set_device(device)
    check_fits(cfg, device, dtype)
    try:
        ckpt = load_checkpoint(cfg.checkpoint, device=device, dtype=dtype)
    except CheckpointError as e:
        raise StartupError(f"cannot load checkpoint: {e}") from None
    except (OSError, RuntimeError, ValueError) as e:  # e.g. out of GPU memory
        raise StartupError(f"cannot load checkpoint {cfg.checkpoint}: {type(e).__name__}: {e}") from None
    return ckpt, device, dtype, time.perf_counter() - t0


_DTYPE_CHOICES: dict[tuple, tuple] = {}
BF16_SPEEDUP = 1.15  # bf16 must beat fp32 by this much at 1 and at 16 rows to be the CPU's auto dtype


def serving_dtype(cfg: CoreConfig, device, dtype) -> tuple[Any, dict | None]:
    """The dtype a server computes in, and why. `--dtype auto` on a CPU serving unquantized weights is bf16 where
    the CPU computes bf16 natively (avx512_bf16 or AMX in its flags) and a one-off timing at load finds the model's
    widest matmul (n_embd → 4·n_embd, oneDNN's packed weight) at least 1.15x faster in bf16 at 1 and at 16 rows;
    else fp32 (the reference). Measured on a 2-vCPU AMD EPYC with avx512_bf16 (2026-11-25, `python -m bench.formats`):
    bf16 decodes GPT-2 124M 1.56x / 1.31x / 1.29x faster at 1 / 16 / 64 rows and prefills 512 tokens 1.5x faster,
    at the same bits per byte (2.23598 vs 2.23601); on an AVX2-only CPU oneDNN emulates bf16 and it is slower.
    The choice is made once per process and shape (load_model, then build_core reports it)."""
    import torch

    if cfg.dtype != "auto" or device.type != "cpu" or cfg.quantize != "none":
        return dtype, None
    from model import cpu_support
    from model.checkpoint import read_config
    from model.linear import ONEDNN_LINEAR, time_dtypes

    try:
        n_embd = read_config(cfg.checkpoint).n_embd
    except Exception:  # noqa: BLE001 - loading reports what is wrong with the checkpoint, in its words
        return dtype, None
    key = (n_embd, torch.get_num_threads())
    if key not in _DTYPE_CHOICES:
        cpu = cpu_support.support()
        native = sorted(set(cpu_support.BF16_FLAGS) & cpu.flags)
        if not cpu.native_bf16 or ONEDNN_LINEAR is None:
            why = "no native bf16 (avx512_bf16 / amx_bf16)" if not native else \
                f"oneDNN does not pack bf16 here (needs {cpu_support.PACKED_BF16_NEEDS})"
            _DTYPE_CHOICES[key] = (torch.float32, {"picked": "fp32", "why": why})
        else:
            ms = time_dtypes(n_embd, 4 * n_embd)
            fast = all(ms["bf16"][r] * BF16_SPEEDUP <= ms["fp32"][r] for r in ms["fp32"])
            _DTYPE_CHOICES[key] = (torch.bfloat16 if fast else torch.float32, {
                "picked": "bf16" if fast else "fp32", "cpu_flags": native,
                "ms": {name: {str(r): round(t, 4) for r, t in v.items()} for name, v in ms.items()}})
    return _DTYPE_CHOICES[key]


def check_fits(cfg: CoreConfig, device, dtype, available: int | None = None) -> None:
    """Before loading: the weights as loaded plus one full-length KV slot must fit the free memory, else a one-line
    StartupError (the kernel's OOM killer ends a process that tries, with no word to the user). A draft model
    (GPT_SPECULATIVE=draft:CHECKPOINT) counts too: its weights, and its KV slot beside the served model's
    (engine.sizing.slot_kv_bytes)."""
    from engine.sizing import available_memory, gib, slot_kv_bytes

    target = _as_loaded(cfg.checkpoint, dtype)
    if target is None:
        return
    config, weights = target
    path = draft_path(cfg)
    draft_config, draft_weights = (_as_loaded(path, dtype) if path else None) or (None, 0)
    kv, draft_kv = slot_kv_bytes(config.n_layer, config.n_embd, config.block_size, resolve_kv_dtype(cfg, dtype),
                                 draft_config)
    need = weights + draft_weights + kv + draft_kv
    free = available_memory(device) if available is None else available
    if need > free:
        draft = (f" (the draft model's {gib(draft_weights)} of weights and {gib(draft_kv)} of KV slot included)"
                 if draft_config is not None else "")
        raise StartupError(f"{cfg.checkpoint}: the weights ({gib(weights + draft_weights)} as loaded) plus one "
                           f"full-length KV slot ({gib(kv + draft_kv)}) need {gib(need)}{draft} but {gib(free)} is "
                           f"available on {device}")


def _as_loaded(checkpoint: str, dtype):
    """(config, bytes of the weights as loading holds them) of a checkpoint, or None when its files cannot be read
    (load_checkpoint then reports what is wrong with them, in its words)."""
    import torch

    from model.checkpoint import WEIGHTS, read_config
    from model.quantized_format import QUANTIZATION

    try:
        config = read_config(checkpoint)
        stored = (Path(checkpoint) / WEIGHTS).stat().st_size
    except Exception:  # noqa: BLE001 - load_checkpoint reports what is wrong with the files, in its words
        return None
    # loading reads the stored tensors and converts them to the serving dtype (int8/int4 are made from those)
    if (Path(checkpoint) / QUANTIZATION).is_file():  # loads as stored, no fp32 copy on the way
        return config, stored
    from model.gpt import GPT

    elsize = torch.empty((), dtype=dtype).element_size()
    with torch.device("meta"):  # the parameter count, without allocating it
        return config, max(stored, GPT(config).num_params(non_embedding=False) * elsize)


def draft_path(cfg: CoreConfig) -> str | None:
    """The draft checkpoint of GPT_SPECULATIVE=draft:CHECKPOINT, or None (another method, or settings that
    `speculation` refuses with its own one-line error)."""
    from engine.spec_decode import SpecError, parse_speculative

    try:
        spec = parse_speculative(cfg.speculative)
    except SpecError:
        return None
    return spec.draft if spec.method == "draft" else None


def resolve_kv_dtype(cfg: CoreConfig, dtype):
    """The KV cache's dtype: auto is the model's."""
    from model.device import DTYPES

    return dtype if cfg.kv_cache_dtype == "auto" else DTYPES[cfg.kv_cache_dtype]


def build_core(cfg: CoreConfig, loaded=None):
    """The engine core for a loaded checkpoint (loading it when not given): (core, info, classify). The one place
    the server's settings become an EngineCore, for the core process and the in-process mode alike."""
    import torch

    from engine.core import EngineCore
    from engine.sizing import SizingError, plan_slots
    from model.device import DTYPE_NAMES
    from model.linear import FormatError
    from model.task_head import TaskError, load_task

    ckpt, device, dtype, seconds = loaded if loaded is not None else load_model(cfg)
    try:
        task = load_task(ckpt.path, ckpt.model, device)
    except TaskError as e:
        raise StartupError(f"cannot load the task head: {e}") from None
    block = ckpt.config.block_size
    kv_dtype = resolve_kv_dtype(cfg, dtype)
    spec, draft = speculation(cfg, ckpt, device, dtype)  # the draft's weights loaded before free memory is measured
    try:  # measured now, with the weights loaded (before the int8/int4 swap frees the fp32 copy: conservative); a
        # slot costs the draft's KV slot too
        plan = plan_slots(ckpt.config.n_layer, ckpt.config.n_embd, block, device, kv_dtype,
                          max_batch_size=cfg.max_batch_size, kv_cache_memory=cfg.kv_cache_memory,
                          memory_fraction=cfg.kv_cache_memory_fraction,
                          draft=draft.config if draft is not None else None)
    except SizingError as e:
        raise StartupError(str(e)) from None
    slots = plan.slots
    n_params = ckpt.model.num_params()
    try:
        core = EngineCore(ckpt.model, n_slots=slots, vocab_size=ckpt.tokenizer.vocab_size,
                          eos_id=ckpt.tokenizer.eot_id, prefill_chunk=cfg.prefill_chunk,
                          idle_prefill_chunk=cfg.idle_prefill_chunk, cuda_graphs=cfg.cuda_graphs,
                          prefix_cache=cfg.prefix_cache, min_prefix=cfg.prefix_cache_min_tokens,
                          prepack=cfg.prepack_weights, quantize=cfg.quantize, int4_group=cfg.int4_group_size,
                          kv_dtype=kv_dtype, speculative=spec, draft_model=draft, compile=cfg.compile,
                          compile_max_batch=cfg.compile_max_batch,
                          tokenizer=ckpt.tokenizer)  # structured output compiles grammars against it
    except FormatError as e:
        raise StartupError(f"cannot serve {cfg.checkpoint} as {cfg.quantize} (--quantize) in "
                           f"{DTYPE_NAMES.get(dtype, dtype)} (--dtype): {e}") from None
    except SizingError as e:  # the KV cache did not fit after all
        raise StartupError(str(e)) from None
    except (RuntimeError, ValueError) as e:  # any other step of building the core (warm-up, speculation, ...)
        raise StartupError(f"cannot start the engine core for {cfg.checkpoint}: {type(e).__name__}: {e}") from None
    info: dict[str, Any] = {"device": str(device), "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "n_params": n_params,
                            "max_batch_size": slots, "load_seconds": round(seconds, 2), "pid": os.getpid(),
                            "weights": core.weights["format"], "weight_bytes": core.weight_bytes,
                            "kv_cache": {"bytes": core.cache.nbytes(), "slots": slots, "per_slot": plan.per_slot,
                                         "dtype": DTYPE_NAMES.get(kv_dtype, str(kv_dtype)),
                                         "budget": plan.budget, "available": plan.available,
                                         # the draft model's KV slots (speculative decoding), within the budget
                                         "draft_per_slot": plan.draft_per_slot,
                                         "draft_bytes": core.speculator.draft.cache.nbytes()
                                         if draft is not None else 0},
                            "kernels": {f"{o}x{i}": k for (o, i), k in core.kernels.items()},
                            "dtype_choice": serving_dtype(cfg, device, dtype)[1],
                            "torch_threads": torch.get_num_threads() if device.type == "cpu" else None,
                            "task": {"kind": task.kind, "labels": task.labels} if task is not None else None,
                            "speculative": None if spec is None else {
                                "method": spec.method, "draft": spec.draft, "num_speculative_tokens": spec.k,
                                "ngram_min": spec.ngram_min, "ngram_max": spec.ngram_max,
                                "max_batch": spec.max_batch, "draft_p_min": spec.draft_p_min}}
    if device.type == "cpu":
        info["cpu"], info["cpu_note"] = cpu_report(dtype, cfg.quantize)
    classify = None
    if task is not None:
        def classify(items: list) -> list[dict[str, float]]:
            return task.predict(ckpt.model, ckpt.tokenizer, items)
    return core, info, classify


def cpu_report(dtype, quantize: str) -> tuple[dict, str | None]:
    """What this CPU's kernels can do (for /info), and a line for the start-up log where the chosen dtype runs
    without a native kernel here (it serves, slower than fp32: docs/api.md, "Formats per CPU")."""
    import torch

    from model import cpu_support
    from model.device import DTYPE_NAMES

    cpu = cpu_support.support()
    native = {torch.bfloat16: cpu.native_bf16, torch.float16: "avx512_fp16" in cpu.flags}
    note = None
    if quantize == "none" and not native.get(dtype, True):
        name = DTYPE_NAMES.get(dtype, str(dtype))
        note = (f"{name} weights run through plain F.linear: this CPU (ATen {cpu.capability}) has no native {name} "
                f"matmul (bf16 needs avx512_bf16 or amx_bf16 and {cpu_support.PACKED_BF16_NEEDS}; fp16 avx512_fp16), "
                f"so it is slower than --dtype fp32 or --quantize int8 here")
    return cpu.describe(), note


def speculation(cfg: CoreConfig, ckpt, device, dtype):
    """The speculative decoding settings as the core takes them: (SpecConfig or None when off, the draft model or
    None); StartupError with a one-line reason for bad ones (an unknown method, a draft with another tokenizer)."""
    from engine.spec_decode import parse_speculative
    from engine.spec_decode.draft import load_draft

    try:
        spec = parse_speculative(cfg.speculative, cfg.num_speculative_tokens, cfg.speculative_ngram_min,
                                 cfg.speculative_ngram_max, cfg.speculative_max_batch, cfg.speculative_draft_p_min)
        if not spec.enabled:
            return None, None
        draft = load_draft(spec.draft, ckpt.tokenizer, device, dtype) if spec.method == "draft" else None
    except ValueError as e:  # SpecError, DraftError
        raise StartupError(f"speculative decoding (--speculative): {e}") from None
    return spec, draft


# ---------------------------------------------------------------------------------------------- the child
class ZmqTransport:
    """The core's side of the fronts' sockets: one ROUTER, each front a DEALER identity."""

    def __init__(self, sock, parent_pid: int) -> None:
        self.sock, self.parent_pid = sock, parent_pid

    def recv(self, timeout: float) -> list:
        import zmq

        from engine.wire import decode_to_core

        if timeout > 0 and not self.sock.poll(int(timeout * 1000)):
            if os.getppid() != self.parent_pid:  # the server is gone (PDEATHSIG is Linux-only)
                from engine.wire import Shutdown

                return [(b"", Shutdown())]
            return []
        msgs = []
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append((ident, decode_to_core(frame)))
            except Exception as e:  # noqa: BLE001 - a malformed frame is dropped, never fatal
                log.error("dropped a malformed message from a front: %s", e)

    def send(self, client: bytes, msg) -> None:
        from engine.wire import encode

        if client:
            self.sock.send_multipart([client, encode(msg)], copy=False)


def _die_with_parent() -> None:
    try:  # Linux: SIGTERM when the parent exits, so the core never outlives the server
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def core_threads(cfg: CoreConfig) -> int:
    """Torch threads the core process loads with: GPT_TORCH_THREADS, else every CPU this process may run on (as
    llama-server's default); without the setting `choose_threads` then measures whether the last one is worth
    taking from the fronts. (On a 2-vCPU Xeon with short OpenMP spins, `python -m bench.stack --threads 1|2`: the
    stack-ceiling model 699 / 699 tok/s at 1 stream, 3,715 / 3,688 at 16; GPT-2 124M at 1 stream 23.6 / 43 tok/s;
    on an AMD EPYC the small model serves faster with one: `choose_threads`.)"""
    if cfg.torch_threads:
        return cfg.torch_threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# A model whose one-row decode step takes under FAST_STEP_S at every thread leaves the last core to the HTTP fronts
# unless that core makes the step THREAD_GAIN faster: the fronts (detokenizing, SSE, JSON) need CPU in proportion to
# the tokens a second, which a fast step makes many. Measured on a 2-vCPU AMD EPYC (2026-11-25), through the server,
# sampled streams, interleaved pairs: the bundled 4-layer model (one-row step 1.1-1.2 ms; its second thread's gain
# 1.01-1.04x, the fastest of 9 timings each) serves 16 streams at 1,818-2,346 tok/s with 1 thread against
# 1,054-2,064 with 2 (1 thread ahead in each of 4 pairs), 64 streams at 2,373-3,099 against 1,582-1,842 (3 pairs);
# 1 stream is a wash (362-405 vs 330-398 sampled; greedy,
# bench.spec_peers: 407 vs 410). GPT-2 124M (a 9-24 ms step by format) keeps both: 59 / 396 tok/s at 1 / 16
# streams with 2 threads against 45 / 286-300 with 1.
FAST_STEP_S = 0.004
THREAD_GAIN = 1.25


def choose_threads(core, n: int, repeats: int = 9) -> dict[str, Any]:
    """With GPT_TORCH_THREADS unset, on a CPU of n >= 2 cores: time the core's one-row decode step at n threads;
    under FAST_STEP_S, time it at n - 1 too (interleaved, the fastest of each, on an empty slot) and keep n only
    when it is THREAD_GAIN faster. Sets torch's threads; returns what it measured (for /info)."""
    import torch

    if n < 2 or core.device.type != "cpu":
        return {"threads": n, "cores": n, "one_row_step_ms": None, "last_thread_gain": None, "chosen": "all"}
    token = torch.zeros(1, 1, dtype=torch.long, device=core.device)

    def step_s(threads: int, calls: int) -> float:
        torch.set_num_threads(threads)
        core.cache.reset(0)
        t0 = time.perf_counter()
        for _ in range(calls):
            core.model.forward_cached(token, core.cache, [0])
        return (time.perf_counter() - t0) / calls

    with torch.inference_mode():
        step_s(n - 1, 2)  # first calls create the one-row primitives at each thread count
        first = min(step_s(n, 2), step_s(n, 1))
        chosen = n
        gain = None
        if first < FAST_STEP_S:
            # interleaved; the fastest of each (a start-up's other work only ever makes a step slower)
            calls = max(1, min(8, int(0.01 / first)))
            fewer, every = [], []
            for _ in range(repeats):
                fewer.append(step_s(n - 1, calls))
                every.append(step_s(n, calls))
            first = min(every)
            gain = min(fewer) / first
            chosen = n if gain >= THREAD_GAIN else n - 1
    core.cache.reset(0)
    torch.set_num_threads(chosen)
    log.info("torch threads: %d of %d (one-row step %.2f ms; the last thread's gain %s)", chosen, n, first * 1000,
             f"{gain:.2f}x" if gain else "not measured")
    return {"threads": chosen, "cores": n, "one_row_step_ms": round(first * 1000, 3),
            "last_thread_gain": None if gain is None else round(gain, 3), "chosen": "all" if chosen == n else "n-1"}


def keep_freed_memory() -> bool:
    """glibc's malloc: blocks up to 32 MiB come from the heap, and what is freed stays there (no trim below 1 GiB),
    so a prefill's activations (~6 MiB each for a 512-token GPT-2 prompt) reuse pages already mapped. By default
    glibc maps such blocks afresh and unmaps them when freed (its threshold only moves up after a free), so a
    prompt longer than the last ones pays a page fault for every 4 KiB it touches. Measured (GPT-2 124M, 2 cores,
    in-process prefills in this order): 600 tokens 374 ms (8,238 faults) then 318; 700 tokens 493 then 446 (8,336
    faults again); 1,024 after them 759 (30,136 faults); with this: 700 tokens 392 then 371 (1,050 faults), 1,024
    566 (7,040). Through the server (TTFT of 12 distinct prompts of 300-1,000 tokens, two interleaved runs): 5,549 /
    5,317 ms in all without, 5,418 / 5,225 with; a 1,000-token prompt after shorter ones 747-752 -> 703-717 ms.
    The heap keeps its peak afterwards (a server's working set). Skipped where the user set glibc's
    own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, and where mallopt does not exist (not glibc). Returns
    whether it applied."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def release_freed_memory() -> None:
    """Give the heap's free pages back to the kernel once (glibc's malloc_trim), after loading: the weights as
    stored (fp32) are freed when the engine swaps in their served copy (packed, int8, int4), but `keep_freed_memory`
    keeps freed blocks resident. Measured through bench.peers (GPT-2 124M, idle PSS): int8 1.46 GB before this."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_core_process(cfg_dict: dict, address: str, conn, parent_pid: int) -> None:
    """The child's main: load, report to the parent through `conn`, then serve the fronts until told to stop."""
    # OpenMP waits (read when torch loads libgomp, so before that): spin ~30,000 pause loops (a fraction of a
    # millisecond), then sleep. Sleeping at once (OMP_WAIT_POLICY=PASSIVE alone) put both threads to sleep between
    # every pair of ops: ~135 context switches per token, GPT-2 124M batch-1 decode 32 tok/s through the server
    # against 43 in-process. Long spins (libgomp's default; OMP_WAIT_POLICY=ACTIVE spins for minutes) decode as
    # fast but starved the front on tiny models (49 tok/s, 105 ms stalls) and burn a core while idle. Measured
    # (2 cores, 2 threads, 200-token greedy streams): 32 tok/s passive; 42.7 / 43.0 / 42.4 with GOMP_SPINCOUNT
    # 10k / 30k / 100k; an idle core uses no CPU with 300k or less. PASSIVE still applies where libgomp throttles
    # (more OpenMP threads than CPUs): those never spin.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    malloc_tuned = keep_freed_memory()
    cfg = CoreConfig(**cfg_dict)
    measure_threads = not cfg.torch_threads
    cfg.torch_threads = core_threads(cfg)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s:     [core] %(message)s")
    try:
        core, info, classify = build_core(cfg)
    except StartupError as e:
        conn.send(("error", str(e)))
        sys.exit(1)
    info["malloc_keeps_freed_memory"] = malloc_tuned
    if measure_threads:
        info["thread_choice"] = choose_threads(core, cfg.torch_threads)
        info["torch_threads"] = info["thread_choice"]["threads"]
    release_freed_memory()  # the weights as loaded, freed by the swap to their served format
    import zmq

    from engine.core_loop import CoreLoop, DeviceFailed

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a front that went away: its frames are dropped, never block
    sock.bind(address)
    loop = CoreLoop(core, ZmqTransport(sock, parent_pid), info=info, classify=classify, warmup=cfg.warmup)

    def on_term(signum, frame) -> None:  # ends the loop after the current step; open requests get SHUTDOWN
        loop.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    conn.send(("loaded", info))
    conn.close()
    try:
        loop.run()
    except DeviceFailed as e:  # a sticky CUDA error: exit, so the server's /live fails and it is restarted
        log.error("the device failed, the engine core exits: %s", e)
        sys.exit(DEVICE_FAILED_EXIT)
    finally:
        sock.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------------------------------------- the parent
class CoreProcess:
    """The parent's handle on the core process: start it, wait until the model is loaded, stop it."""

    def __init__(self, cfg: CoreConfig) -> None:
        self.cfg = cfg
        self.dir = Path(tempfile.mkdtemp(prefix="gpt-core-"))
        self.address = f"ipc://{self.dir / 'engine.sock'}"
        ctx = mp.get_context("spawn")  # never fork a process that holds threads (uvicorn's, torch's) or CUDA
        self._conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_core_process, args=(asdict(cfg), self.address, child, os.getpid()),
                                name="gpt-engine-core", daemon=False)
        self._child_conn = child
        self.info: dict[str, Any] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def start(self) -> None:
        self.proc.start()
        self._child_conn.close()

    def wait_loaded(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the model is loaded and the core built: its info; StartupError with the child's line."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.1):
            if not self.proc.is_alive():
                self.proc.join()
                self.cleanup()
                raise StartupError(f"the engine core process exited with status {self.proc.exitcode} while loading")
            if end is not None and time.monotonic() > end:
                self.stop()
                raise StartupError(f"the engine core process did not load the model in {timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.proc.join()
            self.cleanup()
            raise StartupError(f"the engine core process exited with status {self.proc.exitcode} while loading") \
                from None
        if kind == "error":
            self.proc.join(10)
            self.cleanup()
            raise StartupError(value)
        self.info = value
        return value

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (the core ends its requests and exits 0), SIGKILL past `timeout`; the exit code."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        elif self.proc.pid is not None:
            self.proc.join(0)
        self.cleanup()
        return self.proc.exitcode

    def cleanup(self) -> None:
        self._conn.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def abandon(self) -> None:
        """Kill the core without waiting and remove its socket directory: for a parent about to `os._exit` (a
        second signal during the drain), which would otherwise leave the directory behind."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
