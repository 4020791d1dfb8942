"""OpenAI's Responses API request (`POST /v1/responses`): the fields this server honours, and those it refuses by
name (hosted tools, background runs, conversations, reasoning, ...: a 400 naming the field). Unknown fields are
ignored, as on the other OpenAI routes. `input` items are checked in app/responses.py, which names the item."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from app.protocol.common import MAX_INT, STRICT, Seed, bound, null_only, only_off
from app.protocol.openai import MAX_TOOLS, FunctionName

MAX_INPUT_ITEMS = 1024


class FunctionTool(BaseModel):
    """The Responses API's function tool (flat: no `function` wrapper). Other tool types are refused."""

    model_config = STRICT
    type: Literal["function"] = Field(description="only function tools (no hosted tools)")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of an object")
    strict: bool | None = Field(None, description="accepted; forced calls always follow the schema")


class FunctionChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    model_config = {**STRICT, "populate_by_name": True}
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=256, description="json_schema: the format's name")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="json_schema: the schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: only_off(str, "medium", "only verbosity medium is supported", {"enum": ["medium", None]}) = None


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str | None = Field(None, description="ignored: this server serves one model")
    input: (Annotated[str, Field(min_length=1)]
            | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]) = Field(
        description="a user message, or a list of items: messages (role, content: text or input_text / "
        "output_text parts), function_call and function_call_output")
    instructions: str | None = Field(None, description="a system message before the input (not carried over "
                                     "by previous_response_id)")
    previous_response_id: str | None = Field(None, max_length=256, description="continue a stored response "
                                             "(the server keeps the last GPT_RESPONSES_STORE ones)")
    store: bool | None = Field(None, description="keep this response for previous_response_id (default true)")
    max_output_tokens: int | None = Field(None, **bound("max_new_tokens", le=MAX_INT))
    temperature: float | None = Field(None, **bound("temperature"))
    top_p: float | None = Field(None, **bound("top_p"))
    seed: Seed = Field(None, description="extension (as vLLM's): same seed, same request → same tokens")
    stream: bool | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    truncation: only_off(str, "disabled", "only truncation disabled is supported",
                         {"enum": ["disabled", None]}) = None
    include: only_off(list, [], "include is not supported", {"maxItems": 0}) = None
    top_logprobs: only_off(int, 0, "top_logprobs is not supported", {"enum": [0, None]}) = None
    background: only_off(bool, False, "background responses are not supported", {"enum": [False, None]}) = None
    max_tool_calls: null_only("max_tool_calls is not supported") = None
    reasoning: null_only("reasoning is not supported") = None
    conversation: null_only("conversations are not supported (use previous_response_id)") = None
    prompt: null_only("prompt templates are not supported") = None
    context_management: null_only("context_management is not supported") = None


# ------------------------------------------------------------------------------------------------ responses
class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(description="cached_tokens: reused from the prefix cache")
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """The response (and, in a stream, the `response` of response.created / .completed / .incomplete / .failed).
    `output`: a `message` item (content: output_text parts) and `function_call` items (call_id, name, arguments)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None = Field(description="{reason: max_output_tokens} when cut")
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    usage: ResponsesUsage | None
    user: str | None


class ResponseEvent(BaseModel):
    """One streamed event (`event: <type>` and `data: {...}`), OpenAI's types: response.created, .in_progress,
    .output_item.added, .content_part.added, .output_text.delta, .output_text.done, .content_part.done,
    .function_call_arguments.delta / .done, .output_item.done, then .completed or .incomplete (or error and
    response.failed)."""

    model_config = {"extra": "allow"}
    type: str
    sequence_number: int
