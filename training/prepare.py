"""Tokenize UTF-8 text into the flat token files the trainer memory-maps.

Usage::

    python -m training.prepare --input corpus.txt more/ --out data/corpus --tokenizer tok.tiktoken

Writes DIR/train.bin, DIR/val.bin, DIR/meta.json (and copies a .tiktoken ranks file
into DIR so the directory is self-contained). Inputs are streamed: read in 1 MiB
blocks, cut at tokenizer-safe boundaries, encoded and appended to the output a
chunk at a time, so a corpus larger than memory is fine.

Split: the input files, in order, form one byte stream; the validation split is
its LAST `--val-fraction` of the bytes (the split point is floor(total·(1-f)),
moved forward to a character boundary if it falls inside a UTF-8 character).
With one file this is the usual "last 10% of the file" convention; with several,
the tail of the concatenation (the last file(s), and possibly the end of one more).
Documents (files) are separated by <|endoftext|>: the token is written before each
file but the first (into the split where that file starts). `<|endoftext|>` appearing
literally in a text is encoded as ordinary text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from model.tokenizer import Tokenizer, TokenizerError
from training.lm.data import META, DataError, encode_stream, token_dtype
from training.text import resolve_inputs

PROG = "python -m training.prepare"


def _char_boundary(path: Path, offset: int, size: int) -> int:
    """The first UTF-8 character boundary at or after `offset` (skips continuation bytes 10xxxxxx)."""
    with path.open("rb") as f:
        f.seek(offset)
        tail = f.read(4)
    for i, b in enumerate(tail):
        if b & 0xC0 != 0x80:
            return offset + i
    return min(offset + len(tail), size)


def prepare(inputs: list[str], out: str | Path, tokenizer_name: str = "r50k_base", val_fraction: float = 0.1,
            progress: bool = True) -> dict:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    # the user's input first (missing, empty, output path), then the tokenizer: GPT-2's ranks may need a download
    # that fails offline, and that should not hide a mistake in the input
    files = resolve_inputs(inputs)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    if total == 0:
        raise DataError(f"input is empty: no text in {', '.join(map(str, files))}")
    try:
        tokenizer = Tokenizer.load(tokenizer_name)
    except TokenizerError as e:
        raise DataError(f"--tokenizer: {e}") from e

    # where the validation split begins, as (file index, byte offset in that file)
    split_at = math.floor(total * (1.0 - val_fraction))
    start = 0
    split_file, split_off = len(files) - 1, sizes[-1]
    for i, size in enumerate(sizes):
        if split_at < start + size:
            split_file = i
            split_off = _char_boundary(files[i], split_at - start, size)
            break
        start += size
    train_bytes = sum(sizes[:split_file]) + split_off
    val_bytes = total - train_bytes

    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = {s: out / f".{s}.bin.tmp-{os.getpid()}" for s in ("train", "val")}
    counts = {"train": 0, "val": 0}
    handles = {s: open(tmp[s], "wb") for s in tmp}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        def write(split: str, ids: np.ndarray) -> None:
            handles[split].write(ids.astype(dtype).tobytes())
            counts[split] += len(ids)

        first_doc = True
        for i, (path, size) in enumerate(zip(files, sizes)):
            if size == 0:
                continue
            # (split, start, stop) byte ranges of this file
            if i < split_file:
                ranges = [("train", 0, size)]
            elif i > split_file:
                ranges = [("val", 0, size)]
            else:
                ranges = [r for r in (("train", 0, split_off), ("val", split_off, size)) if r[2] > r[1]]
            if not first_doc:
                write(ranges[0][0], np.array([tokenizer.eot_id]))
            first_doc = False
            for split, a, b in ranges:
                for ids in encode_stream(tokenizer, path, a, b, on_bytes=bar.update):
                    write(split, ids)
        for h in handles.values():
            h.flush()
            os.fsync(h.fileno())
            h.close()
    except BaseException:
        for s, h in handles.items():
            h.close()
            tmp[s].unlink(missing_ok=True)
        raise
    finally:
        bar.close()

    for s in ("train", "val"):
        if counts[s] == 0:
            for t in tmp.values():
                t.unlink(missing_ok=True)
            raise DataError(f"the {s} split is empty ({total} bytes of input with --val-fraction {val_fraction}); "
                            "give more text or change --val-fraction")

    spec = dict(tokenizer.spec)
    if spec["type"] == "tiktoken_file":
        src, dst = Path(tokenizer_name), out / spec["file"]
        if not (dst.exists() and os.path.samefile(src, dst)):
            shutil.copyfile(src, dst)
    for s in ("train", "val"):
        os.replace(tmp[s], out / f"{s}.bin")
    meta = {
        "tokenizer": spec,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": dtype.name,
        "train": {"tokens": counts["train"], "bytes": train_bytes},
        "val": {"tokens": counts["val"], "bytes": val_bytes},
        "val_fraction": val_fraction,
        "split": "validation = last val_fraction of the bytes of the concatenated inputs; "
                 "<|endoftext|> before each document but the first",
        "inputs": [{"path": str(f), "bytes": s} for f, s in zip(files, sizes)],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp_meta = out / f".{META}.tmp-{os.getpid()}"
    tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp_meta, out / META)
    meta["seconds"] = time.perf_counter() - t0
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Tokenize UTF-8 text files into DIR/train.bin, DIR/val.bin and DIR/meta.json for "
                    "python -m training.train. The validation split is the last --val-fraction of the bytes of "
                    "the inputs taken in order; files are separated by <|endoftext|>.",
        epilog="Exit status: 0 on success, 2 on bad input (missing path, empty input, invalid UTF-8 with file and "
               "byte offset, unknown tokenizer).")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="UTF-8 text files and/or folders (a folder contributes every *.txt below it, sorted)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--tokenizer", default="r50k_base", metavar="NAME|FILE",
                   help="r50k_base (GPT-2's, alias gpt2) or a .tiktoken ranks file, e.g. from "
                        "python -m training.tokenizer; a file is copied into DIR (default: r50k_base)")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="fraction of the input bytes (the tail) used for validation (default: 0.1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        meta = prepare(args.input, args.out, args.tokenizer, args.val_fraction, progress=not args.quiet)
    except DataError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{PROG}: error: {e.filename or args.out}: {e.strerror}", file=sys.stderr)
        return 2
    if not args.quiet:
        t, v = meta["train"], meta["val"]
        print(f"{args.out}: train {t['tokens']:,} tokens ({t['bytes']:,} bytes), val {v['tokens']:,} tokens "
              f"({v['bytes']:,} bytes), {meta['dtype']}, vocab {meta['vocab_size']} ({meta['seconds']:.1f}s)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
