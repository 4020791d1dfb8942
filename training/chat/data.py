"""Conversation files for chat fine-tuning (training/finetune.py --task chat): OpenAI's fine-tuning JSONL,
checked line by line, encoded once into a token file on disk, and batches of it.

One JSON object per line (blank lines are skipped), either

    {"messages": [{"role": "system" | "user" | "assistant", "content": "...", "weight": 0 | 1}, ...]}
    {"prompt": "...", "completion": "..."}                   → a user message and an assistant reply
    {"prompt": [messages...], "completion": [messages...]}   → TRL's form: only the completion's replies learned

`weight` (assistant messages only; default 1) is OpenAI's: 0 keeps a reply as context without learning it.
Tool calling, as OpenAI's fine-tuning format has it: a line's `tools` (function tools, rendered by the template as
the server renders a request's), assistant messages with `tool_calls` (content may then be null; the calls are
learned as the reply), `tool` messages with the results, and `parallel_tool_calls` (a boolean, read and checked:
the calls in the data are what is learned). Other keys ("name", ...) are ignored. Every problem is one line naming
FILE:LINE (ChatDataError): not JSON, not an object, no messages, an unknown role, content that is not a string, a
malformed tool or call, no assistant reply to learn.

A conversation longer than the context (block_size + 1 tokens: inputs and shifted targets) is dropped, or with
`overlong = "truncate"` cut to its first block_size + 1 tokens (kept if a learned token remains); both are
counted. The file is read as a stream and encoded into a temporary token file (uint32: the id, and bit 31 set
on a learned token) with an index of each conversation's offset, so a file larger than memory trains with
8 bytes per conversation in RAM; every batch is a read from that file.

Batches pad, never pack: each conversation is its own row from position 0, as a served chat starts (the
model's positions are learned and its attention has no per-document mask, so packed conversations would
attend to each other and sit at positions they never have when served). A batch is as long as its longest
conversation, not block_size; padding positions are no target (-1).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.chat_template import ChatTemplateError
from training.chat.encoding import ChatEncoder, ChatEncodingError, Message
from training.jsonl import parse_line

ROLES = ("system", "user", "assistant", "tool")
LEARN_BIT = np.uint32(1 << 31)
ID_MASK = np.uint32((1 << 31) - 1)
OVERLONG = ("drop", "truncate")


class ChatDataError(ValueError):
    """A bad conversation file; the message names FILE:LINE and the problem (shown without a traceback)."""


def _messages(value: Any, what: str, weight_default: int | None = None) -> list[Message]:
    """A list of message objects → Messages; ValueError (one phrase) when malformed."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        where = f"{what}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with role and content, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (expected system, user, assistant or tool)")
        if "function_call" in m:
            raise ValueError(f"{where}: function_call (OpenAI's deprecated form) is not supported; use tool_calls")
        calls = _tool_calls(m["tool_calls"], where) if m.get("tool_calls") is not None else None
        if calls and role != "assistant":
            raise ValueError(f"{where}: only assistant messages carry tool_calls")
        content = m.get("content")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"{where}: content must be a string, got {type(content).__name__}")
        call_id = m.get("tool_call_id")
        if role == "tool" and call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"{where}: tool_call_id must be a string")
        weight = m.get("weight", 1 if weight_default is None else weight_default)
        if "weight" in m:
            if role != "assistant":
                raise ValueError(f"{where}: weight is for assistant messages only")
            if type(weight) not in (int, float) or weight not in (0, 1):
                raise ValueError(f"{where}: weight must be 0 or 1, got {weight!r}")
        out.append(Message(role, content, int(weight) if role == "assistant" else 0, calls,
                           call_id if role == "tool" else None))
    return out


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant's tool_calls → calls as templates read them (arguments parsed: JSON text or an object)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: tool_calls must be a non-empty list")
    out = []
    for j, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"{where}.tool_calls[{j}]: expected {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": ...}}")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.tool_calls[{j}]: arguments are not JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}.tool_calls[{j}]: arguments must be a JSON object")
        out.append({"id": c.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def parse_tools(obj: Any) -> list[dict] | None:
    """A line's `tools` (OpenAI's function tools) as the template reads them; None without; ValueError (one phrase)
    when malformed. `parallel_tool_calls` is checked too (a boolean)."""
    if not isinstance(obj, dict):
        return None
    if "parallel_tool_calls" in obj and not isinstance(obj["parallel_tool_calls"], bool):
        raise ValueError("parallel_tool_calls must be true or false")
    tools = obj.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": ...}}}}")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ValueError(f"tools[{i}]: parameters must be a JSON schema object")
    return tools


def parse_conversation(obj: Any) -> list[Message]:
    """A JSONL line's object → its messages; ValueError (one phrase) when it is not a conversation."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = _messages(obj["messages"], "messages")
    elif "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, str) and isinstance(c, str):
            msgs = [Message("user", p, 0), Message("assistant", c, 1)]
        elif isinstance(p, list) and isinstance(c, list):
            msgs = _messages(p, "prompt", weight_default=0) + _messages(c, "completion")
        else:
            raise ValueError("prompt and completion must both be strings or both be lists of messages")
    else:
        raise ValueError('expected "messages" (or "prompt" and "completion")')
    if not any(m.role == "assistant" for m in msgs):
        raise ValueError("no assistant turn (nothing to learn)")
    if not any(m.role == "assistant" and m.weight == 1 for m in msgs):
        raise ValueError("no assistant turn to learn (every assistant message has weight 0)")
    return msgs


@dataclass
class ChatSet:
    """A conversation file, encoded: the token file (memory-mapped) and each conversation's offset."""

    path: Path
    sha256: str
    tokens: np.ndarray  # uint32: id | LEARN_BIT on learned tokens
    offsets: np.ndarray  # int64, len(self) + 1
    stats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]: self.offsets[i + 1]])

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])


def pack_row(ids: list[int], learn: list[bool]) -> np.ndarray:
    """One conversation as the token file stores it: uint32 ids, LEARN_BIT set on the learned ones."""
    return np.asarray(ids, dtype=np.uint32) | np.where(np.asarray(learn, dtype=bool), LEARN_BIT, np.uint32(0))


def encode_chat_file(path: str | Path, encoder: ChatEncoder, block_size: int, overlong: str,
                     workdir: str | Path) -> ChatSet:
    """Read, check and encode a conversation file into `workdir` (a streaming pass over the file)."""
    path = Path(path)
    if not path.is_file():
        raise ChatDataError(f"{path}: no such file")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    limit = block_size + 1
    digest = hashlib.sha256()
    offsets = array("q", [0])
    stats: Counter[str] = Counter()
    token_file = Path(workdir) / (path.name + ".tokens")
    with open(path, "rb") as f, open(token_file, "wb") as out:
        for n, line_bytes in enumerate(f, start=1):
            digest.update(line_bytes)
            where = f"{path}:{n}"
            obj = parse_line(line_bytes, where, ChatDataError)
            if obj is None:
                continue
            try:
                ids, learn = encoder.encode(parse_conversation(obj), tools=parse_tools(obj))
            except (ValueError, ChatTemplateError, ChatEncodingError) as e:
                raise ChatDataError(f"{where}: {e}") from None
            stats["conversations"] += 1
            if len(ids) > limit:
                if overlong == "drop" or not any(learn[1:limit]):
                    stats["dropped_overlong"] += 1
                    continue
                ids, learn = ids[:limit], learn[:limit]
                stats["truncated"] += 1
            out.write(pack_row(ids, learn).tobytes())
            offsets.append(offsets[-1] + len(ids))
            stats["learned_tokens"] += sum(learn[1:])
    if len(offsets) == 1:
        raise ChatDataError(f"{path}: no conversations" + (
            f" (all {stats['dropped_overlong']} are longer than the context of {limit} tokens; "
            "set overlong=truncate or raise block_size)" if stats["dropped_overlong"] else
            " (expected one JSON object per line)"))
    stats["examples"] = len(offsets) - 1
    stats["tokens"] = offsets[-1]
    tokens = np.memmap(token_file, dtype=np.uint32, mode="r")
    return ChatSet(path, digest.hexdigest(), tokens, np.frombuffer(offsets, dtype=np.int64).copy(), dict(stats))


class TokenDir:
    """A private temporary directory for the encoded token files, removed when the run ends (TMPDIR picks
    where; each process of a DDP run encodes its own copy)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"chat-tokens-{os.getpid()}-"))

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def chat_batch(rows: list[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded conversations → inputs x (B, T) and targets y (B, T), T = the longest row's length - 1.
    y is the next token where that token is learned, else -1 (ignored by the loss), and -1 on padding."""
    T = max(len(r) for r in rows) - 1
    x = np.full((len(rows), T), pad_id, dtype=np.int64)
    y = np.full((len(rows), T), -1, dtype=np.int64)
    for b, r in enumerate(rows):
        ids = (r & ID_MASK).astype(np.int64)
        x[b, : len(r) - 1] = ids[:-1]
        y[b, : len(r) - 1] = np.where(r[1:] & LEARN_BIT, ids[1:], -1)
    return torch.from_numpy(x), torch.from_numpy(y)
