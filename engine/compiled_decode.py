"""Decode steps compiled ahead of time on a CPU: the small-batch step without PyTorch's per-op cost.

The CPU counterpart of engine/cuda_graphs.py, built as torchchat builds its runner's step: `torch.export` of one
static-shape decode step (`GPT.decode_static`, and for plain rows the draw too: engine/plain_draw.py) per
(batch, context, kind) bucket, compiled by AOTInductor into a library of C++ kernels and a C++ wrapper
(`aoti_compile_and_package`, then `unpack`), run by AOTInductor's C++ runner with the live cache's tensors. Inductor's
CPU options: `freezing` (weights as constants) and `max_autotune` over its C++ GEMM micro-kernels, which is what
pays for one-row matmuls. Against the same graph through `torch.compile`, the C++ wrapper also drops dynamo's frame
evaluation and AOT autograd's runtime wrappers, ~40% of the bundled model's compiled step (docs/performance.md,
"Decode steps compiled ahead of time").

- Only batches up to `max_batch` are compiled: batch 1 is where a token's fixed cost shows; larger batches are
  matmul-bound and stay eager (each bucket costs a compile).
- The export traces a plain twin of the served model (`plain_twin`: nn.Linear with the plain weights that the
  packed layers keep until the compile is over, `model.linear.drop_plain`); the engine's own modules stay as they
  are and its eager steps keep oneDNN's kernels.
- **In a background thread** while the engine serves eagerly; the engine swaps the steps in at a step boundary
  once a replay equals the eager step on the live cache (`ModelRunner._install_compiled`). Start-up never waits.
- **Cached on disk** (`cache_dir`: the server's `GPT_COMPILE_CACHE`, default ~/.cache/gpt-serve/compiled), a
  folder per key: the weights' bytes, the buckets, this CPU's flags, the torch threads, torch's version and the
  source of the code traced (beside them `kernels.json`: the eager one-row kernel choices, engine.cpu_tuning).
  A restart on the same machine loads the packages in milliseconds instead of compiling for minutes; a package
  that does not load (corrupt, another torch) is compiled again, with one log line.
- **One copy of the weights for all buckets**: every package freezes the same weights (packed for its GEMMs); they
  are kept out of the libraries, once per distinct tensor (`unpack`: the folder's `weights/`), memory-mapped at load
  and handed to each step as its user-managed constants. GPT-2 124M's 15 one-row packages held 657 MB each: a
  server with them idled at 18 GB (docs/performance.md).
- A compile that fails, or a replay that differs from eager decoding, leaves the engine eager with one log line.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from engine.cuda_graphs import BUCKETS, CONTEXT_BUCKETS, context_buckets, step_key
from engine.heap import release_freed_memory
from engine.plain_draw import KINDS, Kind, plain_draw
from engine.sampler import Sampler
from model import cpu_support
from model.cpu_support import cpu_flags
from model.gpt import GPT
from model.kv_cache import KVCache
from model.linear import Int4Linear, Int8Embedding, Int8Extern, Int8Linear, Int8Traced, PackedLinear

# served, and their twins (Int4Traced: an Int4Linear)
QUANTIZED = (Int8Linear, Int8Traced, Int8Extern, Int4Linear, Int8Embedding)

log = logging.getLogger(__name__)

MODES = ("off", "on", "auto")
# auto compiles fp32 and quantized weights of any size where the compile fits in memory, and keeps the steps only
# where they beat the eager step when installed (engine.compile_gate: GPT-2 124M 1.2-1.3x on an AVX-512 host at 2
# threads, no gain on an AVX2 one at 1 thread). A quantized step computes eager's bits (`Step.exact`: its int8
# matmuls fbgemm's, its layer norms, GELU and attention eager's own kernels), so its seeded streams keep the eager
# tokens (before: GPT-2 int8 left them after 11-24 of 128). fp32 weights over a 16-bit KV cache only in models whose
# blocks hold at most this many parameters (the bundled model's 3.2M): GPT-2 124M's step over a bf16 cache failed
# the install check (inductor's GEMMs' ulps moving a key across a bf16 rounding), its compile peaking at 13.5 GB
# resident (docs/performance.md)
AUTO_MAX_BLOCK_PARAMS = 16_000_000
# inductor's options for the CPU step (torch/_inductor/config.py): weights as constants (freezing: packed once),
# max_autotune over inductor's C++ micro-kernels per shape, ATen's GEMM only where no micro-kernel fits: ATen's fp32
# linear holds oneDNN's packed weight, an opaque constant, and a package with one keeps its own copy of every
# weight (`unpack`): a GPT-2 compile in which autotuning timed ATen's 768x768 matmul faster by a hair (0.072 ms) made
# 15 such packages, 9.2 GB on disk and each loaded into memory (docs/performance.md)
CPU_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
               # the frozen weights out of the package's library, in a blob beside it: `unpack` keeps one copy of
               # each on disk and in memory for all packages (GPT-2's 15 each held their own 657 MB: 18 GB idle)
               "aot_inductor.package_constants_in_so": False,
               "aot_inductor.package_constants_on_disk_format": "binary_blob"}
# a speculative verification pass's steps, of kind (VERIFY, width): one row fed its last token and a proposal,
# padded to `width` positions, the logits of every position out (engine.core's _verify draws from them)
VERIFY = "verify"


def verify_widths(most: int) -> tuple[int, ...]:
    """The widths of the verification passes compiled for proposals of up to `most` - 1 tokens: 3, 5, 9, ... below
    it, and `most`. A pass costs about its width in one-row steps' matmuls on a CPU (the bundled model on an AVX2
    host: widths 1 / 3 / 5 / 9 at 0.6 / 0.9 / 1.4 / 2.2 ms), and a proposal starts at 2 tokens and doubles while it
    holds (engine/spec_decode), so it is padded to the next width, not to the widest."""
    return tuple(sorted({w for w in (1 + 2 ** i for i in range(1, 8)) if w < most} | {most})) if most >= 2 else ()


WEIGHTS = "weights"  # a folder's shared constants: WEIGHTS/<sha256>, and MANIFEST: step → constant → its file
MANIFEST = "weights.json"
DEFAULT_MAX_BATCH = 1
# the code a package was traced from: a change to any of these files makes new packages
TRACED = ("engine/compiled_decode.py", "engine/plain_draw.py", "engine/sampler/noise.py", "engine/sampler/sampler.py",
          "engine/sampler/top_p.py", "engine/sampler/draw.py",
          "model/gpt.py", "model/kv_cache.py", "model/linear.py")


# held by every background compile in this process (these steps, engine.compiled_attention): dynamo's tracing is
# not thread-safe; two at once made the export fail ("'GraphModule' object has no attribute '_in_spec'").
COMPILE_LOCK = threading.Lock()


def one_line(e: BaseException) -> str:
    """An exception as the one log line a failed compile or check gets (inductor's messages run to pages)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def idle_priority() -> None:
    """This thread, and the compilers it starts, run only on CPU time serving leaves: Linux schedules each thread
    (SCHED_IDLE, else nice 19) on its own. A first compile of the 4 packages runs for minutes; at normal priority it
    made 16 / 64 streams up to 2x slower meanwhile (docs/performance.md). Elsewhere: unchanged."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except (AttributeError, OSError):
            pass


def default_cache_dir() -> Path:
    """Where compiled steps are kept unless the server says (`GPT_COMPILE_CACHE`, app/config.py)."""
    return Path.home() / ".cache" / "gpt-serve" / "compiled"


def code_digest(source: str) -> bytes:
    """What a package depends on in a traced file: its syntax tree without comments, docstrings or line numbers, so
    an edit to the prose compiles nothing anew (GPT-2's first compile takes ~10 minutes a format)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def resolve_mode(mode: str, model: GPT, device: torch.device, dtype: torch.dtype, quantize: str,
                 kv_dtype: torch.dtype | None = None) -> str:
    """on / off for this model: only a CPU's decode step is compiled (CUDA has its graphs): fp32 / bf16, int4, and
    int8 where fbgemm serves it eagerly (the rounding its compiled twin reproduces: model.linear.Int8Traced, or
    where the CPU has no int8 dot products, Int8Extern calling fbgemm's kernel from the step); auto also needs fp32
    (or quantized) weights, and fp32 weights over a 16-bit KV cache (`kv_dtype`; default: `dtype`) a small model
    (AUTO_MAX_BLOCK_PARAMS, counted as loaded)."""
    if mode not in MODES:
        raise ValueError(f"compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or device.type != "cpu":
        return "off"
    if quantize == "int8" and not cpu_support.support().fbgemm:
        return "off"
    if mode == "auto":
        if dtype != torch.float32:
            return "off"
        if quantize != "none" or (kv_dtype or dtype).itemsize == 4:
            return "on"
        block_params = sum(p.numel() for p in GPT.skeleton(model.config).transformer.h.parameters())
        return "on" if block_params <= AUTO_MAX_BLOCK_PARAMS else "off"
    return "on"


@dataclass
class _SlotsView:
    """What `GPT.decode_static` reads of a KVCache, for the first `b` slots: views of the cache's own tensors."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths_t: torch.Tensor
    _arange: torch.Tensor
    max_len: int

    plan_static = KVCache.plan_static


class Step(nn.Module):
    """One bucket's decode step as a module for torch.export. Its inputs, in order (`CompiledDecode.inputs`): the
    tokens (b, 1), the cache lengths (b,), the draw's 1/T, top-k, top-p, seed keys, history and prompt lengths (b,),
    then every layer's keys and values (b, H, max_len, D); the keys and values at each row's length are written in
    place. Output: logits (b, vocab), or with a plain `kind` what `plain_draw` returns (the token and logprob
    drawn, and for a sampled kind top-p's check and its redraw's inputs). Tokens (b, T > 1): a verification pass
    (no kind), logits (b, T, vocab)."""

    def __init__(self, model: GPT, max_len: int, kv_len: int, kind: Kind | None, vocab: int, block: int) -> None:
        super().__init__()
        self.model, self.max_len, self.kv_len, self.kind, self.vocab, self.block = model, max_len, kv_len, kind, \
            vocab, block
        # quantized weights: the step computes what eager ATen does around its matmuls (attention, layer norms,
        # GELU), so that its activations round as the eager step's (`_eager_norms`, model.decode_attention's
        # attend_as_eager)
        self.exact = any(isinstance(m, QUANTIZED) for m in model.modules())
        self.register_buffer("arange", torch.arange(max_len), persistent=False)

    def forward(self, tokens, lengths_t, inv_temp, top_k, top_p, seed_key, length, prompt_len, *kv):
        n = len(kv) // 2
        slots = _SlotsView(list(kv[:n]), list(kv[n:]), lengths_t, self.arange, self.max_len)
        logits = self.model.decode_static(tokens, slots, self.kv_len, self.exact)
        if self.kind is None:
            return logits
        return plain_draw(logits, self.vocab, self.block, self.kind, inv_temp, top_k, top_p, seed_key,
                          length - prompt_len)


def _width(kind) -> int:
    """A verification pass's width, from its steps' kind (VERIFY, width); 0 for a decode step's."""
    return kind[1] if isinstance(kind, tuple) else 0


def plain_twin(model: GPT) -> GPT:
    """The served model as plain modules for the export: nn.Linear where the engine put oneDNN's packed layers, with
    the plain weights those kept (shared, not copied); quantized layers as model.linear's `traceable` twins (int8:
    the quantization ops inductor fuses into its int8 GEMM, the weights read back from fbgemm's copies; int4: its
    tensors as buffers); every other tensor shared too."""
    state: dict[str, torch.Tensor] = {}
    swaps: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, Int8Embedding):
            swaps[name], swaps["lm_head"] = m.traceable()  # the tied head over the same table
        elif isinstance(m, (Int8Linear, Int4Linear)):
            if m is not model.lm_head:
                swaps[name] = m.traceable()
        elif isinstance(m, PackedLinear):
            if m.weight is None:
                raise RuntimeError(f"{name} kept no plain weight to compile from (convert(keep_plain=True))")
            state[prefix + "weight"] = m.weight
            if m.bias is not None:
                state[prefix + "bias"] = m.bias
        else:
            for key, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                if t is not None:
                    state[prefix + key] = t
    twin = GPT.skeleton(model.config)
    for name, new in swaps.items():
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent), child, new)
    twin.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, t in list(twin.named_parameters()) + list(twin.named_buffers()) if t.is_meta]
    if missing:
        raise RuntimeError(f"cannot compile this model's step: no plain tensor for {', '.join(missing[:3])}")
    return twin.eval()


def build_package(step: nn.Module, example: tuple, path: Path, store: Path) -> dict[str, list]:
    """Export `step` (a `Step`, or any module: tests) at the example inputs' shapes, compile it with AOTInductor
    into the library `path` and its constants into the shared `store` (`unpack`); returns its manifest."""
    pt2 = path.with_name(path.name + ".pt2")
    norms = _eager_norms() if getattr(step, "exact", False) else contextlib.nullcontext()
    options = dict(CPU_OPTIONS)
    if example[0].size(1) > 1:  # a verification pass: its attention's batched matmuls (several queries a row) have
        # no C++ template; ATen's kernel, called from the step
        options["max_autotune_gemm_backends"] = "CPP,ATEN"
    if any(isinstance(m, Int4Linear) for m in step.modules()):  # aten's int4 kernel is its matmuls' only choice
        options["max_autotune_gemm_backends"] = "CPP,ATEN"  # (`_eager_int4_kernel`); its packed int4 weight is a
        # plain tensor, shared as any other
    with torch.no_grad(), _eager_int4_kernel(), _templates_for_linears(), norms:
        ep = torch.export.export(step, example, strict=True)  # dynamo's tracing: model/linear.py's F.linear branch
        torch._inductor.aoti_compile_and_package(ep, package_path=str(pt2), inductor_configs=options)
    return unpack(pt2, path, store)


ISA_PROBE = "isa-probe"  # the compile cache's folder of inductor's vector-ISA probe builds (`probe_vec_isa`)


def probe_vec_isa(cache_dir: Path) -> None:
    """inductor's check of which vector ISAs this CPU and compiler run (a g++ build and a dlopen per ISA), made once a
    process before loading or compiling (cached in the process), with its builds kept in the compile cache's
    ISA_PROBE folder so that only a machine's first start builds them: inside a compile's scratch inductor cache every
    start built them again, and loading a cached attention package (AOTInductor's `get_device_information`) waited
    11-22 s for them at idle priority beside a serving engine on a 2-vCPU Zen 4 (the step's attention eager
    meanwhile)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    folder = cache_dir / ISA_PROBE
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if not os.access(folder, os.W_OK | os.X_OK):  # a read-only cache: the check builds in the scratch folder as before
        return
    try:
        with temporary_cache_dir(str(folder)):
            valid_vec_isa_list()
    except OSError:  # the folder could not be written after all: nothing was cached, the next call checks again
        return


@contextlib.contextmanager
def scratch_inductor_cache(parent: Path):
    """inductor's cache folder for one compile of the packages, deleted after it: inductor keeps a copy of every
    package's frozen weights there (GPT-2: 15 x 0.63 GB in /tmp/torchinductor_<user> a compile, never read again: the
    packages live in our cache, `unpack`). torch's own context for a temporary inductor cache."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with tempfile.TemporaryDirectory(dir=parent, prefix="inductor-") as d, temporary_cache_dir(d):
        yield


@contextlib.contextmanager
def _eager_int4_kernel():
    """int4 matmuls inside a compiled step through aten's kernel, the eager rows' own, not inductor's WoQ int4
    template (chosen by max_autotune, which offers no switch for it): the template rounds its bf16 arithmetic
    otherwise, GPT-2 124M's logits 0.035 off the eager step's, so a seeded request would draw unlike itself in a
    batch (eager rows); the step's gain is the per-op overhead, not the kernel (docs/performance.md). Patched for
    the compiles of this module only, which hold COMPILE_LOCK: no other compile in the process reads it meanwhile."""
    import torch._inductor.lowering  # noqa: F401 - first: it imports the module below and registers its lowerings
    from torch._inductor import quantized_lowerings

    with mock.patch.object(quantized_lowerings, "use_cpp_gemm_template", lambda *args, **kwargs: False):
        yield


@contextlib.contextmanager
def _templates_for_linears():
    """The step's linears (fp32 / bf16, and int8 where inductor's u8 x s8 GEMM reproduces fbgemm's rounding) through
    inductor's C++ GEMM templates even where the options offer ATen's kernels too (a verification pass's batched
    matmuls, an int4 step's matmuls): ATen's oneDNN linear holds its packed weight as an opaque constant, which a
    package cannot share (a blob of its own: GPT-2's 15 packages once held 0.63 GB each), and its int8 linear rounds
    unlike fbgemm. Autotuning in a background compile beside a serving engine times noise: on a loaded Zen 4 it once
    timed the C++ micro-kernel at 32 ms and chose oneDNN's. ATen's linear stays where no template fits. Patched for
    the compiles of this module only, which hold COMPILE_LOCK (as `_eager_int4_kernel`)."""
    import torch._inductor.lowering  # noqa: F401 - first: it imports the module below and registers its lowerings
    from torch._inductor import mkldnn_lowerings

    with mock.patch.object(mkldnn_lowerings, "use_aten_gemm_kernels", lambda: False):
        yield


# what a quantized step computes through ATen's own kernels, as eager steps do (`_eager_norms`)
EAGER_OPS = (torch.ops.aten.native_layer_norm.default, torch.ops.aten.gelu.default)


@contextlib.contextmanager
def _eager_norms():
    """Layer norms and GELU inside a compiled step through ATen's kernels (inductor's fallback: a call from the
    step's C++ code), not inductor's own loops, for the steps of quantized weights: theirs differ from ATen's by ulps
    (LayerNorm(768) up to 1.9e-6, GELU 2.4e-7), and an int8 activation near a rounding tie turns such an ulp into a
    whole quantization step (docs/performance.md). inductor has no option for it: its decompositions of the two are
    taken out of its table and fallbacks registered in their place, for the compiles of this module only (they
    hold COMPILE_LOCK), and undone after."""
    from torch._inductor import decomposition, lowering

    removed = {op: decomposition.decompositions.pop(op) for op in EAGER_OPS if op in decomposition.decompositions}
    tables = (lowering.lowerings, lowering.fallbacks, lowering.needs_realized_inputs)  # what make_fallback adds to
    had = [{op for op in EAGER_OPS if op in t} for t in tables]
    decomposition.fast_random_decomps.cache_clear()  # the table with the random ops' decompositions, cached
    ir_log = logging.getLogger("torch._inductor.ir")  # a warning per call site: "... is missing a c-shim
    level = ir_log.level  # implementation, using proxy executor as fallback" (what this asks for)
    ir_log.setLevel(logging.ERROR)
    try:
        for op in EAGER_OPS:
            lowering.make_fallback(op, warn=False)
        yield
    finally:
        ir_log.setLevel(level)
        for table, kept in zip(tables, had):
            for op in EAGER_OPS:
                if op not in kept and op in table:  # only what this added: a table that held it before keeps it
                    table.pop(op) if isinstance(table, dict) else table.discard(op)
        decomposition.decompositions.update(removed)
        decomposition.fast_random_decomps.cache_clear()


_CONSTANT = re.compile(r"constants_info_\[(\d+)\]\.(name|dtype|offset|data_size|from_folded|shape|stride|layout)"
                       r" = (.+?);$", re.M)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.strip("{} ").split(",") if v.strip()]


def package_constants(wrapper_cpp: str, blob: bytes) -> dict[str, tuple[bytes, torch.dtype, list, list, int]] | None:
    """A package's frozen constants by name (as its runner names them): their bytes, dtype, shape, stride and
    offset; None if one is opaque (oneDNN's packed weight, where autotuning chose ATen's linear: only the runner
    rebuilds it); ValueError if the blob does not hold what the table says. The blob
    (`package_constants_on_disk_format="binary_blob"`) holds them one after another, in the order of the wrapper's
    `constants_info_` (what the runtime's `load_constants` reads, model_base.h); read from there because the
    runner's own `extract_constants_map` keys them by original fqn, which two packed weights of one matmul share
    (torch 2.13), so one of them would be lost."""
    info: dict[int, dict[str, str]] = {}
    for i, field, value in _CONSTANT.findall(wrapper_cpp):
        info.setdefault(int(i), {})[field] = value
    out, at = {}, 0
    for i in sorted(info):
        c = info[i]
        if c["from_folded"] == "true":
            continue
        if not c["layout"].endswith("cached_torch_layout_strided)"):
            return None
        size = int(c["data_size"])
        dtype = getattr(torch, c["dtype"].removeprefix("cached_torch_dtype_"))
        out[c["name"].strip('"')] = (blob[at:at + size], dtype, _ints(c["shape"]), _ints(c["stride"]),
                                     int(c["offset"]))
        at += size
    if at != len(blob):
        raise ValueError(f"the constants take {at} bytes of a {len(blob)}-byte blob")
    return out


def unpack(pt2: Path, so: Path, store: Path) -> dict[str, list] | None:
    """The package `pt2`'s library as `so` and its constants into `store` (one file per distinct constant, named by
    its sha256: every package of a model freezes the same weights, GPT-2's 15 one-row packages held 657 MB each);
    returns the package's manifest: name → [file, dtype, shape, stride, offset], or None where a constant is opaque
    and the package keeps its own blob (`so` + ".blob"). Removes `pt2`."""
    import zipfile

    with zipfile.ZipFile(pt2) as z:
        names = z.namelist()
        wrapper = z.read(next(n for n in names if n.endswith(".wrapper.cpp"))).decode()
        blobs = [n for n in names if n.endswith(".blob")]
        blob = z.read(blobs[0]) if blobs else b""
        so.write_bytes(z.read(next(n for n in names if n.endswith(".so"))))
        for n in names:  # the calls the library makes back into PyTorch's dispatcher (a quantized step's ATen ops:
            if n.endswith(".wrapper.json"):  # `_eager_norms`), read by its runner's proxy executor from beside it
                so.with_suffix(".json").write_bytes(z.read(n))
    constants = package_constants(wrapper, blob)
    if constants is None:  # an opaque constant: this package keeps its own blob
        log.warning("compiled decode step %s holds an opaque constant (ATen's packed weight): it keeps its own copy "
                    "of the weights (%.0f MB on disk and in memory)", so.stem, len(blob) / 1e6)
        so.with_name(so.name + ".blob").write_bytes(blob)
        pt2.unlink()
        return None
    manifest = {}
    for name, (data, dtype, shape, stride, offset) in constants.items():
        digest = hashlib.sha256(str(dtype).encode() + data).hexdigest()[:32]
        if not (store / digest).exists():
            (store / digest).write_bytes(data)
        manifest[name] = [digest, str(dtype).removeprefix("torch."), shape, stride, offset]
    pt2.unlink()
    return manifest


def load_steps(folder: Path, names: list[str]) -> dict[str, object]:
    """The compiled steps `names` (libraries in `folder`), each given its constants from the folder's shared store
    (`unpack`): each distinct constant memory-mapped once and handed to every step that uses it (AOTInductor's
    user-managed constants: the runner keeps pointers, no copy)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    shared: dict[str, torch.Tensor] = {}
    steps = {}
    for name in names:
        if manifest[name] is None:  # its own blob (`unpack`)
            steps[name] = load_step(folder / name, None)
            continue
        constants = {}
        for const, (digest, dtype, shape, stride, offset) in manifest[name].items():
            dt = getattr(torch, dtype)
            if digest not in shared:
                n = (folder / WEIGHTS / digest).stat().st_size // torch.empty((), dtype=dt).element_size()
                shared[digest] = (torch.from_file(str(folder / WEIGHTS / digest), shared=False, size=n, dtype=dt)
                                  if n else torch.empty(0, dtype=dt))
            constants[const] = shared[digest].as_strided(shape, stride, offset)
        steps[name] = load_step(folder / name, constants)
    return steps


def load_step(path: Path, constants: dict[str, torch.Tensor] | None):
    """A compiled step from its library and its constants: called with `Step`'s inputs, it returns `Step`'s
    outputs. It calls AOTInductor's C++ runner with the flat inputs itself (a package's Python wrapper parses its
    call spec and flattens the arguments with pytree on every call, ~5% of the bundled model's step:
    docs/performance.md). The step keeps `constants` alive: the runner holds pointers into them. None: the
    library's own blob beside it."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
    if constants is None:
        runner.update_constant_buffer_from_blob(str(path.with_name(path.name + ".blob")))
    else:  # (map, use_inactive, validate_full_update, user_managed)
        runner.update_constant_buffer(constants, False, True, True)
    run = runner.run

    def step(*inputs: torch.Tensor):
        out = run(inputs)
        return out[0] if len(out) == 1 else tuple(out)

    step.constants = constants
    return step


class CompiledDecode:
    """Compiled decode steps for batches up to `max_batch` over `cache`, made (or loaded) by `start()` in a thread:
    per (batch, context) bucket one step that returns logits, and with a `sampler`, one per plain kind
    (engine/plain_draw.py) that returns the drawn tokens. `before_compile`: called before compiling (not before
    loading), raises where a compile should not start (engine.compile_gate.check_compile_memory)."""

    def __init__(self, model: GPT, cache: KVCache, max_batch: int, contexts=CONTEXT_BUCKETS,
                 sampler: Sampler | None = None, cache_dir: Path | None = None,
                 before_compile: Callable[[], None] | None = None, verify_most: int = 0) -> None:
        self.model, self.cache, self.max_batch, self.sampler = model, cache, max_batch, sampler
        self.before_compile = before_compile
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.contexts = context_buckets(cache.max_len, contexts)
        self.kinds: tuple[Kind | None, ...] = (None,) + (KINDS if sampler is not None else ())
        # one row's verification passes (speculative decoding: `verify_most` = 1 + the most tokens proposed), each
        # width's. Not for quantized weights: their steps attend as eager ones, one token a row (`Step.exact`)
        quantized = any(isinstance(m, QUANTIZED) for m in model.modules())
        self.verify_widths = () if quantized else verify_widths(verify_most)
        self.cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
        self.tokens = torch.zeros(max_batch, 1, dtype=torch.long, device=cache.device)
        self.verify_idx = {w: torch.zeros(1, w, dtype=torch.long, device=cache.device) for w in self.verify_widths}
        # the draw's inputs when there is no sampler (a logits-only step ignores them)
        self._no_draw = [torch.zeros(max_batch, dtype=dt) for dt in (torch.float32, torch.long, torch.float32,
                                                                      torch.long, torch.long, torch.long)]
        self.steps: dict[tuple[int, int, Kind | tuple | None], object] = {}  # (batch, context, kind)
        self._inputs: dict[tuple[int, int], tuple] = {}
        self.error: str | None = None
        self.seconds: float | None = None
        self.source: str | None = None  # "compiled" or "cache": where the steps came from
        self.folder: Path | None = None  # their packages: the cache folder of their key
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()  # the engine's: inductor sizes its kernels' parallelism by it

    # ------------------------------------------------------------------ compiling
    def start(self) -> None:
        """Compile or load every bucket in a daemon thread; `done` tells when, `error` what failed."""
        self._thread = threading.Thread(target=self._compile_all, name="compile-decode", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def _compile_all(self) -> None:
        torch.set_num_threads(self._threads)  # a new thread starts with every core
        idle_priority()
        with COMPILE_LOCK:
            t0 = time.perf_counter()
            try:
                probe_vec_isa(self.cache_dir)
                self.compile_all()
            except Exception as e:  # noqa: BLE001 - export / inductor raise many kinds; the engine stays eager
                self.error = one_line(e)
                self.steps.clear()
            finally:
                self.seconds = round(time.perf_counter() - t0, 2)
                self._done.set()

    def names(self) -> dict[tuple[int, int, Kind | None], str]:
        names = {(b, ctx, kind): f"b{b}-c{ctx}-{kind or 'logits'}.so"
                 for b in self.buckets for ctx in self.contexts for kind in self.kinds}
        names |= {(1, ctx, (VERIFY, w)): f"b1-c{ctx}-{VERIFY}{w}.so"
                  for w in self.verify_widths for ctx in self.contexts if ctx >= w}
        return names

    def setup(self) -> tuple:
        """What the steps are made for besides the weights, the code, this CPU and torch: the buckets, kinds and
        verification positions, the cache's shape and dtype, the threads (`key`; engine.compile_cache records it
        beside a folder)."""
        c = self.cache
        return (self.buckets, self.contexts, self.kinds, self.verify_widths, c.n_slots, c.max_len,
                tuple(c.k[0].shape), str(c.k[0].dtype), self._threads)

    def key(self, twin: GPT) -> str:
        """What a package depends on: the weights' bytes (the traced twin's), the shapes, this CPU, the threads,
        torch and the code."""
        h = hashlib.sha256()
        for name, t in sorted(twin.state_dict().items()):
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        root = Path(__file__).resolve().parent.parent
        code = b"".join(code_digest((root / f).read_text()) for f in TRACED)
        h.update(repr((self.setup(), self.sampler.vocab_size if self.sampler else None,
                       self.sampler.block if self.sampler else None, sorted(cpu_flags()), torch.__version__,
                       sys.version_info[:2], sorted(CPU_OPTIONS.items()))).encode() + code)
        return h.hexdigest()[:24]

    def compile_all(self) -> None:
        """Load the packages of this key from the cache folder, or export and compile each bucket (against scratch
        tensors: the live cache is never written from here) and save them there."""
        twin = plain_twin(self.model)  # once: a quantized model's twin reads its weights back from fbgemm's copies
        folder = self.folder = self.cache_dir / self.key(twin)
        names = self.names()
        if folder.is_dir() and not all((folder / n).is_file() for n in [*names.values(), MANIFEST]):
            shutil.rmtree(folder, ignore_errors=True)  # not made by this code (a crash cannot leave one half made)
        if folder.is_dir():
            try:
                self._load(folder, names)
                self.source = "cache"
                return
            except Exception as e:  # noqa: BLE001 - a corrupt or foreign package: compile it again
                log.warning("compiled decode steps in %s do not load (%s); compiling them again", folder,
                            one_line(e))
                self.steps.clear()
                shutil.rmtree(folder, ignore_errors=True)
        if self.before_compile is not None:
            self.before_compile()
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryDirectory(dir=self.cache_dir).cleanup()  # writable?
        except OSError as e:  # a read-only home (a container's user): compile for this process only
            log.warning("compile cache %s is not writable (%s); the compiled steps are kept for this process only",
                        self.cache_dir, one_line(e))
            self.cache_dir = Path(tempfile.mkdtemp(prefix="gpt-serve-compiled-"))
            atexit.register(shutil.rmtree, self.cache_dir, True)  # GPT-2's packages: 0.68 GB each start otherwise
            folder = self.folder = self.cache_dir / folder.name
        with tempfile.TemporaryDirectory(dir=self.cache_dir) as tmp, scratch_inductor_cache(self.cache_dir):
            (Path(tmp) / WEIGHTS).mkdir()
            manifest = {}
            for (b, ctx, kind), name in names.items():
                width = _width(kind)
                step = Step(twin, self.cache.max_len, ctx, None if width else kind, *self._vocab_block())
                manifest[name] = build_package(step, self._scratch(b, width), Path(tmp) / name, Path(tmp) / WEIGHTS)
                # what the package froze (its copy of the weights: GPT-2's 0.5 GB), freed, back to the kernel: the
                # engine's heap keeps freed pages (engine.heap.keep_freed_memory), and GPT-2's compile grew
                # ~0.3 GB a package to a 10.3 GB peak resident; given back after each, it peaks at 7.7
                # (docs/performance.md)
                gc.collect()
                release_freed_memory()
            (Path(tmp) / MANIFEST).write_text(json.dumps(manifest))
            try:
                os.replace(tmp, folder)  # whole or not at all: a crash leaves no half folder under the key
                os.mkdir(tmp)  # for TemporaryDirectory's clean-up
            except OSError:  # another server made the same key meanwhile: use that one
                pass
        self._load(folder, names)
        self.source = "compiled"

    def _load(self, folder: Path, names: dict) -> None:
        steps = load_steps(folder, list(names.values()))
        self.steps.update((key, steps[name]) for key, name in names.items())

    def _vocab_block(self) -> tuple[int, int]:
        return (self.sampler.vocab_size, self.sampler.block) if self.sampler else (0, 0)

    def _scratch(self, b: int, width: int = 0) -> tuple:
        """Example inputs of bucket b's shapes (`Step`; a verification pass's tokens: `verify_idx[width]`), zeros
        but for 1/T (> 0, as a slot's always is)."""
        c = self.cache
        draw = self.sampler.plain_inputs(b) if self.sampler else [t[:b] for t in self._no_draw]
        tokens = self.verify_idx[width] if width else self.tokens[:b]
        return (torch.zeros_like(tokens), torch.zeros_like(c.lengths_t[:b]),
                *(t.clone() if t.is_floating_point() else torch.zeros_like(t) for t in draw),
                *(torch.zeros_like(t[:b]) for t in c.k), *(torch.zeros_like(t[:b]) for t in c.v))

    # ------------------------------------------------------------------ replaying
    def inputs(self, b: int, width: int = 0) -> tuple:
        """Bucket b's inputs (`Step`; a verification pass's tokens: `verify_idx[width]`): views of the live cache
        and sampler state, made once (the same every replay: the steps write the cache through them)."""
        if (b, width) not in self._inputs:
            c = self.cache
            draw = self.sampler.plain_inputs(b) if self.sampler else [t[:b] for t in self._no_draw]
            self._inputs[b, width] = (self.verify_idx[width] if width else self.tokens[:b], c.lengths_t[:b], *draw,
                                      *(t[:b] for t in c.k), *(t[:b] for t in c.v))
        return self._inputs[b, width]

    def replay(self, n: int, kind: Kind | None = None):
        """The compiled step over slots 0..n-1 (self.tokens[:n] already written; the cache not advanced): logits,
        or with a plain `kind` the (token, logprob) drawn."""
        b, ctx = step_key(self.cache, n, self.buckets, self.contexts)
        out = self.steps[b, ctx, kind](*self.inputs(b))
        return out[:n] if kind is None else tuple(o[:n] for o in out)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Next-token logits (n, vocab) for slots 0..n-1 fed `tokens` (n,); advances the cache."""
        self.tokens[:n, 0].copy_(tokens)
        out = self.replay(n)
        self.cache.advance(range(n), 1)
        return out

    @torch.inference_mode()
    def draw(self, tokens: torch.Tensor, n: int, kind: Kind) -> tuple[torch.Tensor, ...]:
        """The tokens drawn for slots 0..n-1 fed `tokens` (n,), whose rows are plain of `kind`
        (`Sampler.plain_kind`), with their log-probabilities; advances the cache (the sampler records them)."""
        self.tokens[:n, 0].copy_(tokens)
        out = self.replay(n, kind)
        self.cache.advance(range(n), 1)
        return out

    def verify_room(self, n: int) -> int:
        """The most tokens a compiled verification pass of n rows takes now besides each row's last: one row, the
        widest pass whose positions (its padding's too: one past the cache would be clamped onto a live entry)
        fit the slot, less one; 0 where none does."""
        if n != 1:
            return 0
        return max((w - 1 for w in self.verify_widths if self.cache.lengths[0] + w <= self.cache.max_len), default=0)

    def fill(self, k: int) -> int:
        """The tokens a proposal of k may grow to at no extra cost: the narrowest pass that verifies k takes its
        width less one (a pass of 3 positions verifies 1 proposed token or 2 at the same price)."""
        return next((w - 1 for w in self.verify_widths if w > k), k)

    @torch.inference_mode()
    def verify(self, idx: torch.Tensor) -> torch.Tensor:
        """The logits (1, T, vocab) of slot 0 fed idx (1, T: its last token and a proposal of at most
        `verify_room(1)` tokens) at its next T positions, as `GPT.forward_cached(..., all_logits=True)` gives them,
        through the narrowest compiled pass that holds them (padded); advances the cache by T (the caller truncates
        it to what it accepts)."""
        T, length = idx.size(1), self.cache.lengths[0]
        width = next(w for w in self.verify_widths if w >= T)
        ctx = next(c for c in self.contexts if c >= length + width)
        tokens = self.verify_idx[width]
        tokens[:, :T] = idx
        tokens[:, T:] = 0
        out = self.steps[1, ctx, (VERIFY, width)](*self.inputs(1, width))
        self.cache.advance(range(1), T)
        return out[:, :T]

    @torch.inference_mode()
    def check(self, atol: float = 1e-3) -> bool:
        """Each compiled bucket equals the eager step on the live cache (written at each row's next position, which
        the row's next step overwrites, as a CUDA graph's padding rows do; the cache is not advanced): the same
        logits (a verification pass's: of every position), and for a draw the same tokens as plain_draw on the
        eager logits."""
        for (b, ctx, kind), fn in self.steps.items():
            args = self.inputs(b, _width(kind))
            eager = Step(self.model, self.cache.max_len, ctx, None, *self._vocab_block())(*args)
            got = fn(*args)
            if kind is None or _width(kind):
                same = torch.allclose(got.float(), eager.float(), atol=atol, rtol=1e-2)
            else:
                inv_temp, top_k, top_p, seed_key, length, prompt_len = args[2:8]
                token, logprob, *_ = plain_draw(eager, *self._vocab_block(), kind, inv_temp, top_k, top_p, seed_key,
                                                length - prompt_len)
                same = torch.equal(got[0], token) and torch.allclose(got[1], logprob, atol=atol, rtol=1e-2)
            if not same:
                return False
        return bool(self.steps)
