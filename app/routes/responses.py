"""OpenAI's Responses API: POST /v1/responses (app/responses.py turns it into a chat request and back)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from app.errors import ApiError, error_responses, error_type_of, invalid, status_of
from app.guards import StrictJSONRoute, json_only
from app.openapi import sse_content
from app.protocol.responses import ResponseObject, ResponsesRequest
from app.responses import (
    ResponseBody,
    ResponseEvents,
    chat_request,
    output_items,
    output_messages,
    renamed,
    responses_usage,
)
from app.routes import ServiceDep, admit, authorized
from app.routes.openai import structured
from app.streaming import answer, merged
from app.validation import plan_chat
from engine.output_processor import Failed, RequestState, TokenOut
from engine.stopping import FinishReason

router = APIRouter(route_class=StrictJSONRoute, tags=["OpenAI"], dependencies=[Depends(authorized)])


def usage_of(fin, n_prompt: int) -> dict:
    return responses_usage(n_prompt, fin.generated_tokens, fin.cached_tokens)


@router.post("/v1/responses", summary="OpenAI's Responses API: text or messages in, output items out (chat "
             "underneath: the same template, tools and structured output)",
             responses={200: {"model": ResponseObject, "content": sse_content("ResponseEvent", "OpenAIError")},
                        **error_responses(400, 401, 413, 415, 429, 500, 503, 504, openai=True)},
             dependencies=[Depends(json_only)])
async def responses(body: ResponsesRequest, request: Request, service: ServiceDep) -> Response:
    service.check_open()
    store = service.responses
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id)
        if history is None:
            raise invalid("previous_response_id", f"no stored response {body.previous_response_id!r} (this server "
                                                  f"keeps the last {store.size} responses, in memory)")
    chat, conversation = chat_request(body, history)

    def plan_fn():
        try:
            return plan_chat(chat, service.tokenizer, service.limits, service.chat_template,
                             service.settings.tool_call_parser)
        except ApiError as e:
            raise renamed(e) from None

    size = len(body.input) if isinstance(body.input, str) else len(str(body.input))
    plan, reqs = await admit(service, plan_fn, size, offload=structured(chat) or bool(chat.tools))
    reply = ResponseBody(body, service.model_name())
    n_prompt = len(plan.prompt_ids)
    lstrip = service.chat_template.lstrip_reply
    keep = (lambda output: store.put(reply.id, conversation + output_messages(output))) if body.store is not False \
        else (lambda output: None)
    if plan.stream:
        return await answer(request.receive, reqs, response_events(reply, plan, reqs, lstrip, n_prompt, keep),
                            service.settings.sse_ping_s)
    results = await answer(request.receive, reqs, None, service.settings.sse_ping_s)
    if isinstance(results, Response):
        return results
    fin = results[0][-1].finished
    text = fin.text.lstrip() if lstrip else fin.text
    content, calls = text, []
    if plan.tools:
        reader = plan.tools.calls()
        reader.feed(text)
        reader.close()
        content, calls = reader.content, reader.tool_calls
    incomplete = fin.finish_reason == FinishReason.LENGTH
    output = output_items(content, calls, incomplete)
    keep(output)
    return JSONResponse(reply("incomplete" if incomplete else "completed", output, usage_of(fin, n_prompt),
                              incomplete))


async def response_events(reply: ResponseBody, plan, reqs: list[tuple[int, RequestState]], lstrip: bool,
                          n_prompt: int, keep) -> AsyncIterator[bytes]:
    events = ResponseEvents(reply)
    for e in events.start():
        yield e
    reader = plan.tools.calls() if plan.tools else None
    started = not lstrip
    async for _, item in merged(reqs):
        if isinstance(item, Failed):
            code = error_type_of(item.kind)
            yield events.event("error", code=code, message=item.message, param=None)
            for e in events.failed(item.message, code if status_of(item.kind) < 500 else "server_error"):
                yield e
            return
        assert isinstance(item, TokenOut)
        text = item.text
        if not started:
            text = text.lstrip()
            started = bool(text)
        deltas = reader.feed(text) if reader is not None else [{"content": text}]
        fin = item.finished
        if fin is not None:
            deltas += reader.close() if reader is not None else []
        for d in deltas:
            for e in events.delta(d):
                yield e
        if fin is not None:
            incomplete = fin.finish_reason == FinishReason.LENGTH
            for e in events.finish(usage_of(fin, n_prompt), incomplete):
                yield e
            keep(events.output)
