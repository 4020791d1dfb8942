"""From the server's settings to an engine core: `CoreConfig` (the settings as plain values), loading the checkpoint
on its device and dtype, the check that it fits the free memory before loading, and `build_core` with the info it
reports at /info. The one place the settings become an EngineCore, for the core process
(`engine/core_process.py`) and the in-process mode (`app/service.py`) alike.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.cpu_tuning import serving_dtype
from engine.spec_decode import SpecError, parse_speculative
from engine.spec_decode.config import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_K,
    DEFAULT_MAX_BATCH,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
)
from engine.stream_interval import DEFAULT_MS as DEFAULT_STREAM_INTERVAL_MS

# torch and the model's modules are imported inside the functions below: engine/core_process.py imports this module
# at its top, and its spawned child must set OpenMP's waits (engine.cpu_tuning.set_openmp_waits) before torch loads.


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
    compile_cache: str | None = None
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS
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
        if values.get("compile_cache") is not None:
            values["compile_cache"] = str(values["compile_cache"])
        return cls(**values)


def load_model(cfg: CoreConfig, before_timing=None):
    """Resolve device and dtype and load the checkpoint: (checkpoint, device, dtype, seconds); StartupError
    with a one-line reason on failure. `before_timing`: as build_core's, before the auto dtype's timing."""
    import torch

    from model import int4_kernel
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
    waited = []  # the seconds before_timing waited: not loading (core_process counts them as the front's wait)

    def wait() -> None:
        t = time.perf_counter()
        before_timing()
        waited.append(time.perf_counter() - t)

    dtype = serving_dtype(cfg, device, dtype, wait if before_timing else None)[0]
    if device.type == "cuda" and device.index is not None:
        # cuda:N is this process's current device: what is made without an explicit device (CUDA graphs' capture
        # stream and memory pool, cuBLAS workspaces, torch.cuda.synchronize()) lands there, not on GPU 0
        torch.cuda.set_device(device)
    check_fits(cfg, device, dtype)
    if cfg.compile_cache:  # our int4 kernel, built once a machine (a quantized checkpoint loads through it), beside
        int4_kernel.use_folder(Path(cfg.compile_cache) / "kernels")  # the steps (else model.int4_kernel's default)
    try:
        ckpt = load_checkpoint(cfg.checkpoint, device=device, dtype=dtype)
    except CheckpointError as e:
        raise StartupError(f"cannot load checkpoint: {e}") from None
    except (OSError, RuntimeError, ValueError) as e:  # e.g. out of GPU memory
        raise StartupError(f"cannot load checkpoint {cfg.checkpoint}: {type(e).__name__}: {e}") from None
    return ckpt, device, dtype, time.perf_counter() - t0 - sum(waited)

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
    kv, draft_kv = slot_kv_bytes(config.n_layer, config.n_embd, config.block_size,
                                 resolve_kv_dtype(cfg, dtype, device), draft_config)
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

    from model.checkpoint_info import WEIGHTS, read_config
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
    # the parameter count, without allocating it
    return config, max(stored, GPT.skeleton(config).num_params(non_embedding=False) * elsize)


def draft_path(cfg: CoreConfig) -> str | None:
    """The draft checkpoint of GPT_SPECULATIVE=draft:CHECKPOINT, or None (another method, or settings that
    `speculation` refuses with its own one-line error)."""
    try:
        spec = parse_speculative(cfg.speculative)
    except SpecError:
        return None
    return spec.draft if spec.method == "draft" else None


def resolve_kv_dtype(cfg: CoreConfig, dtype, device):
    """The KV cache's dtype. `auto`: the model's, except int8 / int4 weights on a CPU, whose cache is bf16 (as
    llama.cpp keeps an f16 cache beside q8_0 / q4_0 weights): half the memory, decode measured no slower, and a
    quality cost far below the weights' own rounding (docs/performance.md, "A bf16 KV cache by default for int8
    and int4 weights")."""
    import torch

    from model.device import DTYPES

    if cfg.kv_cache_dtype != "auto":
        return DTYPES[cfg.kv_cache_dtype]
    if cfg.quantize in ("int8", "int4") and torch.device(device).type == "cpu" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def build_core(cfg: CoreConfig, loaded=None, before_timing=None):
    """The engine core for a loaded checkpoint (loading it when not given): (core, info, classify). The one place
    the server's settings become an EngineCore, for the core process and the in-process mode alike.
    `before_timing`: called before the engine's first start-up timing (the auto dtype's, engine.runner.ModelRunner's
    kernels), possibly more than once."""
    import torch

    from engine.core import EngineCore
    from engine.sizing import SizingError, plan_slots
    from model.device import DTYPE_NAMES
    from model.linear import FormatError
    from model.task_head import TaskError, load_task

    ckpt, device, dtype, seconds = loaded if loaded is not None else load_model(cfg, before_timing)
    try:
        task = load_task(ckpt.path, ckpt.model, device)
    except TaskError as e:
        raise StartupError(f"cannot load the task head: {e}") from None
    block = ckpt.config.block_size
    kv_dtype = resolve_kv_dtype(cfg, dtype, device)
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
                          compile_max_batch=cfg.compile_max_batch, compile_cache=cfg.compile_cache,
                          tokenizer=ckpt.tokenizer,  # structured output compiles grammars against it
                          before_timing=before_timing)
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
    described = cpu.describe()
    if quantize == "int4":  # the path int4 layers take here (model/int4_kernel.py), "none": aten's bf16 kernel
        from model import int4_kernel

        described["int4_kernel"] = int4_kernel.isa()
    return described, note


def speculation(cfg: CoreConfig, ckpt, device, dtype):
    """The speculative decoding settings as the core takes them: (SpecConfig or None when off, the draft model or
    None); StartupError with a one-line reason for bad ones (an unknown method, a draft with another tokenizer)."""
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

