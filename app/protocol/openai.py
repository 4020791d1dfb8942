"""OpenAI's request and response shapes: /v1/completions, /v1/chat/completions, /v1/models; and vLLM's
/tokenize and /detokenize. Fields the server cannot honour are accepted only at their neutral value
(the schema says which), unknown fields are ignored, as vLLM does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from app.protocol.common import MAX_INT, STRICT, Seed, StopString, bound, null_only, only_off

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 16  # prompts per /v1/completions request
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_STOP_TOKEN_IDS = 64

TokenId = Annotated[int, Field(ge=0)]
Stop = StopString | Annotated[list[StopString], Field(max_length=64)] | None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = Field(None, description="send a last chunk with the token counts")


class JsonSchemaFormat(BaseModel):
    model_config = {**STRICT, "populate_by_name": True}
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema", description="the JSON schema the output must follow")
    strict: bool | None = Field(None, description="accepted; the output always follows the schema")


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: free text; json_object: any JSON object; json_schema: JSON that follows json_schema.schema")
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = {**STRICT, "populate_by_name": True}
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = Field(None, description="the whole output matches this regex (Rust regex syntax)")
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = Field(
        None, description="the output is exactly one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar, or GBNF (llama.cpp's `root ::= ...`)")
    json_object: bool | None = Field(None, description="true: any JSON object")


class SamplingFields(BaseModel):
    """What both generation requests share."""

    model_config = STRICT

    model: str | None = Field(None, description="ignored: this server serves one model")
    temperature: float | None = Field(None, **bound("temperature"), description="default 1 (sampled); 0: greedy")
    top_p: float | None = Field(None, **bound("top_p"))
    # vLLM's -1 means off, as 0
    top_k: int | None = Field(None, **bound("top_k", ge=-1, le=MAX_INT), description="vLLM extension; -1 or 0: off")
    repetition_penalty: float | None = Field(None, **bound("repetition_penalty"), description="vLLM extension")
    presence_penalty: float | None = Field(None, **bound("presence_penalty"))
    frequency_penalty: float | None = Field(None, **bound("frequency_penalty"))
    n: int | None = Field(None, ge=1, le=MAX_N, description="choices per prompt; choice i uses seed + i")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = Field(None, description="up to the server's GPT_MAX_STOP_SEQUENCES strings")
    seed: Seed = None
    user: str | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(**bound("logit_bias"))]], Field(
        max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) → a bias in [-100, 100] added to its logit before penalties and "
        "temperature; -100 bans the token, 100 forces it")
    ignore_eos: bool | None = Field(None, description="vLLM extension: keep generating after <|endoftext|>")
    min_tokens: int | None = Field(None, **bound("min_tokens", le=MAX_INT), description="vLLM extension: "
                                   "<|endoftext|> and stop_token_ids cannot be generated before this many tokens")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="vLLM extension: generating one of these token ids ends the choice (finish_reason stop; "
        "the token's text is not part of the output)")
    best_of: only_off(int, 1, "only best_of=1 is supported", {"minimum": 1, "maximum": 1}) = None
    response_format: ResponseFormat | None = Field(None, description="constrain the output to JSON (OpenAI)")
    structured_outputs: StructuredOutputs | None = Field(None, description="constrain the output to a JSON schema, "
                                                         "a regex, a grammar or a choice (vLLM)")


class CompletionRequest(SamplingFields):
    # max_tokens 0 only with echo (scoring the prompt): stated in the schema, so clients and schemathesis know
    model_config = {**STRICT, "json_schema_extra": {
        "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
        "then": {"required": ["echo"], "properties": {"echo": {"const": True}}}}}

    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    # 0 (below the table's 1): only with echo, scoring the prompt
    max_tokens: int | None = Field(None, **bound("max_new_tokens", ge=0, le=MAX_INT), description="default 16, as "
                                   "OpenAI's; 0 only with echo: score the prompt, generate nothing (as vLLM)")
    logprobs: int | None = Field(None, ge=0, le=MAX_INT, description="log-probabilities of the chosen token "
                                 "and of this many alternatives (with echo: of the prompt's tokens too)")
    echo: bool | None = Field(None, description="prepend the prompt to the text (with logprobs: and its tokens' "
                              "log-probabilities, the first one null)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_INT, description="vLLM extension: each choice gets "
                                        "`prompt_logprobs`, per prompt token its log-probability, rank and this "
                                        "many alternatives (null for the first token)")
    suffix: only_off(str, "", "suffix is not supported", {"maxLength": 0}) = None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="1-64 letters, digits, _ or -")]
MAX_TOOLS = 128  # functions per request


class FunctionCall(BaseModel):
    model_config = STRICT
    name: FunctionName
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    """An assistant message's call (in the history, as the client got it back)."""

    model_config = STRICT
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=64)] | None = Field(
        None, description="required except in an assistant message with tool_calls")
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="assistant messages: the calls it made")
    tool_call_id: str | None = Field(None, max_length=256, description="tool messages: the call this answers")


class FunctionDef(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of an object (default: no arguments)")
    strict: bool | None = Field(None, description="accepted; calls always follow the schema when forced")


class ChatTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = STRICT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, **bound("max_new_tokens", le=MAX_INT),
                                  description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, **bound("max_new_tokens", le=MAX_INT), description="default: as "
                                              "much as the context and the server's GPT_DEFAULT_MAX_NEW_TOKENS allow")
    logprobs: bool | None = Field(None, description="return the chosen tokens' log-probabilities")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (with logprobs)")
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call (see tool_choice)")
    tool_choice: ToolChoice | None = Field(
        None, description="required / a named function: decoding is constrained to a call that follows the "
        "function's parameters schema; auto (the default with tools): the chat template shows the tools and the "
        "server's tool-call parser finds calls in the reply; none: no calls")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (with tool_choice required)")
    functions: null_only("functions are not supported") = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template (exactly one)."""

    model_config = {**STRICT, "json_schema_extra": {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}}
    model: str | None = None
    prompt: str = None  # type: ignore[assignment]  # absent or a string (null is refused, as the schema says)
    messages: Annotated[list[ChatMessage], Field(max_length=1024)] = None  # type: ignore[assignment]
    add_generation_prompt: bool | None = Field(None, description="with messages: end with the assistant cue "
                                               "(default true)")
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


# ------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens reused from the prefix cache (not computed)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="only when the request has prompt_logprobs (vLLM's shape: token id → its entry)")


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (`data: {...}`, then `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, description="present when the model called tools")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed call: its first chunk has id, type and name (arguments ""), the next ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    """One streamed event (`data: {...}`), then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's class and configuration (what lm-evaluation-harness reads)."""

    model_config = {"extra": "allow"}
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    unk_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
