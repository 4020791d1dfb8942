"""Shared benchmark helpers: machine/run metadata, the random GPT-2 124M fixture, memory bandwidth, JSON output.

Timings on a shared machine are noisy, so every benchmark measures ours and the peer
interleaved in the same process, repeats, and reports medians and ratios; each result
file records the load average before and after the run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SHARED_TIKTOKEN = REPO.parent / "shared" / "tiktoken"
if SHARED_TIKTOKEN.is_dir():  # GPT-2's ranks offline on the team's machines; users' machines download them
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_TIKTOKEN))
# fixtures (the random GPT-2 in HF and in our format) are built once and reused
CACHE = Path(os.environ.get("BENCH_CACHE", Path.home() / ".cache" / "gpt-serve-bench"))


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--", "model"))}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mem_total_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def command_line() -> str:
    import __main__

    spec = getattr(__main__, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return " ".join(head + sys.argv[1:])


def scheduling() -> dict[str, Any]:
    """This process's scheduling policy and nice value (a run under `chrt`/`nice` says so)."""
    names = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_FIFO", "SCHED_RR", "SCHED_BATCH", "SCHED_IDLE")
             if hasattr(os, n)}
    try:
        return {"policy": names.get(os.sched_getscheduler(0), "?"), "nice": os.nice(0)}
    except (AttributeError, OSError):
        return {}


def env_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "mem_gb": mem_total_gb(),
                    "platform": platform.platform()},
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "contention_probe": contention_probe(),
        "scheduling": scheduling(),
        "command": command_line(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def contention_probe(threads: int | None = None) -> dict[str, float]:
    """p50 time of one small parallel op (sum of 4M floats) with 1 thread and with `threads`.

    On an idle machine the multi-thread one is faster; when other processes keep the cores busy,
    each OpenMP region waits for a descheduled thread and it becomes many times slower. A ratio
    well above 1 marks a run whose multi-thread timings say more about the neighbours than about us.
    """
    import torch

    threads = threads or torch.get_num_threads()
    before = torch.get_num_threads()
    a = torch.randn(4_000_000)
    out = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        ts = []
        for _ in range(60):
            t = time.perf_counter()
            a.sum()
            ts.append(time.perf_counter() - t)
        out[f"sum_us_{n}_threads"] = round(1e6 * median(ts), 1)
    torch.set_num_threads(before)
    out["slowdown"] = round(out[f"sum_us_{threads}_threads"] / out["sum_us_1_threads"], 2)
    return out


def warn_contention(info: dict[str, Any]) -> None:
    probe = info.get("contention_probe") or {}
    if probe.get("slowdown", 0) > 3:
        print(f"warning: other processes are keeping the cores busy (a parallel op is {probe['slowdown']}x slower "
              f"with {info['torch_threads']} threads than with 1; load {info['loadavg_start'][0]}): multi-thread "
              "timings will say more about them than about us; consider --threads 1", file=sys.stderr)


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write bench/results/<name>.json atomically (with the load average at the end of the run)."""
    data = {**data, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def set_threads(n: int | None) -> int:
    import torch

    n = n or min(2, os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n


def random_gpt2(seed: int = 0, cache: Path = CACHE) -> tuple[Path, Path]:
    """A randomly initialised GPT-2 124M (transformers' GPT2Config() defaults), saved with save_pretrained
    and imported with model.convert_hf. Returns (hf_dir, our_checkpoint_dir); built once, then reused."""
    hf_dir, ck_dir = cache / f"gpt2-random-s{seed}-hf", cache / f"gpt2-random-s{seed}"
    if not (hf_dir / "config.json").is_file():
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(seed)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(hf_dir)
    if not (ck_dir / "config.json").is_file():
        from model.convert_hf import convert

        convert(hf_dir, ck_dir)
    return hf_dir, ck_dir


def memory_bandwidth(gb: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """Read bandwidth (GB/s, best of `repeats`) of summing a `gb`-GB fp32 tensor — what streaming weights costs —
    and of copying one (bytes read + written). Best-of, because other load only ever makes it slower."""
    import torch

    n = int(gb * 1e9) // 4
    a = torch.ones(n)
    b = torch.empty_like(a)
    read, copy = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        read.append(n * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        b.copy_(a)
        copy.append(2 * n * 4 / (time.perf_counter() - t) / 1e9)
    del a, b
    return {"read_gbps": round(max(read), 2), "copy_gbps": round(max(copy), 2),
            "read_gbps_median": round(median(read), 2), "bytes": n * 4}


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[h for h in headers]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
