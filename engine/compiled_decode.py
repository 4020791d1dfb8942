"""Decode steps compiled by inductor on a CPU: the small-batch step without PyTorch's per-op cost.

The CPU counterpart of engine/cuda_graphs.py, and the same machinery: `GraphedDecode` holds the static buffers
and one replay per (batch, context) bucket of `GPT.decode_static`; here a bucket's "capture" is
`torch.compile(..., fullgraph=True, dynamic=False)` with inductor's CPU options (as SGLang's
`cpu_graph_runner.py` compiles a step per batch size). `max_autotune` with inductor's C++ GEMM templates is what
pays: one-row matmuls from generated micro-kernels instead of MKL / oneDNN calls (docs/performance.md, "A compiled
decode step"); without it the compiled step was no faster than eager.

Only batches up to `max_batch` are compiled (each bucket costs a compile at start-up; batch 1 is where a token's
fixed cost shows, larger batches are matmul-bound and stay eager), and the graph reads the model's plain weights:
oneDNN's packed copies (`model.linear.PackedLinear`) are opaque to dynamo, so a server that compiles keeps the
plain nn.Linear layers (`EngineCore(compile=...)` skips the prepack; inductor's freezing packs its own constants).
A compile that fails, or a replay that differs from eager decoding, leaves the engine eager with one log line.
Compiled kernels are cached on disk by inductor (`TORCHINDUCTOR_CACHE_DIR`), so a restart on the same machine
skips the autotuning.
"""

from __future__ import annotations

from engine.cuda_graphs import Replay

MODES = ("off", "on")
# inductor's options for the CPU step (torch/_inductor/config.py): weights as constants (freezing: packed once),
# max_autotune choosing between aten's GEMM and inductor's C++ micro-kernel per shape
CPU_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
DEFAULT_MAX_BATCH = 1


class CompileError(RuntimeError):
    """The step could not be compiled here (no C++ compiler, an op inductor cannot lower, ...)."""


def inductor_capture(step: Replay) -> Replay:
    """Compile `step` (a function of nothing over static buffers) and run it twice, as the CUDA capture's warm-up
    does: the first call compiles, the second checks that no guard fails and recompiles."""
    import torch._inductor.config

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    try:
        with torch._inductor.config.patch(CPU_OPTIONS):  # freezing is read outside torch.compile's options
            compiled()
            compiled()
    except Exception as e:  # noqa: BLE001 - dynamo / inductor raise many kinds; the caller decodes eagerly
        raise CompileError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    def replay() -> torch.Tensor:
        # the step reads the same buffers with the same shapes every time (GraphedDecode's static buffers), so its
        # guards cannot fail: evaluating them cost ~0.2 ms a token (vLLM drops them on its compiled CPU path too)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled()

    return replay
