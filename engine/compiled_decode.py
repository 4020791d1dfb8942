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
import types
from dataclasses import dataclass

import torch

from engine.cuda_graphs import BUCKETS, CONTEXT_BUCKETS, context_buckets, step_key
from engine.plain_draw import KINDS, Kind, plain_draw
from engine.sampler import Sampler
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


def _decode_draw(model: GPT, tokens: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
                 lengths_t: torch.Tensor, arange: torch.Tensor, max_len: int, kv_len: int, kind: Kind, vocab: int,
                 block: int, inv_temp: torch.Tensor, seed_key: torch.Tensor, length: torch.Tensor,
                 prompt_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step and the plain draw of its rows (engine/plain_draw.py) as one graph: (token, logprob)."""
    logits = model.decode_static(tokens, _SlotsView(k, v, lengths_t, arange, max_len), kv_len)
    return plain_draw(logits, vocab, block, kind, inv_temp, seed_key, length - prompt_len)


def _own_code(fn, name: str):
    """`fn` with a code object of its own: dynamo keeps its compiled entries per code object, so one per bucket
    keeps each replay's cache a single entry (no limit of 8 entries to reach, no guards to tell them apart)."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__)


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
    """Compiled decode steps for batches up to `max_batch` over `cache`, made by `start()` in a thread: per (batch,
    context) bucket one step that returns logits, and with a `sampler`, one per plain kind (engine/plain_draw.py)
    that returns the drawn tokens."""

    def __init__(self, model: GPT, cache: KVCache, max_batch: int, contexts=CONTEXT_BUCKETS,
                 sampler: Sampler | None = None) -> None:
        self.model, self.cache, self.max_batch, self.sampler = model, cache, max_batch, sampler
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.contexts = context_buckets(cache.max_len, contexts)
        self.kinds: tuple[Kind | None, ...] = (None,) + (KINDS if sampler is not None else ())
        self.tokens = torch.zeros(max_batch, 1, dtype=torch.long, device=cache.device)
        self.steps: dict[tuple[int, int, Kind | None], object] = {}
        self._arg_cache: dict[tuple[int, int, Kind | None], tuple] = {}
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
        """Compile each (batch, context, kind) bucket against scratch tensors shaped like the cache and the sampler's
        state (the live ones are never written from here; `_like` makes each one as its live tensor is, inference
        tensor or not)."""
        import torch._inductor.config

        c, s = self.cache, self.sampler
        # as large as the cache's own tensors (dynamo guards on a view's base too), but only the first max_batch
        # slots are read or written (zeroed here); the rest stays untouched, uncommitted memory
        scratch = _Scratch(
            k=[_like(t, rows=self.max_batch) for t in c.k], v=[_like(t, rows=self.max_batch) for t in c.v],
            lengths_t=_like(c.lengths_t), tokens=_like(self.tokens), arange=_like(c._arange, copy=True),
            draw=[_like(t, copy=True) for t in s.plain_inputs(s.n_slots)] if s is not None else [])  # 1/T > 0
        with torch._inductor.config.patch(CPU_OPTIONS), torch.inference_mode():  # freezing: read outside the options
            for b in self.buckets:
                for ctx in self.contexts:
                    for kind in self.kinds:
                        fn = torch.compile(_own_code(_decode if kind is None else _decode_draw,
                                                     f"decode_{b}_{ctx}_{kind or 'logits'}"),
                                           fullgraph=True, dynamic=False)
                        args = self._args(b, ctx, kind, scratch)
                        fn(*args)
                        fn(*args)  # a second call: no guard fails, nothing recompiles
                        self.steps[b, ctx, kind] = fn

    # ------------------------------------------------------------------ replaying
    def _args(self, b: int, ctx: int, kind: Kind | None, scratch: _Scratch | None = None) -> tuple:
        """The step's arguments: views of the live cache and sampler state (made once per bucket: the same views
        every replay), or of `scratch` while compiling."""
        if scratch is None and (b, ctx, kind) in self._arg_cache:
            return self._arg_cache[b, ctx, kind]
        c = self.cache
        src = scratch or _Scratch(k=c.k, v=c.v, lengths_t=c.lengths_t, tokens=self.tokens, arange=c._arange,
                                  draw=list(self.sampler.plain_inputs(self.sampler.n_slots)) if self.sampler else [])
        args = (self.model, src.tokens[:b], [t[:b] for t in src.k], [t[:b] for t in src.v], src.lengths_t[:b],
                src.arange, c.max_len, ctx)
        if kind is not None:
            s = self.sampler
            args += (kind, s.vocab_size, s.block, *(t[:b] for t in src.draw))
        if scratch is None:
            self._arg_cache[b, ctx, kind] = args
        return args

    def replay(self, n: int, kind: Kind | None = None):
        """The compiled step over slots 0..n-1 (self.tokens[:n] already written; the cache not advanced): logits,
        or with a plain `kind` the (token, logprob) drawn."""
        b, ctx = step_key(self.cache, n, self.buckets, self.contexts)
        # the arguments are the same views with the same shapes every time: the guards cannot fail
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            out = self.steps[b, ctx, kind](*self._args(b, ctx, kind))
        return out[:n] if kind is None else (out[0][:n], out[1][:n])

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Next-token logits (n, vocab) for slots 0..n-1 fed `tokens` (n,); advances the cache."""
        self.tokens[:n, 0].copy_(tokens)
        out = self.replay(n)
        self.cache.advance(range(n), 1)
        return out

    @torch.inference_mode()
    def draw(self, tokens: torch.Tensor, n: int, kind: Kind) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens drawn for slots 0..n-1 fed `tokens` (n,), whose rows are plain of `kind`
        (`Sampler.plain_kind`), with their log-probabilities; advances the cache (the sampler records them)."""
        self.tokens[:n, 0].copy_(tokens)
        out = self.replay(n, kind)
        self.cache.advance(range(n), 1)
        return out

    @torch.inference_mode()
    def check(self, atol: float = 1e-3) -> bool:
        """Each compiled bucket equals the eager step on the live cache (written at each row's next position, which
        the row's next step overwrites, as a CUDA graph's padding rows do; the cache is not advanced): the same
        logits, and for a draw the same tokens as plain_draw on the eager logits."""
        for (b, ctx, kind), fn in self.steps.items():
            args = self._args(b, ctx, kind)
            eager = _decode(*args[:8])
            # guards evaluated this once: the live views must pass the guards the scratch tensors set, or the
            # replay (which skips them) would run a graph made for other tensors; a recompile here is an error
            with torch.compiler.set_stance("fail_on_recompile"):
                got = fn(*args)
            if kind is None:
                same = torch.allclose(got.float(), eager.float(), atol=atol, rtol=1e-2)
            else:
                inv_temp, seed_key, length, prompt_len = args[11:]
                token, logprob = plain_draw(eager, *args[9:11], kind, inv_temp, seed_key, length - prompt_len)
                same = torch.equal(got[0], token) and torch.allclose(got[1], logprob, atol=atol, rtol=1e-2)
            if not same:
                return False
        return bool(self.steps)


@dataclass
class _Scratch:
    """The tensors a step reads: the live cache's and sampler's, or scratch ones of the same shapes (compile)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths_t: torch.Tensor
    tokens: torch.Tensor
    arange: torch.Tensor
    draw: list[torch.Tensor]
