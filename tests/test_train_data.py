"""training.prepare and training.lm.data: the byte split, streaming encoding, document separators, memory maps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from model.tokenizer import Tokenizer
from tests.helpers import write_byte_ranks
from training import text as text_mod
from training.lm.data import BatchSampler, DataError, open_data_dir, token_dtype
from training.prepare import prepare


@pytest.fixture
def ranks(tmp_path):
    return write_byte_ranks(tmp_path / "tok.tiktoken", [b"th", b"he", b" t", b"the", b"e ", b"\n\n"])


def text_of(n_lines: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "then", "there", "héllo", "wörld", "東京", "a", "  spaced", "end."]
    lines = [" ".join(rng.choice(words, size=rng.integers(1, 8))) for _ in range(n_lines)]
    return "\n".join(lines) + ("\n\n" if n_lines % 2 else "\n")


def test_single_file_split_and_streaming_equal_whole_encoding(tmp_path, ranks, monkeypatch):
    monkeypatch.setattr(text_mod, "READ_BLOCK", 97)  # many small pieces: cuts at every kind of boundary
    text = text_of(400)
    f = tmp_path / "a.txt"
    f.write_text(text)
    raw = text.encode()
    meta = prepare([str(f)], tmp_path / "out", str(ranks), 0.1, progress=False)
    split = math.floor(len(raw) * 0.9)
    while raw[split] & 0xC0 == 0x80:  # moved forward to a character boundary
        split += 1
    tok = Tokenizer.from_ranks_file(ranks)
    d = open_data_dir(tmp_path / "out")
    assert meta["train"]["bytes"] == split and meta["val"]["bytes"] == len(raw) - split
    np.testing.assert_array_equal(d.train, tok.encode(raw[:split].decode(), allow_special=False))
    np.testing.assert_array_equal(d.val, tok.encode(raw[split:].decode(), allow_special=False))
    assert d.train.dtype == np.uint16 and isinstance(d.train, np.memmap)
    assert (tmp_path / "out" / "tok.tiktoken").read_bytes() == ranks.read_bytes()
    assert d.bits_per_byte("val", 2.0) == pytest.approx(2.0 * len(d.val) / ((len(raw) - split) * math.log(2)))


def test_split_inside_a_multibyte_character_moves_forward(tmp_path, ranks):
    f = tmp_path / "a.txt"
    f.write_text("a" * 8 + "東" * 4)  # 20 bytes; 75% = byte 15, inside the third 東 (bytes 14..16)
    meta = prepare([str(f)], tmp_path / "out", str(ranks), 0.25, progress=False)
    assert meta["train"]["bytes"] == 17 and meta["val"]["bytes"] == 3
    d = open_data_dir(tmp_path / "out")
    tok = Tokenizer.from_ranks_file(ranks)
    assert tok.decode(d.train.tolist()) == "a" * 8 + "東" * 3 and tok.decode(d.val.tolist()) == "東"


def test_several_files_tail_split_and_separators(tmp_path, ranks):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "1.txt").write_text("the first document\n" * 20)  # 380 bytes
    (folder / "2.txt").write_text("then the second\n" * 10)  # 160 bytes
    (folder / "3.txt").write_text("")  # empty: skipped, no separator
    (folder / "4.txt").write_text("there the third\n" * 4)  # 64 bytes
    (folder / "ignored.md").write_text("not text")
    meta = prepare([str(folder)], tmp_path / "out", str(ranks), 0.2, progress=False)
    total = 380 + 160 + 64
    assert [i["bytes"] for i in meta["inputs"]] == [380, 160, 0, 64]
    split = math.floor(total * 0.8)  # 483: inside 2.txt
    assert meta["train"]["bytes"] == split and meta["val"]["bytes"] == total - split
    tok = Tokenizer.from_ranks_file(ranks)
    d = open_data_dir(tmp_path / "out")
    two = (folder / "2.txt").read_text()
    cut = split - 380
    expect_train = (tok.encode((folder / "1.txt").read_text(), False) + [tok.eot_id] + tok.encode(two[:cut], False))
    expect_val = tok.encode(two[cut:], False) + [tok.eot_id] + tok.encode((folder / "4.txt").read_text(), False)
    assert d.train.tolist() == expect_train and d.val.tolist() == expect_val


def test_literal_endoftext_in_text_is_plain_text(tmp_path, ranks):
    f = tmp_path / "a.txt"
    f.write_text("the <|endoftext|> the\n" * 10)
    prepare([str(f)], tmp_path / "out", str(ranks), 0.5, progress=False)
    tok = Tokenizer.from_ranks_file(ranks)
    d = open_data_dir(tmp_path / "out")
    assert tok.eot_id not in d.train.tolist() + d.val.tolist()


def test_named_tokenizer_and_dtype(tmp_path, gpt2_tokenizer):
    f = tmp_path / "a.txt"
    f.write_text("Hello world, this is GPT-2's tokenizer.\n" * 30)
    meta = prepare([str(f)], tmp_path / "out", "r50k_base", 0.1, progress=False)
    assert meta["tokenizer"] == {"type": "tiktoken", "name": "r50k_base"} and meta["dtype"] == "uint16"
    assert open_data_dir(tmp_path / "out").tokenizer.vocab_size == 50257
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_the_input_is_checked_before_the_tokenizer_loads(tmp_path, monkeypatch):
    """Offline, GPT-2's ranks cannot be downloaded: a mistake in the input is still reported as such."""
    import training.prepare as prepare_mod
    from model.tokenizer import TokenizerError

    def offline(name):
        raise TokenizerError(f"cannot load tiktoken encoding {name!r} (offline)")

    monkeypatch.setattr(prepare_mod.Tokenizer, "load", staticmethod(offline))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="input is empty"):
        prepare([str(tmp_path / "empty.txt")], tmp_path / "o", "r50k_base", progress=False)
    with pytest.raises(DataError, match="no such file"):
        prepare([str(tmp_path / "nope.txt")], tmp_path / "o", "r50k_base", progress=False)
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(DataError, match="--tokenizer: cannot load"):  # a good input: now the tokenizer speaks
        prepare([str(tmp_path / "a.txt")], tmp_path / "o", "r50k_base", progress=False)
    assert not (tmp_path / "o").exists()


def test_invalid_utf8_offset_across_read_blocks(tmp_path, ranks, monkeypatch):
    monkeypatch.setattr(text_mod, "READ_BLOCK", 7)
    f = tmp_path / "bad.txt"
    f.write_bytes("héllo wörld ".encode() * 5 + b"\xe6\x9d" + b" tail")  # a truncated 3-byte character
    bad_at = len("héllo wörld ".encode() * 5)
    with pytest.raises(DataError, match=rf"bad.txt: invalid UTF-8 at byte offset {bad_at}"):
        prepare([str(f)], tmp_path / "out", str(ranks), 0.1, progress=False)
    assert not list((tmp_path / "out").glob("*.bin*"))  # nothing half-written left behind


def test_data_dir_errors(tmp_path, ranks):
    with pytest.raises(DataError, match="data directory not found"):
        open_data_dir(tmp_path / "none")
    f = tmp_path / "a.txt"
    f.write_text("the then there\n" * 50)
    prepare([str(f)], tmp_path / "out", str(ranks), 0.1, progress=False)
    with (tmp_path / "out" / "val.bin").open("ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(DataError, match="incomplete or mismatched"):
        open_data_dir(tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    del meta["dtype"]
    (tmp_path / "out" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="meta.json: malformed"):
        open_data_dir(tmp_path / "out")
    with pytest.raises(DataError, match="too small|split is empty"):
        (tmp_path / "tiny.txt").write_text("a")
        prepare([str(tmp_path / "tiny.txt")], tmp_path / "o2", str(ranks), 0.1, progress=False)


def test_sampler_is_a_pure_function_of_seed_rank_step():
    data = np.arange(1000, dtype=np.uint16)
    s = BatchSampler(data, 16, 4, seed=7)
    x, y = s.batch(3, 1)
    assert x.shape == (4, 16) and x.dtype.is_floating_point is False
    assert (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == x[:, -1] + 1).all()
    x2, _ = BatchSampler(data, 16, 4, seed=7).batch(3, 1)
    assert (x == x2).all()
    assert int(x.max()) < 1000 - 0 and int(s.offsets(0, 0).max()) <= 1000 - 16 - 1
