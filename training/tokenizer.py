"""Train a byte-level BPE tokenizer and write it in tiktoken's ranks format.

Usage::

    python -m training.tokenizer --input data/ more.txt --vocab-size 4096 --out tok.tiktoken

The ranks file holds the 256 single bytes (ranks 0..255, in byte order) followed
by the learned merges in merge order. ``<|endoftext|>`` is *not* stored in the
file: loaders append it at ``id = len(ranks)``, so ``--vocab-size`` (the model's
total vocabulary) counts it and the file holds ``vocab_size - 1`` ranks.

Load it with::

    ranks = tiktoken.load.load_tiktoken_bpe(path)
    enc = tiktoken.Encoding(name="x", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={EOT_TOKEN: len(ranks)})
"""

from __future__ import annotations

import argparse
import base64
import heapq
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from pathlib import Path

import regex

from training.text import InputError, iter_texts, resolve_inputs

# GPT-2's pre-tokenization regex; merges never cross the pieces it produces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT_TOKEN = "<|endoftext|>"
# 256 byte tokens + <|endoftext|>: the smallest vocabulary that can encode anything.
MIN_VOCAB_SIZE = 257

_PRETOKENIZE = regex.compile(GPT2_PATTERN)

ProgressFn = Callable[[int, int], None]


# --------------------------------------------------------------------------- #
# Pre-tokenization
# --------------------------------------------------------------------------- #


def count_pretokens(texts: Iterable[str]) -> Counter[str]:
    """Frequency of each GPT-2 pre-token over all ``texts`` (each text is split independently)."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(_PRETOKENIZE.findall(text))
    return counts


# --------------------------------------------------------------------------- #
# BPE
# --------------------------------------------------------------------------- #


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab size must be >= {MIN_VOCAB_SIZE} (256 bytes + {EOT_TOKEN}), got {vocab_size}"
        )


def _merge_word(word: list[int], a: int, b: int, new_id: int) -> list[int]:
    """Replace every non-overlapping (a, b) in ``word``, left to right, with ``new_id``."""
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe_from_counts(
    counts: Counter[str] | dict[str, int],
    vocab_size: int,
    progress: ProgressFn | None = None,
) -> dict[bytes, int]:
    """BPE over unique pre-tokens weighted by frequency; see :func:`train_bpe`."""
    _check_vocab_size(vocab_size)
    target_merges = vocab_size - MIN_VOCAB_SIZE

    # id -> bytes; ids double as ranks because new tokens are appended in merge order.
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    ids: dict[bytes, int] = {tok: i for i, tok in enumerate(vocab)}

    words: list[list[int]] = []
    freqs: list[int] = []
    for text, freq in counts.items():
        encoded = text.encode("utf-8")
        if len(encoded) > 1:  # single bytes have no pairs to merge
            words.append(list(encoded))
            freqs.append(freq)

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}  # pair -> indices of words containing it
    for wi, word in enumerate(words):
        freq = freqs[wi]
        for pair in pairwise(word):
            pair_counts[pair] = pair_counts.get(pair, 0) + freq
            where.setdefault(pair, set()).add(wi)

    # Max-heap with lazy deletion: an entry is live only while its count still
    # matches pair_counts. Ties break on the smallest (left bytes, right bytes),
    # a total order, so the result does not depend on dict/set iteration order.
    def entry(pair: tuple[int, int], count: int) -> tuple[int, bytes, bytes, int, int]:
        return (-count, vocab[pair[0]], vocab[pair[1]], pair[0], pair[1])

    heap = [entry(pair, count) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges = 0
    while merges < target_merges and heap:
        neg_count, left, right, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b)) != -neg_count:
            continue  # stale entry
        merged = left + right
        new_id = ids.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            ids[merged] = new_id
            merges += 1
            if progress is not None:
                progress(merges, target_merges)
        # else: different split of an existing token (e.g. "a"+"bc" vs "ab"+"c"):
        # reuse its id, since a ranks file maps each byte string to one rank.

        changed: set[tuple[int, int]] = set()
        for wi in where.pop((a, b)):
            word = words[wi]
            new_word = _merge_word(word, a, b, new_id)
            words[wi] = new_word
            freq = freqs[wi]
            old_pairs = Counter(pairwise(word))
            new_pairs = Counter(pairwise(new_word))
            for pair in old_pairs.keys() | new_pairs.keys():
                old_n, new_n = old_pairs[pair], new_pairs[pair]
                if old_n == new_n:
                    continue
                total = pair_counts.get(pair, 0) + (new_n - old_n) * freq
                if total:
                    pair_counts[pair] = total
                else:
                    del pair_counts[pair]
                changed.add(pair)
                if new_n == 0:
                    holders = where.get(pair)
                    if holders is not None:
                        holders.discard(wi)
                elif old_n == 0:
                    where.setdefault(pair, set()).add(wi)
        # One heap push per changed pair (not per word) keeps the heap small.
        for pair in changed:
            count = pair_counts.get(pair)
            if count:
                heapq.heappush(heap, entry(pair, count))

    return {tok: rank for rank, tok in enumerate(vocab)}


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    progress: ProgressFn | None = None,
) -> dict[bytes, int]:
    """Train byte-level BPE on ``texts`` and return tiktoken-style ``{token_bytes: rank}``.

    ``vocab_size`` is the model's total vocabulary including ``<|endoftext|>``, so
    the result holds ``vocab_size - 1`` ranks, or fewer if the text runs out of
    pairs to merge. Each text is pre-tokenized on its own with GPT2_PATTERN.
    Deterministic: the same input always gives the same ranks.
    """
    _check_vocab_size(vocab_size)  # fail before reading a possibly large corpus
    return train_bpe_from_counts(count_pretokens(texts), vocab_size, progress)


def save_ranks(ranks: dict[bytes, int], path: str | os.PathLike[str]) -> None:
    """Write ``ranks`` as ``base64(token) rank`` lines, atomically (temp file + os.replace)."""
    path = Path(path)
    lines = "".join(
        f"{base64.b64encode(tok).decode('ascii')} {rank}\n"
        for tok, rank in sorted(ranks.items(), key=lambda item: item[1])
    )
    # The temp file lives in the destination folder so os.replace is a same-filesystem rename.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="ascii", newline="\n") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


class _ProgressLine:
    """Throttled "merges done / total" line on stderr."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - self.last >= self.interval_s:
            self.last = now
            self.shown = True
            sys.stderr.write(f"\rmerges {done}/{total}")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.tokenizer",
        description=(
            "Train a byte-level BPE tokenizer (GPT-2 pre-tokenization regex) on UTF-8 text "
            "and write it in tiktoken's ranks format (one 'base64(token) rank' line per token). "
            f"Ranks 0..255 are the single bytes; {EOT_TOKEN} is not in the file and is "
            "appended by the loader at id = number of ranks."
        ),
        epilog=(
            "Exit status: 0 on success, 2 on bad input (missing path, empty input, "
            "invalid UTF-8 with file and byte offset, vocab size < 257). "
            "Load the result with tiktoken.load.load_tiktoken_bpe(FILE)."
        ),
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help=(
            "UTF-8 text files and/or folders. A folder contributes every *.txt file below it "
            "(recursively, sorted by path); other files in it are ignored. Files given "
            "explicitly are used whatever their extension. Each file is pre-tokenized on its own."
        ),
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help=(
            f"total model vocabulary INCLUDING {EOT_TOKEN}; the file gets N-1 ranks "
            f"(256 bytes + N-257 merges). Must be >= {MIN_VOCAB_SIZE}. Training stops early "
            "(with a note on stderr) if the text has no pairs left to merge."
        ),
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="output ranks file, e.g. tok.tiktoken (written atomically; folder must exist)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress or summary on stderr (warnings still shown)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = parser.prog

    def fail(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2

    def info(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr)

    if args.vocab_size < MIN_VOCAB_SIZE:
        return fail(
            f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + {EOT_TOKEN}), "
            f"got {args.vocab_size}"
        )
    out = Path(args.out)
    if not out.parent.is_dir():
        return fail(f"{out}: output folder {out.parent} does not exist")

    start = time.perf_counter()
    try:
        files = resolve_inputs(args.input)
        counts = count_pretokens(iter_texts(files))
    except InputError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{exc.filename}: {exc.strerror}")
    if not counts:
        return fail(f"input is empty: no text in {', '.join(str(f) for f in files)}")
    n_bytes = sum(len(word.encode("utf-8")) * n for word, n in counts.items())
    info(
        f"read {n_bytes:,} bytes from {len(files)} file(s): {len(counts):,} unique pre-tokens "
        f"({time.perf_counter() - start:.1f}s)"
    )

    progress = None if args.quiet else _ProgressLine()
    ranks = train_bpe_from_counts(counts, args.vocab_size, progress)
    if progress is not None:
        progress.finish()
    if len(ranks) < args.vocab_size - 1:
        print(
            f"{prog}: note: text ran out of pairs to merge after {len(ranks) - 256} merges; "
            f"resulting vocab size is {len(ranks) + 1} ({len(ranks)} ranks + {EOT_TOKEN}), "
            f"not {args.vocab_size}",
            file=sys.stderr,
        )
    try:
        save_ranks(ranks, out)
    except OSError as exc:
        return fail(f"{out}: cannot write: {exc.strerror}")
    info(
        f"wrote {out}: {len(ranks)} ranks, vocab size {len(ranks) + 1} incl. {EOT_TOKEN} "
        f"({time.perf_counter() - start:.1f}s total)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
