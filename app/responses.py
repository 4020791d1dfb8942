"""The Responses API (`POST /v1/responses`) on top of chat: a request becomes a chat request (instructions a system
message, input items messages, function_call / function_call_output items an assistant's tool_calls and tool
messages, `text.format` a response_format), planned as any chat request (app/validation.py, app/tools.py); the
reply becomes output items: a message with output_text, and function_call items.

`ResponseStore` keeps the last `size` responses' conversations (input + output as chat messages) in this front
process's memory for `previous_response_id`: least recently used dropped, nothing written to disk, lost at a
restart; with several API server processes each has its own store.
`ResponseEvents` turns a reply's deltas into OpenAI's stream events (`response.created`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ..., `response.completed`)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict

from pydantic import ValidationError

from app.errors import ApiError, invalid
from app.protocol.openai import ChatCompletionRequest
from app.protocol.responses import ResponsesRequest

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseStore:
    """The conversations of the last `size` stored responses, by response id (0: none kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, response_id: str) -> list[dict] | None:
        messages = self._items.get(response_id)
        if messages is not None:
            self._items.move_to_end(response_id)
        return messages

    def put(self, response_id: str, messages: list[dict]) -> None:
        if self.size <= 0:
            return
        self._items[response_id] = messages
        while len(self._items) > self.size:
            self._items.popitem(last=False)


# -------------------------------------------------------------------------------------------------- request
def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}.{j}", f"only text parts ({', '.join(TEXT_PARTS)}) are supported, got {kind!r}")
        out.append(part["text"])
    return "".join(out)


def input_messages(value: str | list[dict]) -> list[dict]:
    """`input` → chat messages (as dicts); a 400 naming the item that is not one of ours."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input.{i}"
        if kind == "message":
            if item.get("role") not in ROLES:
                raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
            if bad := next((k for k, v in fields.items() if not isinstance(v, str) or not v), None):
                raise invalid(f"{where}.{bad}", "must be a non-empty string")
            call = {"id": fields["call_id"], "type": "function",
                    "function": {"name": fields["name"], "arguments": fields["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where}.call_id", "must be a string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise invalid(f"{where}.type", f"{kind!r} items are not supported (message, function_call, "
                                           "function_call_output)")
    return messages


def response_format(req: ResponsesRequest) -> dict | None:
    f = req.text.format if req.text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.name is None:
        raise invalid("text.format.name", "is required with type json_schema")
    if f.schema_ is None:
        raise invalid("text.format.schema", "is required with type json_schema")
    return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema_,
                                                   **({"strict": f.strict} if f.strict is not None else {})}}


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request a Responses request asks for, and the conversation (without instructions) to store."""
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tool_choice = req.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    body = {"messages": messages, "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "seed": req.seed, "stream": req.stream, "tool_choice": tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req),
            "tools": [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                      for t in req.tools] if req.tools else None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}), conversation
    except ValidationError as e:  # an input item's text that the chat shapes refuse (e.g. a malformed call id)
        err = e.errors()[0]
        raise invalid("input", f"{err['msg']} ({'.'.join(map(str, err['loc']))})") from None


PARAMS = [(r"^messages(\..*)?$", "input"), (r"^max_completion_tokens$", "max_output_tokens"),
          (r"^response_format\.json_schema\.schema$", "text.format.schema"), (r"^response_format.*$", "text.format"),
          (r"^tools\.(\d+)\.function\.", r"tools.\1."), (r"^tool_choice\.function\.name$", "tool_choice.name"),
          (r"^structured_outputs$", "text.format")]


def renamed(e: ApiError) -> ApiError:
    """A chat field named in an error → the Responses field it came from."""
    if e.param is None:
        return e
    param = e.param
    for pattern, repl in PARAMS:
        param = re.sub(pattern, repl, param)
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return ApiError(e.status, message, e.error_type, e.headers, param=param)


# -------------------------------------------------------------------------------------------------- response
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def output_items(content: str | None, tool_calls: list[dict], incomplete: bool = False) -> list[dict]:
    """The reply's items; the last one `incomplete` when max_output_tokens cut it."""
    items = [message_item(content or "")] if content or not tool_calls else []
    items += [call_item(c) for c in tool_calls]
    if incomplete:
        items[-1]["status"] = "incomplete"
    return items


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later turn continues from."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class ResponseBody:
    """The response object's fields that do not depend on the output (echoed from the request)."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.id, self.created_at, self.req, self.model = new_id("resp"), int(time.time()), req, model

    def __call__(self, status: str, output: list[dict], usage: dict | None = None, incomplete: bool = False,
                 error: dict | None = None) -> dict:
        r = self.req
        tool_choice = r.tool_choice if isinstance(r.tool_choice, str) or r.tool_choice is None else \
            r.tool_choice.model_dump()
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else \
            {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id, "store": r.store is not False,
                "temperature": r.temperature if r.temperature is not None else 1.0,
                "text": {"format": fmt}, "tool_choice": tool_choice or ("auto" if r.tools else "none"),
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
                "top_p": r.top_p if r.top_p is not None else 1.0, "truncation": "disabled",
                "metadata": r.metadata or {}, "usage": usage, "user": r.user}


def responses_usage(n_prompt: int, n_new: int, cached: int) -> dict:
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_new,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_prompt + n_new}


class ResponseEvents:
    """A streamed response: deltas of the reply (OpenAI chat shapes, from app/tools.py's readers or plain text) →
    OpenAI's Responses events, each with its sequence_number; `output` holds the items as they were sent."""

    def __init__(self, body: ResponseBody) -> None:
        self.body = body
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def start(self) -> list[bytes]:
        body = self.body("in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def delta(self, delta: dict) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self.close_item() + self._open_message()
            self.open["content"][0]["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=self._i,
                                  content_index=0, delta=delta["content"], logprobs=[]))
        for tc in delta.get("tool_calls") or []:
            if tc.get("id"):
                out += self.close_item()
                out += self._add(call_item({"id": tc["id"], "function": {"name": tc["function"]["name"],
                                                                         "arguments": ""}}, "in_progress"))
            fragment = tc["function"].get("arguments") or ""
            if fragment:
                self.open["arguments"] += fragment
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=self._i, delta=fragment))
        return out

    @property
    def _i(self) -> int:
        return len(self.output) - 1

    def _open_message(self) -> list[bytes]:
        out = self._add(message_item("", "in_progress"))
        return out + [self.event("response.content_part.added", item_id=self.open["id"], output_index=self._i,
                                 content_index=0, part=self.open["content"][0])]

    def _add(self, item: dict) -> list[bytes]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=self._i, item=item)]

    def close_item(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [self.event("response.output_text.done", item_id=item["id"], output_index=self._i,
                              content_index=0, text=part["text"], logprobs=[]),
                   self.event("response.content_part.done", item_id=item["id"], output_index=self._i,
                              content_index=0, part=part)]
        else:
            out = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self._i,
                              name=item["name"], arguments=item["arguments"])]
        return out + [self.event("response.output_item.done", output_index=self._i, item=item)]

    def finish(self, usage: dict, incomplete: bool) -> list[bytes]:
        out = self.close_item("incomplete" if incomplete else "completed")
        if not self.output:  # an empty reply is still a message
            out += self._open_message() + self.close_item()
        kind = "response.incomplete" if incomplete else "response.completed"
        return out + [self.event(kind, response=self.body("incomplete" if incomplete else "completed", self.output,
                                                          usage, incomplete))]

    def failed(self, message: str, code: str) -> list[bytes]:
        return [self.event("response.failed", response=self.body("failed", self.output,
                                                                 error={"code": code, "message": message}))]
