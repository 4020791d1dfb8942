"""OpenAI's routes (/v1/completions, /v1/chat/completions, /v1/models) and vLLM's /tokenize and
/detokenize. Errors here are OpenAI's error object, so the SDK's exceptions carry message and param."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from app.errors import error_responses, error_type_of, invalid, status_of, stream_error_event
from app.guards import StrictJSONRoute, json_only
from app.openapi import sse_content
from app.protocol.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from app.routes import ServiceDep, admit, authorized
from app.streaming import DONE, answer, merged, sse
from app.tools import CallStream
from app.validation import Plan, check_ids, plan_chat, plan_completion, render_chat
from engine.output_processor import Failed, PromptOut, PromptToken, RequestState, TokenOut
from engine.stopping import FinishReason

router = APIRouter(route_class=StrictJSONRoute, tags=["OpenAI"], dependencies=[Depends(authorized)])
ERRORS = error_responses(400, 401, 413, 415, 429, 500, 503, 504, openai=True)


def structured(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """The request asks for a grammar: validation compiles it (off the event loop)."""
    return body.structured_outputs is not None or (body.response_format is not None
                                                   and body.response_format.type != "text")


def finish(reason: FinishReason) -> str:
    return "length" if reason == FinishReason.LENGTH else "stop"


def usage(n_prompt: int, n_new: int, cached: int = 0) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new,
            "prompt_tokens_details": {"cached_tokens": cached}}


def total_usage(results: dict[int, list[PromptOut | TokenOut]], plan: Plan) -> dict:
    """Prompt tokens once per prompt (as OpenAI counts them), completion tokens over all choices; cached tokens
    (reused from the prefix cache) once per prompt too, as its first choice found them."""
    n_prompt = sum(len(p.ids) for p in plan.prompts)
    cached = sum(results[i * plan.n][-1].finished.cached_tokens for i in range(len(plan.prompts))
                 if i * plan.n in results)
    return usage(n_prompt, sum(toks[-1].finished.generated_tokens for toks in results.values()), cached)


@dataclass
class Reply:
    """What every answer of one OpenAI request shares: the envelope (id, object, created, model), and how its
    stream ends (an error event then [DONE]; or the usage chunk, when asked, then [DONE])."""

    object: str  # "text_completion" | "chat.completion" | "chat.completion.chunk"
    id: str
    model: str
    plan: Plan
    path: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def chunk(self, choice: dict) -> bytes:
        return sse(self.body([choice], **({"usage": None} if self.plan.include_usage else {})), "data: ")

    def failed(self, item: Failed) -> list[bytes]:
        event = stream_error_event(self.path, status_of(item.kind), item.message, error_type_of(item.kind))
        return [sse(event, "data: "), DONE]

    def end(self, finished: dict[int, list[TokenOut]], n_choices: int) -> list[bytes]:
        if len(finished) < n_choices:
            return []  # the client went away
        if not self.plan.include_usage:
            return [DONE]
        return [sse(self.body([], usage=total_usage(finished, self.plan)), "data: "), DONE]


# -------------------------------------------------------------------------------------- completions
def prompt_entries(tokens: list[PromptToken], top_n: int, lp: dict | None = None) -> dict:
    """The echoed prompt's entries of choices[].logprobs (as vLLM: the first token's logprob and top_logprobs
    are null; top_logprobs holds the token itself and the top_n most likely), offsets from 0."""
    lp = lp or {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    offset = 0
    for t in tokens:
        lp["tokens"].append(t.text)
        lp["token_logprobs"].append(t.logprob)
        lp["text_offset"].append(offset)
        offset += len(t.text)
        if t.logprob is None:
            lp["top_logprobs"].append(None)
            continue
        top = {t.text: t.logprob}
        for _, s, v in (t.top or [])[:top_n]:
            top[s] = max(v, top.get(s, float("-inf")))
        lp["top_logprobs"].append(top)
    return lp


def vllm_prompt_logprobs(tokens: list[PromptToken], top_n: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token {token id: {logprob, rank,
    decoded_token}} for the token itself and its top_n alternatives; null for the first token."""
    out: list[dict | None] = []
    for t in tokens:
        if t.logprob is None:
            out.append(None)
            continue
        entry = {str(t.id): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.text}}
        for rank, (i, s, v) in enumerate((t.top or [])[:top_n], 1):
            entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": s})
        out.append(entry)
    return out


def completion_logprobs(tokens: list[TokenOut], offset: int, lp: dict | None = None) -> dict:
    lp = lp or {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    for t in tokens:
        lp["tokens"].append(t.text)
        lp["token_logprobs"].append(t.logprob)
        lp["text_offset"].append(offset)
        offset += len(t.text) if not t.special else 0
        if t.top:
            top: dict[str, float] = {}
            for _, s, v in t.top:
                top[s] = max(v, top.get(s, float("-inf")))
            lp["top_logprobs"].append(top)
        else:
            lp["top_logprobs"].append(None)
    return lp


@router.post("/v1/completions", summary="OpenAI-compatible text completion (a prompt or a list of them; n choices)",
             responses={200: {"model": CompletionResponse,
                              "content": sse_content("CompletionResponse", "OpenAIError", done=True)}, **ERRORS},
             dependencies=[Depends(json_only)])
async def completions(body: CompletionRequest, request: Request, service: ServiceDep) -> Response:
    size = len(body.prompt) if isinstance(body.prompt, str) else sum(
        len(p) if isinstance(p, (str, list)) else 1 for p in body.prompt)
    plan, reqs = await admit(service, lambda: plan_completion(body, service.tokenizer, service.limits), size,
                             offload=structured(body))
    reply = Reply("text_completion", f"cmpl-{uuid.uuid4().hex}", service.model_name(), plan, request.url.path)
    prompt_of = {i * plan.n + j: p.text for i, p in enumerate(plan.prompts) for j in range(plan.n)}
    results = await answer(request.receive, reqs, completion_events(reply, reqs, prompt_of) if plan.stream else None,
                           service.settings.sse_ping_s)
    if isinstance(results, Response):
        return results
    choices = []
    for index in sorted(results):
        items = results[index]
        prompt = items[0] if isinstance(items[0], PromptOut) else None
        tokens = [t for t in items if isinstance(t, TokenOut)]
        fin = items[-1].finished
        prefix = prompt_of[index] if plan.return_full_text else ""
        logprobs = None
        if plan.details:
            lp = prompt_entries(prompt.tokens, plan.top_n) if plan.echo_logprobs and prompt else None
            logprobs = completion_logprobs(tokens, len(prefix), lp)
        choice = {"index": index, "text": prefix + fin.text, "logprobs": logprobs,
                  "finish_reason": finish(fin.finish_reason)}
        if plan.vllm_prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt.tokens if prompt else [], plan.vllm_prompt_logprobs)
        choices.append(choice)
    return JSONResponse(reply.body(choices, usage=total_usage(results, plan)))


async def completion_events(reply: Reply, reqs: list[tuple[int, RequestState]], prompt_of: dict[int, str]
                            ) -> AsyncIterator[bytes]:
    plan = reply.plan

    def chunk(index: int, text: str, logprobs, reason: str | None) -> bytes:
        return reply.chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})

    offsets = {index: 0 for index, _ in reqs}
    if plan.return_full_text and not plan.echo_logprobs:  # else the echo waits for the prompt's log-probabilities
        for index, _ in reqs:
            yield chunk(index, prompt_of[index], None, None)
            offsets[index] = len(prompt_of[index])
    done: dict[int, list[PromptOut | TokenOut]] = {}
    async for index, item in merged(reqs):
        if isinstance(item, Failed):
            for event in reply.failed(item):
                yield event
            return
        if isinstance(item, PromptOut):  # the prompt's entries come first, in one chunk
            fin = item.finished
            text, lp = "", None
            if plan.echo_logprobs:
                text, lp = prompt_of[index], prompt_entries(item.tokens, plan.top_n)
                offsets[index] = len(text)
            choice = {"index": index, "text": text, "logprobs": lp,
                      "finish_reason": finish(fin.finish_reason) if fin else None}
            if plan.vllm_prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(item.tokens, plan.vllm_prompt_logprobs)
            if text or fin or plan.vllm_prompt_logprobs is not None:
                yield reply.chunk(choice)
            if fin is not None:
                done[index] = [item]
            continue
        lp = None
        if plan.details:
            lp = completion_logprobs([item], offsets[index])
            offsets[index] += len(item.text)
        fin = item.finished
        yield chunk(index, item.text, lp, finish(fin.finish_reason) if fin else None)
        if fin is not None:
            done[index] = [item]
    for event in reply.end(done, len(reqs)):
        yield event


# -------------------------------------------------------------------------------------------- chat
def chat_logprobs(tokens: list[TokenOut]) -> dict:
    out = []
    for t in tokens:
        top = [{"token": s, "logprob": v, "bytes": list(s.encode())} for _, s, v in (t.top or [])]
        out.append({"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()), "top_logprobs": top})
    return {"content": out}


def chat_finish(reason: FinishReason, calls: CallStream | None) -> str:
    """A reply that called tools ends with tool_calls, unless max_tokens cut it."""
    if calls is not None and calls.tool_calls and reason != FinishReason.LENGTH:
        return "tool_calls"
    return finish(reason)


@router.post("/v1/chat/completions", summary="OpenAI-compatible chat: messages through the checkpoint's chat "
             "template (or the You:/Model: transcript); tools",
             responses={200: {"model": ChatCompletionResponse,
                              "content": sse_content("ChatCompletionChunk", "OpenAIError", done=True)}, **ERRORS},
             dependencies=[Depends(json_only)])
async def chat_completions(body: ChatCompletionRequest, request: Request, service: ServiceDep) -> Response:
    size = sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or [])
               for m in body.messages)
    plan, reqs = await admit(service, lambda: plan_chat(body, service.tokenizer, service.limits, service.chat_template,
                                                         service.settings.tool_call_parser), size,
                             offload=structured(body) or bool(body.tools))
    cid, path = f"chatcmpl-{uuid.uuid4().hex}", request.url.path
    lstrip = service.chat_template.lstrip_reply
    stream = (chat_events(Reply("chat.completion.chunk", cid, service.model_name(), plan, path), reqs, lstrip)
              if plan.stream else None)
    results = await answer(request.receive, reqs, stream, service.settings.sse_ping_s)
    if isinstance(results, Response):
        return results
    choices = []
    for index in sorted(results):
        tokens = results[index]
        fin = tokens[-1].finished
        text = fin.text.lstrip() if lstrip else fin.text
        message: dict = {"role": "assistant", "content": text}
        calls = plan.tools.calls() if plan.tools else None
        if calls is not None:
            calls.feed(text)
            calls.close()
            message["content"] = calls.content
            if calls.tool_calls:
                message["tool_calls"] = calls.tool_calls
        choices.append({"index": index, "message": message,
                        "logprobs": chat_logprobs(tokens) if plan.details else None,
                        "finish_reason": chat_finish(fin.finish_reason, calls)})
    reply = Reply("chat.completion", cid, service.model_name(), plan, path)
    return JSONResponse(reply.body(choices, usage=total_usage(results, plan)))


async def chat_events(reply: Reply, reqs: list[tuple[int, RequestState]], lstrip: bool
                      ) -> AsyncIterator[bytes]:
    plan = reply.plan

    def chunk(index: int, delta: dict, logprobs, reason: str | None) -> bytes:
        return reply.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})

    for index, _ in reqs:
        yield chunk(index, {"role": "assistant", "content": ""}, None, None)
    started = {index: not lstrip for index, _ in reqs}  # the transcript's reply starts after "Model:" + space
    readers = {index: plan.tools.calls() for index, _ in reqs} if plan.tools else {}
    done: dict[int, list[TokenOut]] = {}
    async for index, item in merged(reqs):
        if isinstance(item, Failed):
            for event in reply.failed(item):
                yield event
            return
        text = item.text
        if not started[index]:
            text = text.lstrip()
            started[index] = bool(text)
        fin = item.finished
        logprobs = chat_logprobs([item]) if plan.details else None
        calls = readers.get(index)
        if calls is None:  # every token its chunk (the last one's text may be empty: it completed a stop string)
            deltas = [{"content": text}] if text or fin is None else []
        else:
            deltas = calls.feed(text)
        if fin is not None:
            done[index] = [item]
            deltas += calls.close() if calls is not None else []
        if not deltas and (fin is not None or logprobs is not None):
            deltas = [{}]  # nothing released (a stop string, a held-back tag), but the end or the token's logprobs
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            yield chunk(index, delta, logprobs if k == 0 else None,
                        chat_finish(fin.finish_reason, calls) if fin is not None and last else None)
    for event in reply.end(done, len(reqs)):
        yield event


# ------------------------------------------------------------------------------------------ models
@router.get("/v1/models", summary="The served model (OpenAI)", response_model=ModelList,
            responses=error_responses(401, openai=True))
async def models(service: ServiceDep) -> dict:
    return {"object": "list", "data": [
        {"id": service.model_name(), "object": "model", "created": int(service.started_at),
         "owned_by": "gpt-serve", "max_model_len": service.limits.block_size if service.limits else None}]}


# -------------------------------------------------------------------------------------- tokenizer
@router.post("/tokenize", summary="Token ids of a prompt, or of chat messages after the chat template (vLLM)",
             response_model=TokenizeResponse, responses=error_responses(400, 401, 413, 415, 503, openai=True),
             dependencies=[Depends(json_only)])
async def tokenize(body: TokenizeRequest, service: ServiceDep) -> dict:
    service.check_open()
    if body.messages is not None and body.prompt is not None:
        raise invalid("messages", "send either prompt or messages, not both")
    if body.messages is not None:
        gen_prompt = body.add_generation_prompt is not False
        text = render_chat(body.messages, service.chat_template, gen_prompt)
    elif body.prompt is not None:
        text = body.prompt
    else:
        raise invalid("prompt", "is required (or messages)")
    # add_special_tokens (vLLM's, default true) adds nothing here: like GPT-2's, these tokenizers add no BOS/EOS
    tok = service.tokenizer
    ids = (tok.encode_chat(text) if body.messages is not None else tok.encode(text)) if text else []
    return {"count": len(ids), "max_model_len": service.limits.block_size, "tokens": ids}


@router.get("/tokenizer_info", summary="The tokenizer's class, special tokens and chat template (vLLM)",
            response_model=TokenizerInfo, responses=error_responses(401, 503, openai=True))
async def tokenizer_info(service: ServiceDep) -> dict:
    service.check_open()
    tok = service.tokenizer
    eos = service.eos_text() or None
    template = service.chat_template
    # the same configuration model.export_hf writes into tokenizer_config.json
    return {"tokenizer_class": "GPT2Tokenizer", "eos_token": eos, "bos_token": eos, "unk_token": eos,
            "pad_token": None, "chat_template": template.source if template is not None else None,
            "model_max_length": service.limits.block_size, "add_bos_token": False, "add_prefix_space": False,
            "clean_up_tokenization_spaces": False, "vocab_size": tok.vocab_size, "eos_token_id": tok.eot_id,
            "bos_token_id": tok.eot_id}


@router.post("/detokenize", summary="Text of token ids (vLLM)", response_model=DetokenizeResponse,
             responses=error_responses(400, 401, 413, 415, 503, openai=True), dependencies=[Depends(json_only)])
async def detokenize(body: DetokenizeRequest, service: ServiceDep) -> dict:
    service.check_open()
    ids = check_ids(body.tokens, "tokens", service.limits)
    return {"prompt": service.tokenizer.decode(ids)}
