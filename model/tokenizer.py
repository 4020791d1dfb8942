"""Tokenizers (tiktoken) and incremental detokenization for streaming.

Two kinds, both byte-level BPE with GPT-2's pre-tokenization and `<|endoftext|>`:
- a named tiktoken encoding (`r50k_base` is GPT-2's; `gpt2` is accepted as an alias);
- a `.tiktoken` ranks file (e.g. trained by `python -m training.tokenizer`), whose
  `<|endoftext|>` id is the number of ranks.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import tiktoken
import tiktoken.load

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
NAMED_ENCODINGS = {"r50k_base": "r50k_base", "gpt2": "r50k_base"}


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded: unknown name, missing or malformed ranks file."""


class Tokenizer:
    def __init__(self, encoding: tiktoken.Encoding, spec: dict[str, Any]) -> None:
        if EOT not in encoding.special_tokens_set:
            raise TokenizerError(f"encoding {encoding.name!r} has no {EOT} token")
        self.encoding = encoding
        self.spec = spec  # how to load it again; stored in checkpoints
        self.eot_id: int = encoding.encode_single_token(EOT)
        self.vocab_size: int = encoding.n_vocab

    @classmethod
    def named(cls, name: str) -> Tokenizer:
        if name not in NAMED_ENCODINGS:
            raise TokenizerError(f"unknown tokenizer {name!r}; known: {sorted(NAMED_ENCODINGS)} or a .tiktoken file")
        try:
            enc = tiktoken.get_encoding(NAMED_ENCODINGS[name])
        except Exception as e:  # network or cache failure: say how to fix it
            raise TokenizerError(
                f"cannot load tiktoken encoding {name!r} ({type(e).__name__}: {str(e)[:160]}); "
                "it is downloaded on first use, "
                "or set TIKTOKEN_CACHE_DIR to a folder that already holds it"
            ) from e
        return cls(enc, {"type": "tiktoken", "name": name})

    @classmethod
    def from_ranks_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer ranks file not found")
        try:
            ranks = tiktoken.load.load_tiktoken_bpe(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: not a valid .tiktoken ranks file ({type(e).__name__}: {e})") from e
        if len(ranks) < 256 or sorted(ranks.values()) != list(range(len(ranks))):
            raise TokenizerError(f"{path}: ranks must be 0..n-1 and cover all 256 bytes (found {len(ranks)} ranks)")
        enc = tiktoken.Encoding(name=path.stem, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                special_tokens={EOT: len(ranks)})
        return cls(enc, {"type": "tiktoken_file", "file": path.name})

    @classmethod
    def load(cls, name_or_path: str | Path) -> Tokenizer:
        """A named encoding, or a path to a .tiktoken file (CLI convenience)."""
        if str(name_or_path) in NAMED_ENCODINGS:
            return cls.named(str(name_or_path))
        return cls.from_ranks_file(name_or_path)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """allow_special: `<|endoftext|>` in the text becomes the special token (else it is plain text)."""
        if allow_special:
            return self.encoding.encode(text, allowed_special={EOT})
        return self.encoding.encode(text, disallowed_special=())

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_id)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Token ids in, text out, one token at a time.

    A character can span several byte-level tokens; its bytes are held until it is
    complete, so a stream never shows a broken character. Bytes that can never form
    valid UTF-8 become U+FFFD, as in a full decode.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def load_tokenizer(spec: dict[str, Any], base_dir: str | Path) -> Tokenizer:
    """Load the tokenizer a checkpoint describes (spec from its tokenizer.json)."""
    kind = spec.get("type")
    if kind == "tiktoken":
        return Tokenizer.named(str(spec.get("name")))
    if kind == "tiktoken_file":
        return Tokenizer.from_ranks_file(Path(base_dir) / str(spec.get("file")))
    raise TokenizerError(f"unknown tokenizer type {kind!r} (expected 'tiktoken' or 'tiktoken_file')")
