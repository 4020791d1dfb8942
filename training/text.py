"""Reading UTF-8 text input for training: which files, streamed in pieces, cut where tokens split anyway.

Shared by `training.tokenizer` (BPE training) and `training.prepare` (token files), so both see the same
files and the same text, and both report bad input the same way.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from pathlib import Path

import regex

READ_BLOCK = 1 << 20  # bytes read from disk at a time
MAX_CARRY = 1 << 24  # chars held while waiting for a safe cut before cutting anyway

# Places where GPT-2's pre-tokenization regex has a boundary whatever follows, so
# encoding text cut there gives the same tokens as encoding it whole: between a
# non-space and " <non-space>", or after a single "\n" between non-spaces
# (longer whitespace runs are not safe: "\n\n" + "A" splits differently from
# a chunk ending in "\n\n"). (?r) searches from the end.
_SAFE_CUT = regex.compile(r"(?r)(?<=\S)(?= \S)|(?<=\S\n)(?=\S)")


class InputError(ValueError):
    """Bad input (missing path, unreadable file, invalid UTF-8); the message names the file and the problem."""


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Files as given; a folder contributes every *.txt file below it (recursive, sorted by path).

    `training.tokenizer` and `training.prepare` both use it, so a tokenizer and its data see the same files.
    """
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise InputError(f"{path}: folder contains no *.txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise InputError(f"{path}: not a regular file or folder")
        else:
            raise InputError(f"{path}: no such file or folder")
    return files


def read_text(path: Path, start: int = 0, stop: int | None = None, block: int | None = None) -> Iterator[str]:
    """Decode bytes [start, stop) of a UTF-8 file in pieces; InputError names the byte offset of bad UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    block = block or READ_BLOCK
    pos = start
    try:
        f = path.open("rb")
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from e
    with f:
        f.seek(start)
        while True:
            want = block if stop is None else min(block, stop - pos)
            data = f.read(want) if want > 0 else b""
            final = not data
            held = len(decoder.getstate()[0])  # bytes of an incomplete character from the previous piece
            try:
                text = decoder.decode(data, final=final)
            except UnicodeDecodeError as e:
                raise InputError(f"{path}: invalid UTF-8 at byte offset {pos - held + e.start} ({e.reason}); "
                                "the input must be UTF-8 text") from None
            if text:
                yield text
            if final:
                return
            pos += len(data)


def safe_chunks(pieces: Iterator[str]) -> Iterator[str]:
    """Re-cut a stream of text so every chunk ends where the tokenizer would split anyway."""
    carry = ""
    for piece in pieces:
        buf = carry + piece
        m = _SAFE_CUT.search(buf)
        if m is None or m.start() == 0:
            if len(buf) < MAX_CARRY:
                carry = buf
                continue
            yield buf  # megabytes without a safe point: cut anyway (at worst one pre-token splits)
            carry = ""
            continue
        yield buf[:m.start()]
        carry = buf[m.start():]
    if carry:
        yield carry


def iter_texts(paths: Iterable[Path]) -> Iterator[str]:
    """Text of all `paths` in order, in chunks that each end on a pre-token boundary."""
    for path in paths:
        yield from safe_chunks(read_text(path))
