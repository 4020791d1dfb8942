"""Quality yardstick: what a weight format costs in perplexity, measured by llama.cpp's own `llama-perplexity`.

    python -m bench.quality      # bundled model on held-out tinyshakespeare → bench/results/quality-llama.json

What it measures: `llama-perplexity -m FILE.gguf -f TEXT -c N` tokenizes TEXT with the GGUF's tokenizer, cuts it
into ⌊tokens / N⌋ chunks of N tokens, runs each chunk from an empty cache and scores the tokens of its second
half (each predicted from at least N/2 tokens of context); its "Final estimate: PPL" is exp(mean negative
log-likelihood) over those scored tokens, ± its standard error. The same text, chunking and N for every file, so
the relative Δ against the f32 file is the price of the format alone: llama.cpp's own yardstick for its quants.

The CLI exports the bundled model (checkpoints/shakespeare) with `python -m model.export_gguf` to f32, f16 and
q8_0, quantizes the f32 file to q4_0 and q4_K_M with `llama-quantize`, and scores each on the held-out last 10%
of tinyshakespeare (`tail -c 111540`, the part training did not see) with N = the model's context (256). It
writes ppl, ± stderr, the relative Δ vs f32 and file sizes. llama.cpp's tools come from the tree bench/peer_setup.py
builds (BENCH_CACHE/peers, built there when missing). One function per measurement, a main that writes JSON:
other formats (ours) add a function and a row.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import CACHE, REPO, git_commit, write_result
from bench.peer_setup import LLAMA_CPP_PYTHON_VERSION, llama_binary, setup_llama_server

DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
HELD_OUT_BYTES = 111540  # the last 10% of tinyshakespeare's 1,115,394 bytes
EXPORTED = ("f32", "f16", "q8_0")  # written by model.export_gguf
QUANTIZED = {"q4_0": "Q4_0", "q4_K_M": "Q4_K_M"}  # by llama-quantize from the f32 file
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def llama_perplexity(gguf_file: Path, text_file: Path, ctx: int, binary: Path, threads: int = 2,
                     timeout: float = 3600) -> dict[str, Any]:
    """llama-perplexity's final PPL estimate of `gguf_file` on `text_file` with chunks of `ctx` tokens.

    Returns ppl, ppl_stderr, chunks, ctx and tokens (the tokens scored: chunks × (ctx − ctx/2 − 1))."""
    cmd = [str(binary), "-m", str(gguf_file), "-f", str(text_file), "-c", str(ctx), "-t", str(threads)]
    for _ in range(3):  # llama.cpp's logger thread now and then loses the last lines at exit (status 0): rerun
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out = r.stdout + r.stderr
        final, chunks = FINAL.search(out), CHUNKS.search(out)
        if r.returncode != 0 or (final and chunks):
            break
    if r.returncode != 0 or not final or not chunks:
        raise RuntimeError(f"llama-perplexity exited {r.returncode} without a final estimate: {out[-1500:]}")
    n_chunks, n_ctx = int(chunks.group(1)), int(chunks.group(2))
    return {"ppl": float(final.group(1)), "ppl_stderr": float(final.group(2)), "chunks": n_chunks, "ctx": n_ctx,
            "tokens": n_chunks * (n_ctx - n_ctx // 2 - 1)}


def export_gguf(checkpoint: Path, out: Path, kind: str) -> Path:
    """Our exporter (model/export_gguf.py) writing `kind` (f32, f16, q8_0)."""
    from model.export_gguf import export

    return export(checkpoint, out, kind)


def llama_quantize(f32_file: Path, out: Path, qtype: str, binary: Path, threads: int = 2) -> Path:
    """llama-quantize F32_FILE OUT QTYPE (e.g. Q4_0, Q4_K_M)."""
    r = subprocess.run([str(binary), str(f32_file), str(out), qtype, str(threads)], capture_output=True, text=True,
                       timeout=1800)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama-quantize {qtype} exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    return out


def held_out_text(data: Path, n_bytes: int, out: Path) -> Path:
    """The last n_bytes of `data` (what `tail -c n_bytes` gives) in `out`."""
    raw = data.read_bytes()
    out.write_bytes(raw[-n_bytes:])
    return out


def checkpoint_name(path: Path) -> str:
    """The checkpoint as the JSON records it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=REPO / "checkpoints" / "shakespeare")
    ap.add_argument("--data", type=Path, default=DATA, help="text whose tail is scored")
    ap.add_argument("--tail-bytes", type=int, default=HELD_OUT_BYTES, help="score the last N bytes of --data")
    ap.add_argument("--ctx", type=int, default=None, help="llama-perplexity -c (default: the model's context)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers-dir", type=Path, default=CACHE / "peers", help="where bench/peers.py builds llama.cpp")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build, if it is needed")
    ap.add_argument("--out", default="quality-llama", help="result name: bench/results/<out>.json")
    args = ap.parse_args(argv)
    if not args.data.is_file():
        print(f"error: {args.data}: no such file (tinyshakespeare; give --data)", file=sys.stderr)
        return 2

    from model.checkpoint_info import read_config

    ctx = args.ctx or read_config(args.checkpoint).block_size
    setup = setup_llama_server(args.peers_dir, args.jobs)
    perplexity_bin = llama_binary(args.peers_dir, "llama-perplexity")
    quantize_bin = llama_binary(args.peers_dir, "llama-quantize")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp_:
        tmp = Path(tmp_)
        text = held_out_text(args.data, args.tail_bytes, tmp / "held-out.txt")
        files: dict[str, tuple[Path, str]] = {}
        for kind in EXPORTED:
            files[kind] = (export_gguf(args.checkpoint, tmp / f"model-{kind}.gguf", kind), "model.export_gguf")
        for kind, qtype in QUANTIZED.items():
            files[kind] = (llama_quantize(files["f32"][0], tmp / f"model-{kind}.gguf", qtype, quantize_bin,
                                          args.threads), f"llama-quantize {qtype} of the f32 file")
        for kind, (path, made_by) in files.items():
            res = llama_perplexity(path, text, ctx, perplexity_bin, args.threads)
            rows[kind] = {**res, "file_bytes": path.stat().st_size, "made_by": made_by}
            print(f"{kind:8s} PPL {res['ppl']:.4f} ± {res['ppl_stderr']:.4f}  {res['tokens']} tokens  "
                  f"{path.stat().st_size / 1e6:.2f} MB", flush=True)
    base = rows["f32"]
    for row in rows.values():
        row["delta_vs_f32"] = round(row["ppl"] / base["ppl"] - 1, 5)
        row["size_vs_f32"] = round(row["file_bytes"] / base["file_bytes"], 4)
    data = {"benchmark": "quality-llama", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git": git_commit(), "checkpoint": checkpoint_name(args.checkpoint),
            "text": {"file": args.data.name, "tail_bytes": args.tail_bytes, "what": "held-out last 10%"},
            "measure": f"llama-perplexity -c {ctx}: exp(mean NLL) of the second half of each {ctx}-token chunk",
            "llama_cpp": {"llama_cpp_python_sdist": LLAMA_CPP_PYTHON_VERSION, "version": setup.get("version")},
            "threads": args.threads, "formats": rows}
    path = write_result(args.out, data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
