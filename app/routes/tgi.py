"""TGI's routes: /generate, /generate_stream and POST / (huggingface_hub's `text_generation`, the
`text_generation` client), in TGI's exact shapes (router/src/server.rs): POST / answers a non-streaming
request with a list of one result."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from app.errors import error_responses, error_type_of, status_of, stream_error_event
from app.guards import StrictJSONRoute, json_only
from app.openapi import sse_content
from app.protocol.tgi import CompatRequest, GenerateResponse, StreamRequest, TGIRequest
from app.routes import ServiceDep, admit, authorized
from app.service import Service
from app.streaming import answer, sse
from app.validation import Plan, plan_tgi
from engine.output_processor import Failed, PromptOut, RequestState, TokenOut

router = APIRouter(route_class=StrictJSONRoute, tags=["TGI"], dependencies=[Depends(json_only), Depends(authorized)])
ERRORS = error_responses(400, 401, 413, 415, 422, 429, 500, 503, 504)
SSE = sse_content("StreamResponse", "TGIError")


def token_json(t: TokenOut) -> dict:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def top_json(t: TokenOut) -> list[dict]:
    return [{"id": i, "text": s, "logprob": lp, "special": False} for i, s, lp in (t.top or [])]


def details(plan: Plan, tokens: list[TokenOut], stream: bool, prompt: PromptOut | None = None) -> dict:
    fin = tokens[-1].finished
    d = {"finish_reason": fin.finish_reason.value, "generated_tokens": fin.generated_tokens,
         "seed": fin.seed if plan.sampling else None, "input_length": fin.prompt_tokens,
         "prompt_tokens": fin.prompt_tokens}
    if not stream:
        d["prefill"] = ([{"id": t.id, "text": t.text, "logprob": t.logprob} for t in prompt.tokens]
                        if prompt is not None else [])
        d["tokens"] = [token_json(t) for t in tokens]
        if plan.top_n:
            d["top_tokens"] = [top_json(t) for t in tokens]
        d["best_of_sequences"] = None
    return d


async def events(plan: Plan, req: RequestState, prefix: str, path: str) -> AsyncIterator[bytes]:
    tokens: list[TokenOut] = []
    async for item in req.events():
        if isinstance(item, Failed):
            yield sse(stream_error_event(path, status_of(item.kind), item.message, error_type_of(item.kind)))
            return
        tokens.append(item)
        event = {"index": item.index, "token": token_json(item), "generated_text": None, "details": None}
        if plan.top_n:
            event["top_tokens"] = top_json(item)
        if item.finished is not None:
            event["generated_text"] = prefix + item.finished.text
            if plan.details:
                event["details"] = details(plan, tokens, stream=True)
        yield sse(event)


async def run(service: Service, request: Request, body: TGIRequest, stream: bool | None, as_list: bool) -> Response:
    plan, reqs = await admit(service, lambda: plan_tgi(body, service.tokenizer, service.limits, stream),
                             len(body.inputs), offload=bool(body.parameters and body.parameters.grammar))
    prefix = plan.prompt_text if plan.return_full_text else ""
    results = await answer(request.receive, reqs, events(plan, reqs[0][1], prefix, request.url.path)
                           if plan.stream else None, service.settings.sse_ping_s)
    if isinstance(results, Response):
        return results
    items = results[0]
    prompt = items[0] if isinstance(items[0], PromptOut) else None
    tokens = [t for t in items if isinstance(t, TokenOut)]
    result = {"generated_text": prefix + tokens[-1].finished.text}
    if plan.details:
        result["details"] = details(plan, tokens, stream=False, prompt=prompt)
    return JSONResponse([result] if as_list else result)


@router.post("/generate", summary="Generate text (TGI); server-sent events when the body has \"stream\": true",
             responses={200: {"model": GenerateResponse, "content": SSE}, **ERRORS})
async def generate(body: TGIRequest, request: Request, service: ServiceDep) -> Response:
    return await run(service, request, body, None, as_list=False)


@router.post("/generate_stream", summary="Generate text as server-sent events, one per token (TGI)",
             responses={200: {"content": SSE}, **ERRORS}, response_class=Response)
async def generate_stream(body: StreamRequest, request: Request, service: ServiceDep) -> Response:
    return await run(service, request, body, True, as_list=False)


@router.post("/", summary="TGI's compatibility route: a list of one result, or events with \"stream\": true",
             responses={200: {"model": list[GenerateResponse], "content": SSE}, **ERRORS})
async def compat_generate(body: CompatRequest, request: Request, service: ServiceDep) -> Response:
    return await run(service, request, body, None, as_list=True)
