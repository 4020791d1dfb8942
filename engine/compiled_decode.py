"""Decode steps compiled by inductor on a CPU: the small-batch step without PyTorch's per-op cost.

The CPU counterpart of engine/cuda_graphs.py: one compiled `GPT.decode_static` per (batch, context) bucket, as
SGLang's `cpu_graph_runner.py` compiles a step per batch size, with inductor's CPU options. `max_autotune` with
inductor's C++ GEMM templates is what pays: one-row matmuls from generated micro-kernels instead of MKL / oneDNN
calls (docs/performance.md, "A compiled decode step"); without it the compiled step was no faster than eager.

- Only batches up to `max_batch` are compiled: batch 1 is where a token's fixed cost shows; larger batches are
  matmul-bound and stay eager (each bucket costs a compile).
- The graph reads the model's plain weights: oneDNN's packed copies (`model.linear.PackedLinear`) are opaque to
  dynamo, so an engine that compiles has its packed layers keep their plain weight too (`convert(keep_plain=True)`;
  eager steps keep oneDNN's kernels) and inductor's freezing makes its own constants from it: about three copies
  of the weights, which is why `auto` compiles only small models.
- The step takes the cache's tensors as arguments (views of the first `b` slots), so it is compiled against
  scratch tensors of the same shapes **in a background thread** while the engine serves eagerly; the engine swaps
  it in at a step boundary once a replay equals the eager step on the live cache (`EngineCore._install_compiled`).
  Start-up does not wait for the compiler. Guards are not evaluated on replay: the arguments are the same views
  every time (vLLM skips them on its compiled CPU path too).
- A compile that fails, or a replay that differs from eager decoding, leaves the engine eager with one log line.
  Compiled kernels are cached on disk by inductor (`TORCHINDUCTOR_CACHE_DIR`): a restart on the same machine skips
  the autotuning (~20-60 s cold, ~10 s warm for the bundled model on 2 CPU cores).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from engine.cuda_graphs import BUCKETS, CONTEXT_BUCKETS, context_buckets, step_key
from model.gpt import GPT
from model.kv_cache import KVCache

MODES = ("off", "on", "auto")
# auto compiles a model whose blocks hold at most this many parameters: there a token's cost is PyTorch's per-op
# overhead, which the compiled step removes (the bundled model's 3.2M: batch 1 2.3x faster in-process); GPT-2
# 124M's 85M are bandwidth-bound (no gain measured, +2.5 GB resident): docs/performance.md
AUTO_MAX_BLOCK_PARAMS = 16_000_000
# inductor's options for the CPU step (torch/_inductor/config.py): weights as constants (freezing: packed once),
# max_autotune choosing between aten's GEMM and inductor's C++ micro-kernel per shape
CPU_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
DEFAULT_MAX_BATCH = 1


def one_line(e: BaseException) -> str:
    """An exception as the one log line a failed compile or check gets (inductor's messages run to pages)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


@dataclass
class _SlotsView:
    """What `GPT.decode_static` reads of a KVCache, for the first `b` slots: the cache's own tensors (views) at
    replay, scratch tensors of the same shapes while compiling."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths_t: torch.Tensor
    _arange: torch.Tensor
    max_len: int

    plan_static = KVCache.plan_static


def _decode(model: GPT, tokens: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], lengths_t: torch.Tensor,
            arange: torch.Tensor, max_len: int, kv_len: int) -> torch.Tensor:
    return model.decode_static(tokens, _SlotsView(k, v, lengths_t, arange, max_len), kv_len)


def resolve_mode(mode: str, model: GPT, device: torch.device, dtype: torch.dtype, quantize: str) -> str:
    """on / off for this model: only a CPU's unquantized decode step is compiled (fbgemm's packed int8 is opaque to
    dynamo; CUDA has its graphs); auto also needs fp32 and a small model (AUTO_MAX_BLOCK_PARAMS)."""
    if mode not in MODES:
        raise ValueError(f"compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or device.type != "cpu" or quantize != "none":
        return "off"
    if mode == "auto":
        block_params = sum(p.numel() for p in model.transformer.h.parameters())
        return "on" if dtype == torch.float32 and block_params <= AUTO_MAX_BLOCK_PARAMS else "off"
    return "on"


def _like(t: torch.Tensor, copy: bool = False, rows: int | None = None) -> torch.Tensor:
    """A scratch tensor the compiled step's guards take for `t`: same shape, dtype and strides, and an inference
    tensor exactly where `t` is one (the guards check the dispatch keys). rows: only the first `rows` are zeroed
    (an empty tensor elsewhere: a large one's untouched pages are never committed)."""
    with torch.inference_mode(t.is_inference()):
        if copy:
            return t.clone()
        if rows is None:
            return torch.zeros_like(t)
        out = torch.empty_like(t)
        out[:rows].zero_()
        return out


class CompiledDecode:
    """Compiled decode steps for batches up to `max_batch` over `cache`, made by `start()` in a thread."""

    def __init__(self, model: GPT, cache: KVCache, max_batch: int, contexts=CONTEXT_BUCKETS) -> None:
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.contexts = context_buckets(cache.max_len, contexts)
        self.tokens = torch.zeros(max_batch, 1, dtype=torch.long, device=cache.device)
        self.steps: dict[tuple[int, int], object] = {}
        self.error: str | None = None
        self.seconds: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()  # the engine's: inductor sizes its kernels' parallelism by it

    # ------------------------------------------------------------------ compiling
    def start(self) -> None:
        """Compile every bucket in a daemon thread; `done` tells when, `error` what failed."""
        self._thread = threading.Thread(target=self._compile_all, name="compile-decode", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def _compile_all(self) -> None:
        t0 = time.perf_counter()
        torch.set_num_threads(self._threads)  # a new thread starts with every core
        try:
            self.compile_all()
        except Exception as e:  # noqa: BLE001 - dynamo / inductor raise many kinds; the engine stays eager
            self.error = one_line(e)
            self.steps.clear()
        finally:
            self.seconds = round(time.perf_counter() - t0, 2)
            self._done.set()

    def compile_all(self) -> None:
        """Compile each (batch, context) bucket against scratch tensors shaped like the cache (the live cache is
        never written from here; `_like` makes each one as its live tensor is, inference tensor or not)."""
        import torch._inductor.config

        c = self.cache
        # as large as the cache's own tensors (dynamo guards on a view's base too), but only the first max_batch
        # slots are read or written (zeroed here); the rest stays untouched, uncommitted memory
        scratch_k = [_like(t, rows=self.max_batch) for t in c.k]
        scratch_v = [_like(t, rows=self.max_batch) for t in c.v]
        lengths, tokens, arange = _like(c.lengths_t), _like(self.tokens), _like(c._arange, copy=True)
        with torch._inductor.config.patch(CPU_OPTIONS), torch.inference_mode():  # freezing: read outside the options
            for b in self.buckets:
                for ctx in self.contexts:
                    fn = torch.compile(_decode, fullgraph=True, dynamic=False)
                    args = (self.model, tokens[:b], [t[:b] for t in scratch_k], [t[:b] for t in scratch_v],
                            lengths[:b], arange, c.max_len, ctx)
                    fn(*args)
                    fn(*args)  # a second call: no guard fails, nothing recompiles
                    self.steps[b, ctx] = fn

    # ------------------------------------------------------------------ replaying
    def _args(self, b: int, ctx: int) -> tuple:
        c = self.cache
        return (self.model, self.tokens[:b], [t[:b] for t in c.k], [t[:b] for t in c.v], c.lengths_t[:b], c._arange,
                c.max_len, ctx)

    def replay(self, n: int) -> torch.Tensor:
        """Logits of the compiled step over slots 0..n-1 (self.tokens[:n] already written); the cache not advanced."""
        b, ctx = step_key(self.cache, n, self.buckets, self.contexts)
        # the arguments are the same views with the same shapes every time: the guards cannot fail
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self.steps[b, ctx](*self._args(b, ctx))[:n]

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Next-token logits (n, vocab) for slots 0..n-1 fed `tokens` (n,); advances the cache."""
        self.tokens[:n, 0].copy_(tokens)
        out = self.replay(n)
        self.cache.advance(range(n), 1)
        return out

    @torch.inference_mode()
    def check(self, atol: float = 1e-3) -> bool:
        """Each compiled bucket equals the eager step on the live cache (written at each row's next position, which
        the row's next step overwrites, as a CUDA graph's padding rows do; the cache is not advanced)."""
        for (b, ctx), fn in self.steps.items():
            args = self._args(b, ctx)
            eager = _decode(*args).float()
            # guards evaluated this once: the live views must pass the guards the scratch tensors set, or the
            # replay (which skips them) would run a graph made for other tensors; a recompile here is an error
            with torch.compiler.set_stance("fail_on_recompile"):
                got = fn(*args).float()
            if not torch.allclose(got, eager, atol=atol, rtol=1e-2):
                return False
        return bool(self.steps)
