"""One validation pass: a request model (already type-checked by FastAPI) becomes a `Plan` — prompts as
token ids, `SamplingParams`, and what the response must echo — or an `ApiError` naming the field.

What pydantic cannot know is checked here, against the loaded model and the server's limits: prompt
length in tokens, room left in the context for the requested tokens, stop sequences, alternatives per
token, token ids within the vocabulary (prompts, logit_bias, stop_token_ids), how many choices one request
may hold, the combinations the engine cannot run (max_tokens 0 without echo, decoder_input_details while
streaming), and structured output: the grammar of `response_format` / `structured_outputs` / TGI's `grammar` is
compiled here (engine/structured_output.py, cached by its text), so a schema or regex the library refuses is a 4xx
naming the field, with its reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from app.errors import invalid
from app.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from app.protocol.tgi import TGIParameters, TGIRequest
from app.tools import ToolPlan, named_spec, required_spec
from engine.params import GREEDY_TEMPERATURE, MAX_SEED, SamplingParams, bad_token, draw_seed
from engine.request import StructuredSpec, context_problem
from engine.structured_output import GrammarError, Grammars
from model.chat_template import ChatTemplate, ChatTemplateError
from model.tokenizer import Tokenizer


@dataclass
class Limits:
    block_size: int
    max_prompt_tokens: int
    max_new_tokens: int  # cap
    default_max_new_tokens: int
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_top_n_tokens: int = 5
    vocab_size: int = 0
    max_choices: int = 1 << 30  # choices one request may hold (slots + queue: more could never be admitted)


@dataclass
class Prompt:
    ids: list[int]
    text: str


@dataclass
class Plan:
    """A validated request: what the engine runs and what the response needs to echo back."""

    prompts: list[Prompt]
    params: SamplingParams
    sampling: bool
    n: int = 1
    top_n: int = 0
    stream: bool = False
    details: bool = False  # TGI details / OpenAI logprobs
    return_full_text: bool = False
    include_usage: bool = False
    # the prompt's log-probabilities: None (off) or the alternatives per token the engine computes
    prompt_logprobs: int | None = None
    vllm_prompt_logprobs: int | None = None  # OpenAI completions' prompt_logprobs field (vLLM's shape in choices)
    decoder_input_details: bool = False  # TGI: details.prefill
    structured: StructuredSpec | None = None  # the grammar every choice's output follows
    tools: ToolPlan | None = None  # chat: how replies become tool calls

    @property
    def echo_logprobs(self) -> bool:
        """OpenAI completions with echo and logprobs: the prompt's tokens lead choices[].logprobs."""
        return self.return_full_text and self.details and self.prompt_logprobs is not None

    @property
    def prompt_ids(self) -> list[int]:  # single-prompt APIs
        return self.prompts[0].ids

    @property
    def prompt_text(self) -> str:
        return self.prompts[0].text

    def choices(self) -> list[tuple[int, Prompt, SamplingParams]]:
        """(choice index, prompt, params): prompt i's j-th choice is index i*n + j, as OpenAI numbers them.
        Choice j is seeded `seed + j` (the plan's seed: the request's, or the one drawn at validation), so one
        seed gives n different, reproducible samples."""
        base = self.params.seed
        return [(i * self.n + j, p, replace(self.params, seed=(base + j) % (MAX_SEED + 1)) if j else self.params)
                for i, p in enumerate(self.prompts) for j in range(self.n)]


# ---------------------------------------------------------------------------------------------- checks
def seed_of(asked: int | None) -> int:
    """The request's seed, or one drawn now: the only place a served request gets a random seed (TGI's
    validation does the same); it is reported back, so any result can be reproduced."""
    return asked if asked is not None else draw_seed()


def check_stop(stop: str | list[str] | None, field_name: str, limits: Limits) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > limits.max_stop_sequences:
        raise invalid(field_name, f"at most {limits.max_stop_sequences} stop sequences are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        where = field_name if isinstance(stop, str) else f"{field_name}.{i}"
        if not 1 <= len(s) <= limits.max_stop_length:
            raise invalid(where, f"must be 1 to {limits.max_stop_length} characters long, got {len(s)}")
    return stops


def check_top_n(n: int | None, field_name: str, limits: Limits) -> int:
    if not n:
        return 0
    if n > limits.max_top_n_tokens:
        raise invalid(field_name, f"must be <= {limits.max_top_n_tokens}")
    return n


def fit_context(n_prompt: int, max_new: int | None, limits: Limits, prompt_field: str, new_field: str,
                default: int | None = None) -> int:
    """Check the prompt and the generation budget against the limits (the context's rule is the engine's,
    engine.request.context_problem); returns max_new_tokens to use."""
    if n_prompt > limits.max_prompt_tokens:
        raise invalid(prompt_field, f"the prompt has {n_prompt} tokens; at most {limits.max_prompt_tokens} "
                                    "are allowed")
    if problem := context_problem(n_prompt, 1, limits.block_size):  # whatever is asked, one token must fit
        raise invalid(prompt_field, problem[1])
    if max_new is None:
        default = limits.default_max_new_tokens if default is None else default
        return max(1, min(default, limits.max_new_tokens, limits.block_size - n_prompt))
    if max_new > limits.max_new_tokens:
        raise invalid(new_field, f"must be <= {limits.max_new_tokens}")
    if problem := context_problem(n_prompt, max_new, limits.block_size, new_name=new_field):
        raise invalid(new_field, problem[1])
    return max_new


def encode(tokenizer: Tokenizer, text: str, field_name: str, chat: bool = False) -> list[int]:
    """chat: `text` is a rendered chat template, whose special tokens (`<|user|>`, ...) are parsed as such, as
    transformers and vLLM tokenize a rendered template."""
    ids = (tokenizer.encode_chat(text) if chat else tokenizer.encode(text)) if text else []
    if not ids:
        raise invalid(field_name, "must not be empty")
    return ids


def check_ids(ids: list[int], field_name: str, limits: Limits) -> list[int]:
    if bad := bad_token(ids, limits.vocab_size):
        raise invalid(f"{field_name}.{bad[0]}", f"token id {bad[1]} is out of range [0, {limits.vocab_size})")
    return ids


def check_logit_bias(bias: dict[str, float] | None, limits: Limits) -> dict[int, float]:
    """OpenAI's logit_bias: keys are token ids written as strings; values were range-checked by the schema."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or str(int(key)) != key:
            raise invalid(f"logit_bias.{key}", "keys must be token ids (integers written as strings, e.g. \"50256\")")
        token = int(key)
        if bad_token([token], limits.vocab_size):
            raise invalid(f"logit_bias.{key}", f"token id {token} is out of range [0, {limits.vocab_size})")
        out[token] = float(value)
    return out


def check_min_tokens(min_tokens: int | None, max_new: int) -> int:
    """min_tokens above max_tokens means what it says, no stop before max_tokens (the rule stated with
    engine.params.BOUNDS); it is reported as max_tokens."""
    return min(min_tokens or 0, max_new)


def check_choices(n_prompts: int, n: int, limits: Limits, field_name: str) -> None:
    if n_prompts * n > limits.max_choices:
        raise invalid(field_name, f"{n_prompts} prompt(s) x n={n} = {n_prompts * n} choices; this server holds at "
                                  f"most {limits.max_choices} at once")


def check_structured(spec: StructuredSpec | None, tokenizer: Tokenizer, field_name: str) -> StructuredSpec | None:
    """Compile the grammar now (cached by its text; the engine compiles it again from its own cache)."""
    if spec is not None:
        try:
            Grammars.for_tokenizer(tokenizer).compile(spec)
        except GrammarError as e:
            raise invalid(field_name, str(e)) from None
    return spec


def schema_text(value, field_name: str) -> str:
    """A JSON schema given as an object or as JSON text → its text."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid(field_name, f"the schema is not valid JSON: {e}") from None
        return value
    return json.dumps(value)


def openai_structured(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> StructuredSpec | None:
    """OpenAI's `response_format` or vLLM's `structured_outputs` (one of them) → a compiled spec, or None."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text":
        if so is not None:
            raise invalid("structured_outputs", "send either response_format or structured_outputs, not both")
        if rf.type == "json_object":
            return check_structured(StructuredSpec("json_object"), tokenizer, "response_format")
        if rf.json_schema is None:
            raise invalid("response_format.json_schema", "is required with type json_schema")
        return check_structured(StructuredSpec("json_schema", schema_text(rf.json_schema.schema_, "response_format")),
                                tokenizer, "response_format.json_schema.schema")
    if so is None:
        return None
    given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
    given += ["json_object"] if so.json_object else []
    if len(given) != 1:
        names = ", ".join(k.rstrip("_") for k in given) or "none"
        raise invalid("structured_outputs", f"give exactly one of json, regex, choice, grammar, json_object "
                                            f"(got {names})")
    key = given[0]
    where = f"structured_outputs.{key.rstrip('_')}"
    if key == "json_":
        spec = StructuredSpec("json_schema", schema_text(so.json_, where))
    elif key == "choice":
        spec = StructuredSpec("choice", json.dumps(so.choice))
    elif key == "json_object":
        spec = StructuredSpec("json_object")
    else:
        spec = StructuredSpec(key, getattr(so, key))
    return check_structured(spec, tokenizer, where)


# ---------------------------------------------------------------------------------------------- TGI
def plan_tgi(req: TGIRequest, tokenizer: Tokenizer, limits: Limits, stream: bool | None = None) -> Plan:
    """TGI's /generate body → Plan. `stream` forces the mode (/generate_stream); else the body's `stream`."""
    p = req.parameters or TGIParameters()
    stream = bool(req.stream) if stream is None else stream
    if p.decoder_input_details and stream:  # TGI's own refusal (PrefillDetailsStream)
        raise invalid("parameters.decoder_input_details", "is not supported when streaming tokens")
    stop = check_stop(p.stop, "parameters.stop", limits)
    top_n = check_top_n(p.top_n_tokens, "parameters.top_n_tokens", limits)
    structured = None
    if p.grammar is not None:
        if p.grammar.type == "json":
            structured = StructuredSpec("json_schema", schema_text(p.grammar.value, "parameters.grammar"))
        elif not isinstance(p.grammar.value, str):
            raise invalid("parameters.grammar", "a regex grammar's value must be a string")
        else:
            structured = StructuredSpec("regex", p.grammar.value)
        check_structured(structured, tokenizer, "parameters.grammar")
    ids = encode(tokenizer, req.inputs, "inputs")
    if p.truncate is not None:
        ids = ids[-p.truncate:]
    max_new = fit_context(len(ids), p.max_new_tokens, limits, "inputs", "parameters.max_new_tokens")

    # TGI: sample when do_sample is set or any warper differs from its neutral value; else greedy.
    # temperature 0 is greedy whatever do_sample says (TGI refuses 0; we accept it).
    warpers = ((p.temperature is not None and p.temperature != 1.0) or bool(p.top_k)
               or (p.top_p is not None and p.top_p < 1.0))
    sampling = bool(p.do_sample or warpers) and not (p.temperature is not None and p.temperature < GREEDY_TEMPERATURE)
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=(p.temperature if p.temperature is not None else 1.0) if sampling else 0.0,
        top_k=p.top_k or 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=seed_of(p.seed), stop=stop)
    # TGI: decoder_input_details implies details
    return Plan([Prompt(ids, req.inputs)], params, sampling, top_n=top_n, stream=stream,
                details=bool(p.details or p.decoder_input_details), return_full_text=bool(p.return_full_text),
                prompt_logprobs=0 if p.decoder_input_details else None,
                decoder_input_details=bool(p.decoder_input_details), structured=structured)


# ---------------------------------------------------------------------------------------------- OpenAI
def _openai_params(req: CompletionRequest | ChatCompletionRequest, max_new: int, stop: list[str],
                   limits: Limits) -> SamplingParams:
    temperature = req.temperature if req.temperature is not None else 1.0
    return SamplingParams(
        max_new_tokens=max_new, temperature=temperature,
        top_k=req.top_k if req.top_k and req.top_k > 0 else 0,
        top_p=req.top_p if req.top_p is not None else 1.0,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        seed=seed_of(req.seed), stop=stop, stop_at_eos=not req.ignore_eos,
        logit_bias=check_logit_bias(req.logit_bias, limits),
        min_tokens=check_min_tokens(req.min_tokens, max_new),
        stop_token_ids=check_ids(list(req.stop_token_ids or []), "stop_token_ids", limits))


def plan_completion(req: CompletionRequest, tokenizer: Tokenizer, limits: Limits) -> Plan:
    if req.max_tokens == 0 and not req.echo:
        raise invalid("max_tokens", "must be >= 1; 0 only with echo (score the prompt, generate nothing)")
    stop = check_stop(req.stop, "stop", limits)
    top_n = check_top_n(req.logprobs, "logprobs", limits)
    prompt_logprobs = top_n if req.echo and req.logprobs is not None else None  # the echoed prompt's entries
    vllm_prompt_logprobs = None
    if req.prompt_logprobs is not None:
        vllm_prompt_logprobs = check_top_n(req.prompt_logprobs, "prompt_logprobs", limits)
        prompt_logprobs = max(prompt_logprobs or 0, vllm_prompt_logprobs)
    structured = openai_structured(req, tokenizer)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [Prompt(encode(tokenizer, prompt, "prompt"), prompt)]
    elif all(isinstance(x, str) for x in prompt):
        prompts = [Prompt(encode(tokenizer, s, f"prompt.{i}"), s) for i, s in enumerate(prompt)]
    elif all(isinstance(x, int) for x in prompt):
        ids = check_ids(list(prompt), "prompt", limits)
        prompts = [Prompt(ids, tokenizer.decode(ids))]
    else:
        prompts = [Prompt(ids := check_ids(list(x), f"prompt.{i}", limits), tokenizer.decode(ids))
                   for i, x in enumerate(prompt)]
    n = req.n or 1
    check_choices(len(prompts), n, limits, "n")
    max_new = None
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        m = fit_context(len(p.ids), req.max_tokens, limits, where, "max_tokens", default=16)  # OpenAI's default
        max_new = m if max_new is None else min(max_new, m)
    temperature = req.temperature if req.temperature is not None else 1.0
    return Plan(prompts, _openai_params(req, max_new, stop, limits), sampling=temperature >= GREEDY_TEMPERATURE,
                n=n, top_n=top_n,
                stream=bool(req.stream), details=req.logprobs is not None, return_full_text=bool(req.echo),
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                prompt_logprobs=prompt_logprobs, vllm_prompt_logprobs=vllm_prompt_logprobs, structured=structured)


def message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    return m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)


def message_dict(m: ChatMessage, i: int) -> dict:
    """A message as chat templates read it (transformers' shape): a call's arguments as an object."""
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise invalid(f"messages.{i}.content", "is required (except in an assistant message with tool_calls)")
    if m.tool_calls and m.role != "assistant":
        raise invalid(f"messages.{i}.tool_calls", "only assistant messages carry tool calls")
    out: dict = {"role": m.role, "content": message_text(m), **({"name": m.name} if m.name else {})}
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            try:
                args = json.loads(c.function.arguments)
            except json.JSONDecodeError as e:
                raise invalid(f"messages.{i}.tool_calls.{j}.function.arguments", f"is not JSON: {e}") from None
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    return out


def render_chat(messages: list[ChatMessage], template: ChatTemplate, add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    rendered = [message_dict(m, i) for i, m in enumerate(messages)]
    if not template.renders_tools:
        bad = next((i for i, m in enumerate(messages) if m.role == "tool" or m.tool_calls), None)
        if bad is not None:
            raise invalid(f"messages.{bad}", f"the chat template ({template.origin}) cannot render tool calls or "
                                             "tool results")
        tools = None
    try:
        return template.render(rendered, add_generation_prompt=add_generation_prompt, tools=tools)
    except ChatTemplateError as e:
        raise invalid("messages", str(e)) from None


def plan_tools(req: ChatCompletionRequest, tokenizer: Tokenizer, template: ChatTemplate, parser: str | None
               ) -> tuple[ToolPlan | None, StructuredSpec | None]:
    """The request's tools → how replies become calls, and the grammar of a forced call (required / named).
    Each tool's schema is compiled alone first, so a bad one is refused naming that tool."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return None, None
    names = [t.function.name for t in tools]
    if dup := next((n for i, n in enumerate(names) if n in names[:i]), None):
        raise invalid("tools", f"two functions are named {dup!r}")
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    for i, f in enumerate(functions):
        if f.get("parameters") is not None:
            if f["parameters"].get("type", "object") != "object":
                raise invalid(f"tools.{i}.function.parameters", "must be the JSON schema of an object")
            check_structured(named_spec(f), tokenizer, f"tools.{i}.function.parameters")
    choice = choice if choice is not None else "auto"
    if choice == "none":
        return None, None
    if choice == "auto":
        if parser is None or parser == "none":
            raise invalid("tool_choice", "auto needs a tool-call parser and this server has none "
                                         "(GPT_TOOL_CALL_PARSER=none); use required or a named function")
        if not template.renders_tools:
            raise invalid("tool_choice", f"auto: the chat template ({template.origin}) cannot show tools to the "
                                         "model; use required or a named function")
        return ToolPlan("auto", names, parser), None
    if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs is not None:
        raise invalid("tool_choice", "a forced tool call cannot be combined with response_format or "
                                     "structured_outputs")
    if choice == "required":
        spec = required_spec(functions, req.parallel_tool_calls is not False)
        return ToolPlan("required", names), check_structured(spec, tokenizer, "tools")
    if choice.function.name not in names:
        raise invalid("tool_choice.function.name", f"no tool is named {choice.function.name!r} "
                                                   f"(the tools: {', '.join(names)})")
    function = functions[names.index(choice.function.name)]
    return ToolPlan("named", [function["name"]]), named_spec(function)


def plan_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, limits: Limits, template: ChatTemplate,
              tool_parser: str | None = None) -> Plan:
    stop = check_stop(req.stop, "stop", limits) + [s for s in template.stop if s not in (req.stop or [])]
    top_n = check_top_n(req.top_logprobs, "top_logprobs", limits)
    top_n = top_n if req.logprobs else 0  # top_logprobs counts only with logprobs (OpenAI's rule)
    tools, forced = plan_tools(req, tokenizer, template, tool_parser)
    structured = forced or openai_structured(req, tokenizer)
    shown = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    text = render_chat(req.messages, template, tools=shown)
    ids = encode(tokenizer, text, "messages", chat=True)
    n = req.n or 1
    check_choices(1, n, limits, "n")
    if req.max_completion_tokens is not None and req.max_tokens is not None and req.max_tokens > limits.max_new_tokens:
        raise invalid("max_tokens", f"must be <= {limits.max_new_tokens}")  # ignored, but still checked
    asked, name = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                   else (req.max_tokens, "max_tokens"))
    max_new = fit_context(len(ids), asked, limits, "messages", name)
    temperature = req.temperature if req.temperature is not None else 1.0
    return Plan([Prompt(ids, text)], _openai_params(req, max_new, stop, limits),
                sampling=temperature >= GREEDY_TEMPERATURE,
                n=n, top_n=top_n,
                stream=bool(req.stream), details=bool(req.logprobs),
                include_usage=bool(req.stream_options and req.stream_options.include_usage), structured=structured,
                tools=tools)
