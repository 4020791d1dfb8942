"""`scripts/gpu-check.sh`: the first run of an offline GPU machine, in one command, under a time budget.

    scripts/gpu-check.sh [--device cuda|cpu] [--budget-s 480] [--out DIR] [--only stage,stage]

Runs with the image's own python3 and torch (2.11 there), installs only the wheels carried in `.gpu-carry/`
(filled here by scripts/gpu-carry.sh), downloads nothing: the weights are random and made here, GPT-2's ranks come
from `.gpu-carry/tiktoken`. Each stage is timed; one that would not fit in what is left of the budget is skipped
with the reason, one that fails is reported in one line and the next stages still run (a stage that needs a
failed one is skipped), so a short GPU lease gives every answer it can. One JSON report (`gpu-check.json`) and
the server's log go to --out (the device tool's $OUT), then a one-screen summary; exit 1 when a stage failed.

`--device cpu` is the dry run: the same stages end to end on a small model (tests/test_gpu_offline.py), so the
first GPU minute is never spent on a Python error. What it measures on a CPU says nothing about a GPU.

Stages: wheels, imports, device, checkpoint, engine (tok/s batch 1 and 64 with graphs on and off, TTFT of a
512-token prompt, int8 (dequantized and torch's kernel) / int4 / fp16 / fp32 against bf16, a KV cache in another
dtype, and the invariances docs/api.md promises: seeded alone = batched, speculation on = off, graphs on = off),
serve (python -m app: /generate, /generate_stream, concurrent streams, sampling parameters, structured output, a
prefix-cache hit, a seeded request alone and among concurrent streams), train (a few steps, tokens/s, --resume),
finetune (classification), classify (/classify on its checkpoint), tests (the CUDA tests).
Not covered yet: chat fine-tuning, training tokens/s against another implementation (nanoGPT's model.py is not
carried), CUDA graphs with a prefix-cache hit through the engine alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / ".gpu-carry"
PACKAGES = ("model", "engine", "app", "training", "bench")
# third-party modules only extras or peers need: a module that imports one is skipped with the reason, not failed
OPTIONAL = {"matplotlib", "tensorboard", "gguf", "playwright", "schemathesis", "lm_eval", "openai", "aiohttp",
            "text_generation", "jsonschema", "huggingface_hub", "vllm", "llama_cpp", "xgrammar", "outlines_core",
            "psutil", "datasets", "sklearn", "torch.utils.tensorboard"}

# modules that start something when imported: left to the stages that run them
PROGRAMS = {"app.main": "starts the engine core on import (uvicorn app.main:app): the serve stage runs the server"}


class Skip(Exception):
    """A stage (or a part of one) that cannot run here, with the reason."""


class PartsFailed(Exception):
    """Some parts of a stage failed: the stage fails, with what the others measured kept in the report."""

    def __init__(self, result: dict) -> None:
        super().__init__("; ".join(result["errors"])[:400])
        self.result = result


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Stage:
    name: str
    needs_s: float  # about what it takes on an H100: skipped when less of the budget is left
    run: Callable[[], dict]
    after: tuple[str, ...] = ()  # stages whose failure or skip makes this one pointless


@dataclass
class Budget:
    total_s: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)


def run_stages(stages: list[Stage], budget: Budget, report: dict) -> list[str]:
    """Each stage into report["stages"][name] = {status: ok | failed | skipped, seconds, ...}; the failures' lines."""
    out = report.setdefault("stages", {})
    failures = []
    names = {st.name for st in stages}  # a stage left out (--only) blocks nothing
    for st in stages:
        blocked = [a for a in st.after if a in names and out.get(a, {}).get("status") != "ok"]
        left = budget.left()
        if blocked:
            out[st.name] = {"status": "skipped", "reason": f"needs {', '.join(blocked)}, which did not pass"}
            continue
        if left < st.needs_s:
            out[st.name] = {"status": "skipped",
                            "reason": f"{max(left, 0):.0f} s of the budget left; it needs about {st.needs_s:.0f} s"}
            continue
        t0 = time.monotonic()
        try:
            result = st.run() or {}
            entry = {"status": "ok", **result}
        except Skip as e:
            entry = {"status": "skipped", "reason": str(e)}
        except PartsFailed as e:  # what the other parts measured stays in the report
            entry = {"status": "failed", **e.result, "error": one_line(str(e))}
            failures.append(f"{st.name}: {entry['error']}")
        except Exception as e:  # noqa: BLE001 -- any failure is the stage's, said in one line; the next ones run
            line = one_line(f"{type(e).__name__}: {e}")
            entry = {"status": "failed", "error": line, "where": traceback.format_exc(limit=-3).splitlines()[-6:]}
            failures.append(f"{st.name}: {line}")
        entry["seconds"] = round(time.monotonic() - t0, 2)
        out[st.name] = entry
        print(f"  {st.name:<11} {entry['status']:<7} {entry['seconds']:7.1f} s  "
              f"{one_line(entry.get('error') or entry.get('reason') or entry.get('note', ''), 90)}", flush=True)
    return failures


# ---------------------------------------------------------------------------------------------- wheels
def carried_dists() -> list[str]:
    req = CARRY / "requirements.txt"
    return [line.strip() for line in req.read_text().splitlines() if line.strip()] if req.is_file() else []


def wheels_stage(run_pip: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> dict:
    """Install the carried wheels into .gpu-carry/site (no index, no dependencies resolved: exactly the files
    scripts/gpu-carry.sh chose) and put it first on the path of this process and its children. On another Python
    than 3.12 (the dry run) they are installed for 3.12 into a scratch folder: the files are checked, not used."""
    wheels = sorted((CARRY / "wheels").glob("*.whl"))
    if not wheels:
        raise Skip(f"no carried wheels in {CARRY / 'wheels'} (scripts/gpu-carry.sh fills it); this python's own "
                   "packages are used")
    here = sys.version_info[:2] == (3, 12)
    target = CARRY / "site" if here else Path(tempfile.mkdtemp(prefix="gpu-carry-check-"))
    stamp = target / ".installed"
    pins = "\n".join(carried_dists())
    try:
        if here and stamp.is_file() and stamp.read_text() == pins:
            note = "already installed"
        else:
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
                   "--disable-pip-version-check", "--target", str(target)]
            if not here:
                cmd += ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12"] + [
                    x for p in ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                "manylinux2014_x86_64", "any") for x in ("--platform", p)]
            proc = run_pip(cmd + [str(w) for w in wheels], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"pip could not install the carried wheels: {one_line(proc.stderr, 300)}")
            target.mkdir(parents=True, exist_ok=True)
            stamp.write_text(pins)
            note = f"installed {len(wheels)} wheels"
    finally:
        if not here:  # the files were checked (or pip refused them): the scratch install is not used
            shutil.rmtree(target, ignore_errors=True)
    if here:
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(target), str(REPO), os.environ.get("PYTHONPATH", "")])
        importlib.invalidate_caches()
    else:
        note += (f" for Python 3.12 into a scratch folder (checked, not used: this is Python "
                 f"{platform.python_version()})")
    return {"note": note, "wheels": [w.name for w in wheels], "target": str(target) if here else None}


# ---------------------------------------------------------------------------------------------- imports
def api_guards() -> dict[str, bool]:
    """The torch APIs newer than the oldest torch pyproject.toml allows, as the code tests for them."""
    import torch

    return {"torch.AcceleratorError": hasattr(torch, "AcceleratorError"),
            "torch.ops.aten._weight_int8pack_mm": hasattr(torch.ops.aten, "_weight_int8pack_mm"),
            "torch.ops.aten._weight_int4pack_mm": hasattr(torch.ops.aten, "_weight_int4pack_mm"),
            "torch.ops.aten._convert_weight_to_int4pack_for_cpu":
                hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"),
            "torch.ops.mkldnn._linear_pointwise": hasattr(torch.ops.mkldnn, "_linear_pointwise")}


def imports_stage() -> dict:
    """Import every module of the project; one that needs an optional package is skipped with the reason."""
    ok, skipped, failed = [], {}, {}
    for pkg in PACKAGES:
        names = [pkg] + [m.name for m in pkgutil.walk_packages([str(REPO / pkg)], prefix=f"{pkg}.")]
        for name in names:
            if name.endswith("__main__") or name in PROGRAMS:
                skipped[name] = PROGRAMS.get(name, "a program's entry point (runs on import)")
                continue
            try:
                importlib.import_module(name)
                ok.append(name)
            except ImportError as e:
                missing = getattr(e, "name", None) or ""
                if missing.split(".")[0] in OPTIONAL or missing in OPTIONAL:
                    skipped[name] = f"needs the optional package {missing!r}"
                else:
                    failed[name] = one_line(f"{type(e).__name__}: {e}", 200)
            except Exception as e:  # noqa: BLE001
                failed[name] = one_line(f"{type(e).__name__}: {e}", 200)
    result = {"imported": len(ok), "skipped": skipped, "failed": failed, "torch_apis": api_guards(),
              "note": f"{len(ok)} modules, {len(skipped)} skipped, {len(failed)} failed"}
    if failed:
        raise RuntimeError(f"{len(failed)} modules fail to import: " + "; ".join(f"{k}: {v}" for k, v in
                                                                                    list(failed.items())[:3]))
    return result


# ---------------------------------------------------------------------------------------------- device
def device_stage(device: str) -> dict:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "python": platform.python_version(), "glibc": "-".join(platform.libc_ver())}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA device")
        free, total = torch.cuda.mem_get_info()
        info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    memory_gb=round(total / 2**30, 1), free_gb=round(free / 2**30, 1),
                    bf16=torch.cuda.is_bf16_supported())
        info["note"] = f"{info['gpu']}, torch {info['torch']}, CUDA {info['cuda_build']}"
    else:
        info["note"] = f"CPU dry run, torch {info['torch']}"
    return info


# ---------------------------------------------------------------------------------------------- checkpoint
@dataclass(frozen=True)
class Sizes:
    """What each stage runs: GPT-2 124M on a GPU; a small model of GPT-2's vocabulary for the CPU dry run."""
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batches: tuple[int, ...]
    new_tokens: int
    long_prompt: int
    streams: int
    train_steps: int


GPU_SIZES = Sizes(12, 12, 768, 1024, (1, 64), 64, 512, 32, 20)
CPU_SIZES = Sizes(2, 2, 64, 256, (1, 4), 8, 64, 4, 3)


def checkpoint_stage(work: Path, sizes: Sizes, ck: dict) -> dict:
    """A random GPT of GPT-2's tokenizer (the carried ranks), made with our model and saved as a checkpoint.
    Without the ranks (a fresh clone offline) a byte-level tokenizer made here: the stages run, the figures are not
    GPT-2 124M's (its vocabulary, 257 rows instead of 50257, makes the head far cheaper)."""
    import base64

    import torch

    from model.checkpoint import save_checkpoint
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.tokenizer import Tokenizer, TokenizerError

    ranks = None
    try:
        tok = Tokenizer.named("gpt2")
        which = "GPT-2's tokenizer"
    except TokenizerError as e:
        ranks = work / "bytes.tiktoken"
        ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
        tok = Tokenizer.from_ranks_file(ranks)
        which = f"a byte-level tokenizer (GPT-2's ranks not found: {one_line(e, 120)})"
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=sizes.block_size, n_layer=sizes.n_layer,
                    n_head=sizes.n_head, n_embd=sizes.n_embd)
    model = GPT(cfg)
    ck["path"] = save_checkpoint(work / "random-gpt", model, tok, {"note": "gpu-check: random weights"},
                                 tokenizer_file=ranks)
    return {"params_m": round(model.num_params() / 1e6, 1), "path": str(ck["path"]), "tokenizer": which,
            "note": f"{model.num_params() / 1e6:.1f}M parameters, {which}"}


# ---------------------------------------------------------------------------------------------- engine
PROMPT = "The service had been running for three days when the first request arrived, and nobody"


def engine_run(ck_dir: Path, device: str, *, dtype: str = "bf16", batch: int = 1, new_tokens: int = 32,
               graphs: bool = False, quantize: str = "none", kv_dtype: str | None = None, spec: str = "off",
               prompt_tokens: int | None = None, seeds: list[int] | None = None, temperature: float = 0.0,
               rounds: int = 2) -> dict:
    """One EngineCore on the device: `batch` requests of one prompt, `rounds` times (the first warms up); decode
    tok/s and TTFT of the last round, and each request's tokens."""
    import torch

    from engine.core import EngineCore
    from engine.params import SamplingParams
    from engine.request import EngineRequest
    from engine.spec_decode.config import parse_speculative
    from model.checkpoint import load_checkpoint

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    ck = load_checkpoint(ck_dir, device=device, dtype=dt[dtype])
    core = EngineCore(ck.model, n_slots=max(batch, 1), vocab_size=ck.tokenizer.vocab_size, eos_id=None,
                      cuda_graphs=graphs if device == "cuda" else None, quantize=quantize,
                      kv_dtype=dt[kv_dtype] if kv_dtype else None,
                      speculative=parse_speculative(spec) if spec != "off" else None)
    core.warmup()
    if core.warmup_error:
        raise RuntimeError(core.warmup_error)
    if graphs and device == "cuda" and not core.stats()["cuda_graphs"]:
        raise RuntimeError(f"CUDA graphs were not captured at batch {batch} (see the log)")
    prompt = ck.tokenizer.encode(PROMPT)
    if prompt_tokens:
        prompt = (prompt * (prompt_tokens // len(prompt) + 1))[:prompt_tokens]
    seeds = seeds or list(range(batch))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    tokens: dict[int, list[int]] = {}
    for r in range(rounds):
        for i in range(batch):
            params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature)
            core.add(EngineRequest(f"{r}-{i}", prompt, params, seed=seeds[i % len(seeds)], top_n=0))
        sync()
        t0 = time.perf_counter()
        first = None
        n = 0
        while core.has_work():
            outs = core.step()
            for o in outs:
                if o.error is not None:
                    raise RuntimeError(f"request {o.request_id} failed: {o.message}")
                n += len(o.token_ids)
                if r == rounds - 1:
                    tokens.setdefault(int(o.request_id.split("-")[1]), []).extend(o.token_ids)
            if first is None and outs:
                sync()
                first = time.perf_counter() - t0
        sync()
        wall = time.perf_counter() - t0
    stats = core.stats()
    del core, ck
    if device == "cuda":
        torch.cuda.empty_cache()
    first = first or 0.0
    after_first = max(wall - first, 1e-9)  # decode alone: the tokens after each request's first, prefill excluded
    return {"tok_s": round(n / wall, 1), "decode_tok_s": round(max(n - batch, 0) / after_first, 1),
            "ttft_ms": round(1000 * first, 2), "wall_s": round(wall, 3),
            "tokens": [tokens[i] for i in sorted(tokens)], "weights": stats["weights"],
            "kv_dtype": stats["kv_dtype"], "cuda_graphs": stats["cuda_graphs"], "speculative": stats["speculative"]}


def with_env(name: str, value: str, fn: Callable[[], Any]) -> Any:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def same_tokens(a: list[int], b: list[int]) -> dict:
    """Measured, not asserted: equal, or where the two first part."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if at is None and len(a) != len(b):
        at = min(len(a), len(b))
    return {"equal": at is None, "first_difference": at, "tokens": len(a)}


def engine_stage(ck_dir: Path, device: str, sizes: Sizes, budget: Budget, reserve_s: float) -> dict:
    """The figures and the invariances, each measured in its own try (one failure does not hide the rest); the
    parts stop when only `reserve_s` of the budget is left for the stages after this one."""
    dtype = "bf16" if device == "cuda" else "fp32"
    graphs = device == "cuda"
    nt = sizes.new_tokens
    parts: dict[str, Any] = {}
    errors: list[str] = []

    def part(name: str, fn: Callable[[], Any]) -> None:
        if budget.left() < reserve_s:
            parts[name] = {"skipped": f"budget: {budget.left():.0f} s left, kept for the stages after"}
            return
        try:
            parts[name] = fn()
        except Exception as e:  # noqa: BLE001 -- reported, and the next part runs
            parts[name] = {"error": one_line(f"{type(e).__name__}: {e}")}
            errors.append(f"{name}: {parts[name]['error']}")

    def figures(**kw) -> dict:
        r = engine_run(ck_dir, device, dtype=kw.pop("dtype", dtype), new_tokens=nt, **kw)
        r.pop("tokens")
        return r

    for b in sizes.batches:
        part(f"decode_b{b}_graphs_on", lambda b=b: figures(batch=b, graphs=graphs))
        part(f"decode_b{b}_graphs_off", lambda b=b: figures(batch=b, graphs=False))
    part(f"ttft_{sizes.long_prompt}_token_prompt", lambda: figures(batch=1, graphs=graphs,
                                                                    prompt_tokens=sizes.long_prompt))
    for fmt in ("int8", "int4"):
        part(f"decode_b1_{fmt}", lambda fmt=fmt: figures(batch=1, graphs=graphs, quantize=fmt))
    if device == "cuda":  # torch's int8 kernel against the dequantized copy served by default (model/linear.py)
        for b in sizes.batches:
            part(f"decode_b{b}_int8_kernel", lambda b=b: with_env("GPT_INT8_KERNEL", "1",
                                                                    lambda: figures(batch=b, graphs=graphs,
                                                                                    quantize="int8")))
    for other in ("fp16", "fp32"):
        part(f"decode_b1_{other}", lambda other=other: figures(batch=1, graphs=graphs, dtype=other))
    kv_other = "fp16" if dtype != "fp16" else "bf16"
    part(f"decode_b1_kv_{kv_other}", lambda: figures(batch=1, graphs=graphs, kv_dtype=kv_other))

    # the invariances docs/api.md promises, seeded sampling (temperature 1), as measured
    big = max(sizes.batches)

    def alone_vs_batched() -> dict:
        alone = engine_run(ck_dir, device, dtype=dtype, batch=1, new_tokens=nt, graphs=graphs, seeds=[7],
                           temperature=1.0, rounds=1)["tokens"][0]
        batched = engine_run(ck_dir, device, dtype=dtype, batch=big, new_tokens=nt, graphs=graphs,
                             seeds=[7] + list(range(100, 100 + big)), temperature=1.0, rounds=1)["tokens"][0]
        return {"batch": big, **same_tokens(alone, batched)}

    def toggled(**on) -> Callable[[], dict]:
        def run() -> dict:
            kw = dict(dtype=dtype, batch=4, new_tokens=nt, seeds=[1, 2, 3, 4], temperature=1.0, rounds=1)
            a = engine_run(ck_dir, device, **{**kw, "graphs": graphs, **on})["tokens"]
            b = engine_run(ck_dir, device, **{**kw, "graphs": graphs})["tokens"]
            cmp = [same_tokens(x, y) for x, y in zip(a, b)]
            return {"requests": len(cmp), "equal": sum(c["equal"] for c in cmp),
                    "first_differences": [c["first_difference"] for c in cmp]}
        return run

    part("seeded_alone_vs_batched", alone_vs_batched)
    part("speculation_on_vs_off", toggled(spec="ngram"))
    if graphs:
        part("graphs_on_vs_off", lambda: toggled(graphs=False)())
    result = {"dtype": dtype, "parts": parts, "note": f"{len(parts)} parts, {len(errors)} failed"}
    if errors:
        result["errors"] = errors
        raise PartsFailed(result)
    return result


# ---------------------------------------------------------------------------------------------- serve
@contextlib.contextmanager
def server(ck_dir: Path, device: str, log_path: Path, timeout: float, *flags: str):
    """python -m app on the device, its log in `log_path`, until /health is 200: yields (url, seconds to ready)."""
    import httpx

    from bench.harness import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app", "--checkpoint", str(ck_dir), "--host", "127.0.0.1",
                                 "--port", str(port), "--device", device, *flags],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"python -m app exited with {proc.returncode}: "
                                   f"{one_line(log_path.read_text()[-300:])}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"python -m app not ready after {timeout:.0f} s (see {log_path.name})")
            time.sleep(0.5)
        yield url, round(time.monotonic() - t0, 1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_stage(ck_dir: Path, device: str, sizes: Sizes, out: Path, timeout: float) -> dict:
    """python -m app on the device with its defaults, its log in `out`: the routes and features one client sees."""
    import concurrent.futures

    import httpx

    log_path = out / "server.log"
    results: dict[str, Any] = {"log": log_path.name}
    with server(ck_dir, device, log_path, timeout, "--max-batch-size", "64") as (url, ready_s):
        results["ready_s"] = ready_s
        info = httpx.get(url + "/info", timeout=10).json()
        results.update(device=info.get("device"), dtype=info.get("dtype"),
                       cuda_graphs=(info.get("engine") or {}).get("cuda_graphs"))
        if device == "cuda" and info.get("model_device_type") != "cuda":
            raise RuntimeError(f"the server runs on {info.get('device')!r}, not the GPU")
        problems: list[str] = []

        def gen(params: dict, inputs: str = "The first request") -> dict:
            r = httpx.post(url + "/generate", json={"inputs": inputs, "parameters": params}, timeout=120)
            if r.status_code != 200:
                raise RuntimeError(f"/generate {params} answered {r.status_code}: {r.text[:200]}")
            return r.json()

        n = sizes.new_tokens
        results["generate"] = gen({"max_new_tokens": n, "temperature": 0})["generated_text"][:60]
        with httpx.stream("POST", url + "/generate_stream", json={"inputs": "A streamed request", "parameters": {
                "max_new_tokens": n, "temperature": 0}}, timeout=120) as s:
            events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
        results["stream_events"] = len(events)
        if len(events) != n:
            problems.append(f"/generate_stream gave {len(events)} events, not {n}")
        sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 5,
                    "max_new_tokens": n, "details": True}
        results["sampling_tokens"] = gen(sampling)["details"]["generated_tokens"]
        alone = gen({**sampling, "seed": 11}, "Seeded")["generated_text"]

        def stream(i: int) -> tuple[int, str]:
            body = {"inputs": "Seeded" if i == 0 else f"Request {i}",
                    "parameters": {**sampling, "seed": 11 if i == 0 else i}}
            with httpx.stream("POST", url + "/generate_stream", json=body, timeout=300) as s:
                ev = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
            return len(ev), (ev[-1].get("generated_text") or "") if ev else ""

        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(sizes.streams) as pool:
            got = list(pool.map(stream, range(sizes.streams)))
        wall = time.perf_counter() - t1
        results["concurrent_streams"] = {"streams": sizes.streams, "events": sum(e for e, _ in got),
                                         "tok_s": round(sum(e for e, _ in got) / wall, 1)}
        results["seeded_alone_vs_concurrent_http"] = {"equal": got[0][1] == alone}
        schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        r = gen({"max_new_tokens": 40, "temperature": 0.7, "seed": 1, "grammar": {"type": "json", "value": schema}})
        try:
            json.loads(r["generated_text"])
            results["structured_output"] = "valid JSON"
        except ValueError:
            results["structured_output"] = f"not JSON within 40 tokens: {r['generated_text'][:60]!r}"
        long = "Shared system prompt. " * 6  # a few 16-token blocks with GPT-2 ranks; 132 bytes fit 256
        gen({"max_new_tokens": 4, "temperature": 0}, long + "first")
        before = httpx.get(url + "/info", timeout=10).json().get("engine", {}).get("prefix_hit_tokens", 0)
        gen({"max_new_tokens": 4, "temperature": 0}, long + "second")
        after = httpx.get(url + "/info", timeout=10).json().get("engine", {}).get("prefix_hit_tokens", 0)
        results["prefix_cache_hit_tokens"] = (after or 0) - (before or 0)
        results["live"] = httpx.get(url + "/live", timeout=10).status_code
        if problems:
            raise RuntimeError("; ".join(problems))
        results["note"] = (f"ready in {results['ready_s']} s, {sizes.streams} streams "
                           f"{results['concurrent_streams']['tok_s']} tok/s")
        return results


def classify_stage(ck_dir: Path, device: str, out: Path, timeout: float) -> dict:
    """/classify on the finetune stage's checkpoint (a task head), served on the device."""
    import httpx

    with server(ck_dir, device, out / "server-classify.log", timeout) as (url, ready_s):
        r = httpx.post(url + "/classify", json={"inputs": ["quiet green apple", "river stone paper"]}, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"/classify answered {r.status_code}: {r.text[:200]}")
        return {"ready_s": ready_s, "answer": r.json(), "note": f"ready in {ready_s} s, /classify 200"}


# ---------------------------------------------------------------------------------------------- train, tests
def train_stage(work: Path, device: str, sizes: Sizes) -> dict:
    from bench.gpu_check import CheckFailed, cli, last_event, train_check

    r = train_check(work, steps=sizes.train_steps, device=device)
    # --resume continues OUT/last exactly (optimizer, RNGs): two more steps
    out, more = work / "train", sizes.train_steps + 2
    cli("training.train", "--quiet", "--data", str(work / "prepared"), "--out", str(out), "--resume",
        "--set", f"max_iters={more}", "--set", f"eval_interval={more}")
    start, last = last_event(out, "start"), last_event(out, "train")
    if not start.get("resumed") or last.get("step") != more:
        raise CheckFailed(f"--resume: start event {start}, last step {last.get('step')}, expected {more}")
    r.update(resumed_to_step=more, note=f"{r['steps']} steps, loss {r['loss']:.3f}, "
                                         f"{r['tokens_per_s']} tokens/s; resumed to step {more}")
    return r


def finetune_stage(work: Path, device: str, base: Path) -> dict:
    from bench.gpu_check import finetune_check

    r = finetune_check(work, base, device=device)
    r["note"] = f"val_acc {r['val_acc']}"
    return r


def tests_stage(device: str, timeout: float) -> dict:
    if device != "cuda":
        raise Skip("dry run: the CPU suite runs in CI (make test)")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-k",
                           "cuda or graph or device", "tests/"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:]
    if proc.returncode != 0:
        raise RuntimeError(f"the CUDA tests failed: {last}")
    return {"note": last}


# ---------------------------------------------------------------------------------------------- main
def summary(report: dict) -> str:
    lines = [f"gpu-check ({report['device']}): "
             f"{'PASSED' if not report['failures'] else 'FAILED'} in {report['seconds']:.0f} s of "
             f"{report['budget_s']:.0f} s"]
    for name, st in report["stages"].items():
        what = st.get("error") or st.get("reason") or st.get("note", "")
        lines.append(f"  {name:<11} {st['status']:<7} {st.get('seconds', 0):6.1f} s  {one_line(what, 100)}")
    parts = (report["stages"].get("engine") or {}).get("parts") or {}
    for name, p in parts.items():
        if "tok_s" in p:
            lines.append(f"    {name:<28} {p['decode_tok_s']:>9} decode tok/s  TTFT {p['ttft_ms']} ms")
        else:
            lines.append(f"    {name:<28} {one_line(json.dumps(p), 90)}")
    lines.append(f"report: {report['path']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--budget-s", type=float, default=480.0, help="all stages together (default 8 minutes)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "out" / "gpu-check"),
                    help="folder for gpu-check.json and the server log (default $OUT, else out/gpu-check)")
    ap.add_argument("--only", default="", help="comma-separated stages to run (the others are skipped)")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    sizes = GPU_SIZES if args.device == "cuda" else CPU_SIZES
    ck: dict[str, Path] = {}
    report: dict[str, Any] = {"benchmark": "gpu-check-offline", "device": args.device, "budget_s": args.budget_s,
                              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "command": " ".join(["scripts/gpu-check.sh", *(argv or sys.argv[1:])])}
    # needs_s: about what each takes on an H100 with GPT-2 124M (first figures: to be replaced by measured ones)
    stages = [
        Stage("wheels", 5, wheels_stage),
        Stage("imports", 5, imports_stage, ("wheels",) if (CARRY / "wheels").is_dir() else ()),
        Stage("device", 2, lambda: device_stage(args.device)),
        Stage("checkpoint", 10, lambda: checkpoint_stage(work, sizes, ck), ("device",)),
        Stage("engine", 60, lambda: engine_stage(ck["path"], args.device, sizes, budget, reserve_s=150),
              ("checkpoint",)),
        Stage("serve", 60, lambda: serve_stage(ck["path"], args.device, sizes, out, min(240, budget.left())),
              ("checkpoint", "imports")),
        Stage("train", 40, lambda: train_stage(work, args.device, sizes), ("device",)),
        Stage("finetune", 30, lambda: finetune_stage(work, args.device,
                                                     Path(report["stages"]["train"]["checkpoint"])), ("train",)),
        Stage("classify", 30, lambda: classify_stage(Path(report["stages"]["finetune"]["checkpoint"]), args.device,
                                                     out, min(120, budget.left())), ("finetune",)),
        Stage("tests", 90, lambda: tests_stage(args.device, max(budget.left() - 5, 1)), ("device",)),
    ]
    order = [s.name for s in stages]
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {s.name for s in stages}
        if unknown:
            ap.error(f"--only: unknown stage(s) {', '.join(sorted(unknown))}")
        report["stages"] = {s.name: {"status": "skipped", "reason": "not in --only"} for s in stages
                            if s.name not in keep}
        stages = [s for s in stages if s.name in keep]
    print(f"gpu-check ({args.device}), budget {args.budget_s:.0f} s:", flush=True)
    try:
        failures = run_stages(stages, budget, report)
    finally:  # the stages' checkpoints and training runs: what they found is in the report
        shutil.rmtree(work, ignore_errors=True)
    report["stages"] = {name: report["stages"][name] for name in order}
    report.update(failures=failures, seconds=round(budget.total_s - budget.left(), 1),
                  path=str(out / "gpu-check.json"))
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(summary(report), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
