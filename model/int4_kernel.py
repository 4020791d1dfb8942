"""The int4 x int8 row kernel of Int4Linear on a CPU (model/int4_gemv.cpp): built once a machine with the C++
compiler inductor needs anyway, loaded as the dispatcher's operator `gpt_serve::int4_matmul`, which eager layers and
compiled steps (AOTInductor calls it from C++) both call, so a row's outputs are the same bits on every path.

Why a kernel of our own: aten's `_weight_int4pack_mm_for_cpu` dequantizes to bf16 and multiplies in floating point;
at one row it ran GPT-2's 768 x 3072 in 73 us on a Zen 4 EPYC with the weight in cache, ours 25 (AVX2 path 36), and
its 48 int4 layers a token 2.8 ms from memory against ours 2.4 (docs/performance.md, "int4 through integer dot
products"). Quantizing the row to int8 (blocks of 32, as llama.cpp's q8_0) turns each 32 inputs x 16 outputs into 8
integer dot-product instructions. A C++ operator rather than ctypes under a Python one: 6 us a call against 11.

`available()` is False where no compiler or no writable folder exists; Int4Linear then keeps aten's kernel (bf16
activations), and says so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_gemv.cpp")
BLOCK = 32  # inputs per int8 activation block (the C++ QB)
ISA = {1: "scalar", 2: "avx2", 3: "avx512_vnni"}
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_folder: Path | None = None  # the server's choice (`use_folder`)


def use_folder(folder: str | Path) -> None:
    """Keep the built library in `folder` (the engine passes its compile cache's `kernels/`), from the next load on."""
    global _folder
    _folder = Path(folder)


def cache_dirs() -> list[Path]:
    """Where the built library may be kept, in order: GPT_KERNEL_CACHE, the server's folder (`use_folder`), the
    user's cache; a folder that cannot be written passes to the next."""
    dirs = [Path(os.environ["GPT_KERNEL_CACHE"])] if os.environ.get("GPT_KERNEL_CACHE") else []
    if _folder is not None:
        dirs.append(_folder)
    dirs.append(Path.home() / ".cache" / "gpt-serve" / "kernels")
    return dirs


def _command(src: Path, out: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    return ([os.environ.get("CXX", "g++"), "-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c++17",
             "-w", str(src), "-o", out] + [f"-I{p}" for p in include_paths()]
            + [f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"])


class BuildError(Exception):
    """The compiler is missing or failed (a folder's own errors are OSError)."""


def _build(source: bytes, target: Path) -> None:
    """Compile to a temporary file beside `target`, then rename it into place (another process may build too)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".int4-", suffix=".so")
    os.close(fd)
    src = Path(tmp).with_suffix(".cpp")
    try:
        src.write_bytes(source)
        command = _command(src, tmp)
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:  # OSError here: no such compiler
            err = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
            raise BuildError(f"{command[0]}: {e}{': ' + err[-1] if err else ''}") from None
        os.replace(tmp, target)
    finally:
        for p in (Path(tmp), src):
            p.unlink(missing_ok=True)


def library_name(source: bytes) -> str:
    """The built file's name: the source, torch's version and Python's ABI (another torch builds its own)."""
    key = hashlib.sha256(source + f"{torch.__version__} {sys.implementation.cache_tag}".encode()).hexdigest()[:16]
    return f"int4-{key}.so"


def available() -> bool:
    """The operator is loaded (built into the first writable cache folder on first use); False where it cannot be."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        source = SOURCE.read_bytes()
        errors = []
        for folder in cache_dirs():
            path = folder / library_name(source)
            try:
                if not path.exists():
                    _build(source, path)
                torch.ops.load_library(str(path))
                _register_fake()
                _loaded = True
                return True
            except BuildError as e:  # the compiler's error: another folder would fail alike
                errors.append(str(e))
                break
            except OSError as e:  # the folder (not writable) or the file (unreadable, not a library): the next one
                errors.append(f"{folder}: {e}")
        log.warning("int4 kernel unavailable (int4 layers use aten's bf16 kernel): %s", "; ".join(errors))
        _loaded = False
        return False


def isa() -> str:
    """The path the kernel takes on this CPU, or "none"."""
    return ISA[torch.ops.gpt_serve.int4_isa()] if available() else "none"


def supports(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % BLOCK == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """q: (N, K) in 0..15 → the kernel's bytes (N/16 blocks of K/32 x 4 tiles of 64, int4_gemv.cpp's layout)."""
    n, k = q.shape
    t = q.to(torch.uint8).reshape(n // 16, 16, k // BLOCK, 4, 2, 4)  # block, output, in-block, tile, half, byte
    t = t.permute(0, 2, 3, 1, 5, 4)  # block, in-block, tile, output, byte, half
    return (t[..., 0] | (t[..., 1] << 4)).contiguous().reshape(-1)


def _register_fake() -> None:
    @torch.library.register_fake("gpt_serve::int4_matmul")
    def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
          isa: int = 0) -> torch.Tensor:
        return x.new_empty(x.shape[0], scales.shape[1], dtype=torch.float32)
