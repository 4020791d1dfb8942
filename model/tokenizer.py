"""Tokenizers (tiktoken) and incremental detokenization for streaming.

Two kinds, both byte-level BPE with GPT-2's pre-tokenization and `<|endoftext|>`:
- a named tiktoken encoding (`r50k_base` is GPT-2's; `gpt2` is accepted as an alias);
- a `.tiktoken` ranks file (e.g. trained by `python -m training.tokenizer`), whose
  `<|endoftext|>` id is the number of ranks.

Either may carry extra special tokens after its own (a fine-tuned checkpoint's `[Start]`, `[Delim]`,
`[Extract]`, model/task_head.py): the spec then has `"special_tokens": {"[Start]": id, ...}`. Encoding text
never produces them (written in the text, they are plain text); they are ids a caller inserts, and decode
to their names — except in a rendered chat template (`encode_chat`), whose special tokens are parsed.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
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

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every special token (`<|endoftext|>` and any extra ones) → its id."""
        return dict(self.encoding._special_tokens)

    def with_special_tokens(self, names: Sequence[str]) -> Tokenizer:
        """This tokenizer plus the given special tokens (those it lacks get the next free ids, in order);
        the spec records them, so a checkpoint saved with it loads them back."""
        special = self.special_tokens
        extra = dict(self.spec.get("special_tokens", {}))
        for name in names:
            if name not in special:
                special[name] = extra[name] = max(self.vocab_size, max(special.values()) + 1)
        if not extra or extra == self.spec.get("special_tokens"):
            return self
        return Tokenizer(_with_specials(self.encoding, special), {**self.spec, "special_tokens": extra})

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """allow_special: `<|endoftext|>` in the text becomes the special token (else it is plain text).
        Extra special tokens written in the text are always plain text."""
        if allow_special:
            return self.encoding.encode(text, allowed_special={EOT}, disallowed_special=())
        return self.encoding.encode(text, disallowed_special=())

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat template: every special token written in the text (`<|endoftext|>` and the extra
        ones, e.g. a chat fine-tune's `<|user|>`) is that token, as transformers' apply_chat_template and vLLM
        parse a rendered template. A user's message that spells one gets it too, as there."""
        return self.encoding.encode(text, allowed_special="all")

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


def _with_specials(enc: tiktoken.Encoding, special: dict[str, int]) -> tiktoken.Encoding:
    return tiktoken.Encoding(name=enc.name, pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                             special_tokens=special)


def load_tokenizer(spec: dict[str, Any], base_dir: str | Path) -> Tokenizer:
    """Load the tokenizer a checkpoint describes (spec from its tokenizer.json)."""
    kind = spec.get("type")
    if kind == "tiktoken":
        base = Tokenizer.named(str(spec.get("name")))
    elif kind == "tiktoken_file":
        base = Tokenizer.from_ranks_file(Path(base_dir) / str(spec.get("file")))
    else:
        raise TokenizerError(f"unknown tokenizer type {kind!r} (expected 'tiktoken' or 'tiktoken_file')")
    extra = spec.get("special_tokens")
    if extra is None:
        return base
    if not isinstance(extra, dict) or not all(isinstance(k, str) and type(v) is int for k, v in extra.items()):
        raise TokenizerError('"special_tokens" must map token names to integer ids')
    special = base.special_tokens
    taken = set(special.values())
    for name, i in extra.items():
        if name in special or i < base.vocab_size or i in taken:
            raise TokenizerError(f"special token {name!r} = {i} collides with the base vocabulary "
                                 f"(ids 0..{base.vocab_size - 1}) or another special token")
        special[name] = i
        taken.add(i)
    return Tokenizer(_with_specials(base.encoding, special), {**base.spec, "special_tokens": dict(extra)})
