"""What a server tunes to the CPU it runs on, measured or set at start-up: the auto dtype (a bf16 timing), the torch
threads (a one-row step timing) and OpenMP's waits (glibc's malloc: engine/heap.py). The measurements behind each
choice: docs/performance.md, "Measurements moved out of code comments".
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

# torch and the model's modules are imported inside the functions below: the core process calls set_openmp_waits
# before torch loads (OpenMP reads its waits when torch loads libgomp).

log = logging.getLogger("engine")


def set_openmp_waits() -> None:
    """OpenMP's waits for a process that has not loaded torch yet: spin ~30,000 pause loops (a fraction of a
    millisecond), then sleep. Sleeping at once starved the decode step of its threads between every pair of ops, and
    libgomp's long default spins starved the HTTP front on tiny models and burn a core while idle. PASSIVE still
    applies where libgomp throttles (more OpenMP threads than CPUs): those never spin. Settings the user made win."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")


_DTYPE_CHOICES: dict[tuple, tuple] = {}
BF16_SPEEDUP = 1.15  # bf16 must beat fp32 by this much at 1 and at 16 rows to be the CPU's auto dtype


def serving_dtype(cfg, device, dtype, before_timing=None) -> tuple[Any, dict | None]:
    """The dtype a server computes in (`cfg`: an engine.build.CoreConfig), and why. `--dtype auto` on a CPU serving
    unquantized weights is fp32 for a small model whose step `--compile` compiles (`compiles_small_fp32`), else bf16
    where the CPU computes bf16 natively (avx512_bf16 or AMX in its flags) and a one-off
    timing at load finds the model's widest matmul (n_embd → 4·n_embd, oneDNN's packed weight) at least 1.15x faster
    in bf16 at 1 and at 16 rows; else fp32 (the reference): on an AVX2-only CPU oneDNN emulates bf16 and it is slower
    (docs/api.md, "Formats per CPU"). The choice is made once per machine and shape and kept on disk with the kernel
    choices (`KernelChoices`: the same key, the compile cache's folder), so a restart serves the same numbers;
    load_model makes it, build_core reports it (/info `dtype_choice.kept`). `before_timing` (optional) is called just
    before the timing: the core process waits there for its front's imports, since a choice made beside them would
    be kept."""
    import torch

    if cfg.dtype != "auto" or device.type != "cpu" or cfg.quantize != "none":
        return dtype, None
    from model import cpu_support
    from model.checkpoint_info import read_config
    from model.device import DTYPES
    from model.linear import ONEDNN_LINEAR, time_dtypes

    try:
        n_embd = read_config(cfg.checkpoint).n_embd
    except Exception:  # noqa: BLE001 - loading reports what is wrong with the checkpoint, in its words
        return dtype, None
    if compiles_small_fp32(cfg):
        # only fp32 steps are compiled by auto (engine.compiled_decode.resolve_mode), and a small model's compiled
        # fp32 step beats its eager bf16 one (the bundled model on a Zen 4: docs/performance.md, session 33)
        return torch.float32, {"picked": "fp32", "why": "a small model's decode step is compiled in fp32 "
                                                        "(--compile); in bf16 it would decode eagerly, slower"}
    key = (n_embd, torch.get_num_threads())
    if key not in _DTYPE_CHOICES:
        cpu = cpu_support.support()
        native = sorted(set(cpu_support.BF16_FLAGS) & cpu.flags)
        if not cpu.native_bf16 or ONEDNN_LINEAR is None:
            why = "no native bf16 (avx512_bf16 / amx_bf16)" if not native else \
                f"oneDNN does not pack bf16 here (needs {cpu_support.PACKED_BF16_NEEDS})"
            _DTYPE_CHOICES[key] = (torch.float32, {"picked": "fp32", "why": why})
        elif (kept := (choices := KernelChoices(cfg.compile_cache)).kept(f"dtype {n_embd}")) in ("bf16", "fp32"):
            # kept from this machine's first start: a borderline timing flipped between starts here (bundled model,
            # avx512_bf16: bf16 one start, fp32 the next), and with it a seeded request's tokens
            _DTYPE_CHOICES[key] = (DTYPES[kept], {"picked": kept, "cpu_flags": native, "kept": True})
        else:
            if before_timing is not None:
                before_timing()
            ms = time_dtypes(n_embd, 4 * n_embd)
            fast = all(ms["bf16"][r] * BF16_SPEEDUP <= ms["fp32"][r] for r in ms["fp32"])
            picked = "bf16" if fast else "fp32"
            choices.keep(f"dtype {n_embd}", picked)
            _DTYPE_CHOICES[key] = (DTYPES[picked], {"picked": picked, "cpu_flags": native, "kept": False,
                "ms": {name: {str(r): round(t, 4) for r, t in v.items()} for name, v in ms.items()}})
    return _DTYPE_CHOICES[key]


def compiles_small_fp32(cfg) -> bool:
    """Whether `--compile` would compile this checkpoint's fp32 decode step and the model is small (at most
    AUTO_MAX_BLOCK_PARAMS in its blocks), where the compiled step's saving of per-op cost outweighs bf16's halved
    bytes. Larger models keep the bf16 timing (bf16 halves what a memory-bound step reads)."""
    if cfg.compile == "off":
        return False
    from engine.compiled_decode import AUTO_MAX_BLOCK_PARAMS
    from model.checkpoint_info import read_config
    from model.gpt import GPT

    try:
        config = read_config(cfg.checkpoint)
    except Exception:  # noqa: BLE001 - loading reports what is wrong with the checkpoint
        return False
    # counted as engine.compiled_decode.resolve_mode counts it; not shared through a helper there because any code
    # change to that file re-keys every compiled package (a ~10-minute GPT-2 recompile a format at the next start)
    return sum(p.numel() for p in GPT.skeleton(config).transformer.h.parameters()) <= AUTO_MAX_BLOCK_PARAMS


def core_threads(cfg) -> int:
    """Torch threads the core process loads with (`cfg`: an engine.build.CoreConfig): GPT_TORCH_THREADS, else every
    CPU this process may run on (as llama-server's default); without the setting `choose_threads` then measures
    whether the last one is worth taking from the fronts."""
    if cfg.torch_threads:
        return cfg.torch_threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# A model whose one-row decode step takes under FAST_STEP_S at every thread leaves the last core to the HTTP fronts
# unless that core makes the step THREAD_GAIN faster: the fronts (detokenizing, SSE, JSON) need CPU in proportion to
# the tokens a second, which a fast step makes many (docs/performance.md: the bundled model's eager step served
# faster with one of two threads, GPT-2 124M with both).
FAST_STEP_S = 0.004
THREAD_GAIN = 1.25
# A compiled one-row step (engine/compiled_decode.py: C++ micro-GEMMs, no per-op overhead) gains from every core
# (bundled model in-process 561 -> 364 µs a step with the second of two; through HTTP 1.3-1.5x with the stream
# interval, docs/performance.md 2026-12-06), which the eager step timed here does not show (1.02-1.06x). A core that
# compiles its step keeps n threads unless the last one makes the eager step slower than this: a busy core.
CONTENDED_GAIN = 0.8


def choose_threads(core, n: int, repeats: int = 9) -> dict[str, Any]:
    """With GPT_TORCH_THREADS unset, on a CPU of n >= 2 cores: time the core's one-row decode step at n threads;
    under FAST_STEP_S, time it at n - 1 too (interleaved, the fastest of each, on an empty slot) and keep n only
    when it is THREAD_GAIN faster, or for a core that compiles its decode step, unless n is CONTENDED_GAIN slower.
    Sets torch's threads; returns what it measured (for /info)."""
    import torch

    if n < 2 or core.device.type != "cpu":
        return {"threads": n, "cores": n, "one_row_step_ms": None, "last_thread_gain": None, "chosen": "all"}
    token = torch.zeros(1, 1, dtype=torch.long, device=core.device)
    compiled = core.runner.compile == "on"

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
        fewer_first = step_s(n - 1, 1)
        chosen = n
        gain = None
        # gated on the faster of the two: where something else runs on a CPU, every thread waits on the displaced
        # one (a bundled-model step timed at 5-11 ms on 2 threads, 2.3 ms alone), and fewer threads is the choice
        if min(first, fewer_first) < FAST_STEP_S:
            # interleaved; the fastest of each (a start-up's other work only ever makes a step slower)
            calls = max(1, min(8, int(0.01 / first)))
            fewer, every = [], []
            for _ in range(repeats):
                fewer.append(step_s(n - 1, calls))
                every.append(step_s(n, calls))
            first = min(every)
            gain = min(fewer) / first
            chosen = n if gain >= (CONTENDED_GAIN if compiled else THREAD_GAIN) else n - 1
    core.cache.reset(0)
    torch.set_num_threads(chosen)
    log.info("torch threads: %d of %d (one-row step %.2f ms; the last thread's gain %s)", chosen, n, first * 1000,
             f"{gain:.2f}x" if gain else "not measured")
    return {"threads": chosen, "cores": n, "one_row_step_ms": round(first * 1000, 3),
            "last_thread_gain": None if gain is None else round(gain, 3), "chosen": "all" if chosen == n else "n-1"}


# the entry of a kept thread choice beside the kernels' "OUTxIN" ones: "threads " + thread_model_key(...)
THREADS = "threads "


def thread_model_key(core) -> str:
    """What a one-row step's thread choice depends on besides the machine: the model's shape and the formats of
    its weights and cache, and whether its step is compiled (an engine.core.EngineCore)."""
    c, r = core.model.config, core.runner
    return (f"{c.n_layer}x{c.n_embd}/{c.n_head} vocab {c.vocab_size} weights {r.weights['format']} {r.dtype} "
            f"cache {r.kv_dtype} step {'compiled' if r.compile == 'on' else 'eager'}").replace("torch.", "")


class KernelChoices:
    """`model.linear.tune`'s one-row kernel choices and `choose_threads`' thread count, kept on disk per CPU, torch
    version and thread count (the JSON file `kernels.json` in the compile cache's folder), so only a machine's first
    start times them (GPT-2: ~1 s of start-up, docs/performance.md, "Start-up"). A file that does not parse is
    measured again and rewritten, with one log line; a folder that cannot be written keeps them for this process
    only."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        from pathlib import Path

        from engine.compiled_decode import default_cache_dir

        self.path = (Path(folder) if folder else default_cache_dir()) / "kernels.json"
        self.key = self.machine_key()  # at this moment's thread count, which tune's timings are made at

    @staticmethod
    def machine_key() -> str:
        """This CPU (its model name and flags), torch and its threads: what a timing depends on."""
        import hashlib
        import platform

        import torch

        from model.cpu_support import cpu_flags

        name = ""
        try:
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        except OSError:
            pass
        # 3: choices saved before were timed beside the front's imports (before engine.core_process.wait_quiet) or
        # with the weights in cache for a model that does not fit it (model.linear.tune's `cold`): timed again once
        text = repr((3, name, platform.machine(), sorted(cpu_flags()), torch.__version__, torch.get_num_threads()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _read(self) -> dict:
        import json

        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
            return data
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("kernel choices in %s do not load (%s: %s); measuring them again", self.path,
                        type(e).__name__, e)
            return {}

    def load(self) -> dict[tuple[int, int], str]:
        """The choices known for this key: {(out, in): "mkl" | "onednn"}."""
        known = self._read().get(self.key, {})
        out = {}
        for shape, choice in known.items() if isinstance(known, dict) else ():
            try:
                o, i = (int(n) for n in shape.split("x"))
            except ValueError:
                continue
            if choice in ("mkl", "onednn"):
                out[o, i] = choice
        return out

    def save(self, choices: dict[tuple[int, int], str]) -> None:
        """Merge `choices` into the file under this key."""
        self._merge({f"{o}x{i}": c for (o, i), c in choices.items()})

    def kept(self, name: str) -> Any:
        """The entry `name` kept under this key (a thread count, a dtype), as read: the caller checks it."""
        known = self._read().get(self.key, {})
        return known.get(name) if isinstance(known, dict) else None

    def keep(self, name: str, value: Any) -> None:
        self._merge({name: value})

    def _merge(self, entries: dict) -> None:
        """Merge `entries` into the file under this key (written whole: a crash leaves the old file or the new)."""
        import json
        import tempfile

        if not entries:
            return
        data = self._read()
        entry = data.get(self.key)
        entry = entry if isinstance(entry, dict) else {}
        entry.update(entries)
        data[self.key] = entry
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kernels-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("kernel choices not saved to %s (%s)", self.path, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
