"""Tool calling (OpenAI's `tools` / `tool_choice`): what a request's tools make of its decoding and of its reply.

- `required` or a named function: decoding is constrained (engine/structured_output.py) to the call itself, as
  vLLM does without a parser. A named function's output is its arguments, JSON that follows its `parameters`
  schema; `required` writes `[{"name": ..., "parameters": {...}}, ...]`, one or more calls (one with
  `parallel_tool_calls: false`), each name one of the tools and its parameters following that tool's schema.
  `ForcedCalls` reads calls out of that text as it arrives, so a stream sends OpenAI's `delta.tool_calls`
  (id and name first, then argument fragments) while the arguments are generated.
- `auto`: the chat template shows the tools to the model and a parser (the server's `tool_call_parser`, as vLLM's
  `--tool-call-parser`) finds the calls the model wrote; text that is not a call stays content. `hermes`:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro, Qwen 2.5, our SFT template).
- `none`: the template may show the tools; the reply is text.

`plan_tools` checks a request's tools against the template and the tokenizer (a 4xx naming the field: a schema
the grammar library refuses, a tool_choice naming no tool, `auto` with a template that cannot show tools).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from engine.request import StructuredSpec

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parameters_of(function: dict) -> dict:
    """A function's parameters schema (OpenAI: omitted means no arguments)."""
    return function.get("parameters") if function.get("parameters") is not None else NO_ARGUMENTS


def named_spec(function: dict) -> StructuredSpec:
    """A named function's output: its arguments."""
    return StructuredSpec("json_schema", json.dumps(parameters_of(function)))


def required_spec(functions: list[dict], parallel: bool) -> StructuredSpec:
    """`required`: a list of calls; each is one of the tools' names (first, so a stream can send it before the
    arguments: the library writes properties in the schema's order) and that tool's parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": parameters_of(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredSpec("json_schema", json.dumps(schema))


@dataclass
class ToolPlan:
    """How one chat request's replies become tool calls (validation's hand-off to the route)."""

    mode: Literal["named", "required", "auto"]
    names: list[str]  # the request's functions
    parser: str | None = None  # auto: the tool_call_parser

    def calls(self) -> CallStream:
        """A fresh reader for one choice."""
        if self.mode == "named":
            return NamedCall(self.names[0])
        if self.mode == "required":
            return ForcedCalls()
        return PARSERS[self.parser](set(self.names))


# ------------------------------------------------------------------------------------------------- readers
class CallStream:
    """Reads one choice's text as it arrives. `feed` and `close` return the stream's deltas (OpenAI's shapes:
    `{"content": ...}` or `{"tool_calls": [...]}`); afterwards `content` and `tool_calls` hold the whole reply."""

    def __init__(self) -> None:
        self.tool_calls: list[dict] = []
        self.text: list[str] = []

    @property
    def content(self) -> str | None:
        text = "".join(self.text)
        return (text.strip() or None) if self.tool_calls else text

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def close(self) -> list[dict]:
        return []

    def _start(self, name: str, arguments: str = "") -> dict:
        index, cid = len(self.tool_calls), call_id()
        self.tool_calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}})
        return {"tool_calls": [{"index": index, "id": cid, "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def _arguments(self, fragment: str) -> dict:
        self.tool_calls[-1]["function"]["arguments"] += fragment
        return {"tool_calls": [{"index": len(self.tool_calls) - 1, "function": {"arguments": fragment}}]}

    def _content(self, text: str) -> list[dict]:
        self.text.append(text)
        return [{"content": text}] if text else []


class NamedCall(CallStream):
    """A named function: the whole output is the arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[dict]:
        out = [self._start(self.name)] if not self.tool_calls else []
        return out + ([self._arguments(text)] if text else [])

    def close(self) -> list[dict]:
        return [self._start(self.name)] if not self.tool_calls else []


HEAD = re.compile(r'(?:, )?\{"name": "((?:[^"\\]|\\.)*)", "parameters": ')


class ForcedCalls(CallStream):
    """`required`'s output, `[{"name": "f", "parameters": {...}}, ...]` in the grammar's compact JSON, read as it
    arrives: a call starts when its name is complete; its arguments are the characters of the parameters value
    (strings and nesting tracked), sent as they come."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = self.raw = ""
        self.in_args = False
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        self.raw += text
        out: list[dict] = []
        while self.buf:
            if not self.in_args:
                if self.buf[0] in "[]":
                    self.buf = self.buf[1:]
                    continue
                m = HEAD.match(self.buf)
                if m is None:
                    break  # the head is still arriving
                out.append(self._start(json.loads(f'"{m.group(1)}"')))
                self.buf, self.in_args, self.depth = self.buf[m.end():], True, 0
                continue
            taken, ended = self._scan()
            if taken:
                out.append(self._arguments(self.buf[:taken]))
            self.buf = self.buf[taken + ended:]  # the call's closing brace is not an argument
            if ended:
                self.in_args = False
            else:
                break
        return out

    def close(self) -> list[dict]:
        if not self.tool_calls:  # cut off (max_tokens) before a name was complete: the text as it is
            return self._content(self.raw)
        return []

    def _scan(self) -> tuple[int, int]:
        """(characters of the arguments in the buffer, 1 when the call's closing brace follows them)."""
        for i, ch in enumerate(self.buf):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:
                    return i, 1
                self.depth -= 1
        return len(self.buf), 0


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesCalls(CallStream):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in free text (vLLM's `hermes` parser).
    A block becomes a call when it is complete and names one of the tools with object arguments; otherwise it
    stays text. A stream holds back text that may be the start of a tag."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names
        self.buf = ""

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = next((k for k in range(len(OPEN) - 1, 0, -1) if self.buf.endswith(OPEN[:k])), 0)
                out += self._text(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            end = self.buf.find(CLOSE, start)
            if end < 0:
                out += self._text(self.buf[:start])
                self.buf = self.buf[start:]
                return out
            out += self._text(self.buf[:start])
            out += self._block(self.buf[start:end + len(CLOSE)], self.buf[start + len(OPEN):end])
            self.buf = self.buf[end + len(CLOSE):]

    def close(self) -> list[dict]:
        rest, self.buf = self.buf, ""
        if rest.startswith(OPEN):  # cut off (max_tokens) inside a call: a whole one may still be there
            return self._block(rest, rest[len(OPEN):])
        return self._text(rest)

    def _text(self, text: str) -> list[dict]:
        return self._content(text)

    def _block(self, raw: str, inner: str) -> list[dict]:
        try:
            call = json.loads(inner)
        except json.JSONDecodeError:
            return self._text(raw)
        if (not isinstance(call, dict) or call.get("name") not in self.names
                or not isinstance(call.get("arguments", {}), dict)):
            return self._text(raw)
        return [self._start(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))]


PARSERS = {"hermes": HermesCalls}  # the tool_call_parser setting's values (app/config.py) → their readers
