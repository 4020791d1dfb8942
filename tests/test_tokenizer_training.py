"""Tests for training.tokenizer: BPE training, the ranks file, and the CLI."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load

from training import text as text_mod
from training import tokenizer as tok

REPO_ROOT = Path(__file__).resolve().parents[1]

EOT = "<|endoftext|>"
UNSEEN = "naïve 東京 🙂👍🏽 café\n\tindented\r\nCRLF  double  spaces 12345 ¿qué? z̧\n\n"


def make_corpus(n_sentences: int = 400, seed: int = 0) -> str:
    """A small synthetic corpus: a Zipf-ish lexicon of syllable words, so BPE has plenty to learn."""
    rng = random.Random(seed)
    syllables = ["the", "an", "ing", "er", "qu", "ro", "ma", "ïv", "é", "東", "京", "zu", "ka", "st", "ol", "ph"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    lexicon += ["don't", "we'll", "42", "1999", "🙂"]
    weights = [1 / (i + 1) for i in range(len(lexicon))]
    lines = []
    for _ in range(n_sentences):
        sentence = " ".join(rng.choices(lexicon, weights, k=rng.randint(3, 12)))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ";", ","]))
        if rng.random() < 0.2:
            lines.append("")
    return "\n".join(lines) + "\n"


def encoding(ranks: dict[bytes, int]) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="x", pat_str=tok.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)}
    )


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "training.tokenizer", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def corpus() -> str:
    return make_corpus()


def test_ranks_layout(corpus: str) -> None:
    ranks = tok.train_bpe([corpus], 400)
    assert len(ranks) == 399  # vocab_size counts <|endoftext|>, which is not a rank
    assert sorted(ranks.values()) == list(range(399))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert all(len(t) > 1 for t, r in ranks.items() if r >= 256)


def test_file_loads_with_tiktoken_and_roundtrips(corpus: str, tmp_path: Path) -> None:
    path = tmp_path / "tok.tiktoken"
    tok.save_ranks(tok.train_bpe([corpus], 512), path)
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    assert len(ranks) == 511
    enc = encoding(ranks)
    for text in (corpus, UNSEEN, "", "\x00\x7f\U0010ffff", "🙂" * 50):
        assert enc.decode(enc.encode_ordinary(text)) == text
    assert enc.encode(EOT, allowed_special={EOT}) == [len(ranks)]
    assert enc.n_vocab == 512
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left no temp file


def test_loads_with_model_tokenizer(corpus: str, tmp_path: Path) -> None:
    from model.tokenizer import GPT2_PATTERN, Tokenizer

    assert tok.GPT2_PATTERN == GPT2_PATTERN
    path = tmp_path / "tok.tiktoken"
    tok.save_ranks(tok.train_bpe([corpus], 300), path)
    t = Tokenizer.from_ranks_file(path)
    assert t.vocab_size == 300 and t.eot_id == 299
    assert t.decode(t.encode(UNSEEN)) == UNSEEN


def test_merges_compress(corpus: str) -> None:
    n_bytes = len(corpus.encode("utf-8"))
    per_byte = []
    for vocab_size in (257, 300, 400, 512):
        enc = encoding(tok.train_bpe([corpus], vocab_size))
        per_byte.append(len(enc.encode_ordinary(corpus)) / n_bytes)
    assert per_byte[0] == 1.0  # no merges: one token per byte
    assert per_byte[-1] < 0.4
    assert all(a > b for a, b in itertools.pairwise(per_byte))


def test_deterministic(corpus: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a.tiktoken", tmp_path / "b.tiktoken"
    tok.save_ranks(tok.train_bpe([corpus], 450), a)
    tok.save_ranks(tok.train_bpe(iter([corpus]), 450), b)
    assert a.read_bytes() == b.read_bytes()


def test_stops_early_when_out_of_pairs() -> None:
    ranks = tok.train_bpe(["abab abab"], 1000)
    assert 256 < len(ranks) < 999
    assert encoding(ranks).encode_ordinary("abab") == [ranks[b"abab"]]


def test_vocab_too_small_raises() -> None:
    with pytest.raises(ValueError, match="257"):
        tok.train_bpe(["hello"], 256)


def test_streamed_chunks_match_whole_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny read blocks force many chunk cuts; pre-token counts must not change.
    text = make_corpus(200, seed=1).replace("\n", "\r\n", 20) + "  trailing \n\n\n  "
    path = tmp_path / "c.txt"
    path.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(text_mod, "READ_BLOCK", 7)
    chunks = list(tok.iter_texts([path]))
    assert len(chunks) > 10
    assert "".join(chunks) == text
    assert tok.count_pretokens(chunks) == tok.count_pretokens([text])


def test_invalid_utf8_offset_across_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes("é".encode() * 10 + b"\xff rest")  # bad byte at offset 20
    monkeypatch.setattr(text_mod, "READ_BLOCK", 3)  # blocks split the 2-byte characters
    with pytest.raises(tok.InputError, match=r"bad\.txt: invalid UTF-8 at byte offset 20\b"):
        list(tok.iter_texts([path]))


# ----------------------------------------------------------------------------- CLI


def test_cli_success(corpus: str, tmp_path: Path) -> None:
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.txt").write_text(corpus[:5000], encoding="utf-8")
    (tmp_path / "data" / "sub" / "b.txt").write_text(corpus[5000:], encoding="utf-8")
    (tmp_path / "data" / "ignored.bin").write_bytes(b"\xff\xfe not text")
    out = tmp_path / "tok.tiktoken"
    result = run_cli("--input", str(tmp_path / "data"), "--vocab-size", "320", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "merges 63/63" in result.stderr
    ranks = tiktoken.load.load_tiktoken_bpe(str(out))
    assert len(ranks) == 319
    assert encoding(ranks).decode(encoding(ranks).encode_ordinary(UNSEEN)) == UNSEEN
    # Folder = its *.txt files in sorted order, each pre-tokenized on its own.
    expected = tok.train_bpe([corpus[:5000], corpus[5000:]], 320)
    assert ranks == expected


def test_cli_quiet_and_early_stop(tmp_path: Path) -> None:
    src = tmp_path / "tiny.txt"
    src.write_text("abab abab\n", encoding="utf-8")
    result = run_cli("--input", str(src), "--vocab-size", "1000", "--out", str(tmp_path / "t.tiktoken"), "--quiet")
    assert result.returncode == 0, result.stderr
    assert "ran out of pairs" in result.stderr and "merges " not in result.stderr
    n_ranks = len(tiktoken.load.load_tiktoken_bpe(str(tmp_path / "t.tiktoken")))
    assert f"vocab size is {n_ranks + 1}" in result.stderr


def test_cli_help() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for needle in ("--input", "--vocab-size", "--out", "--quiet", "*.txt", "<|endoftext|>"):
        assert needle in result.stdout


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "no such file or folder"),
        ("empty", "input is empty"),
        ("bad_utf8", "bad.txt: invalid UTF-8 at byte offset 6"),
        ("vocab_small", "--vocab-size must be >= 257"),
        ("no_txt_in_folder", "no *.txt files"),
    ],
)
def test_cli_errors(case: str, expected: str, tmp_path: Path) -> None:
    vocab = "300"
    if case == "missing":
        src = tmp_path / "nope.txt"
    elif case == "empty":
        src = tmp_path / "empty.txt"
        src.write_bytes(b"")
    elif case == "bad_utf8":
        src = tmp_path / "bad.txt"
        src.write_bytes(b"hello \xc3\x28 world")
    elif case == "vocab_small":
        src = tmp_path / "ok.txt"
        src.write_text("hello world", encoding="utf-8")
        vocab = "256"
    else:
        src = tmp_path / "folder"
        src.mkdir()
        (src / "x.md").write_text("hello", encoding="utf-8")
    out = tmp_path / "out.tiktoken"
    result = run_cli("--input", str(src), "--vocab-size", vocab, "--out", str(out))
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
