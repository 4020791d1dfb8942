"""Thin typed routes, one module per API; the serving logic they share lives in `app.service`,
`app.validation` and `app.streaming`.

- `app.routes.tgi`     /generate, /generate_stream, POST /
- `app.routes.openai`  /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize
- `app.routes.responses`  /v1/responses (OpenAI's Responses API, over the chat path)
- `app.routes.ops`     /health, /live, /info, /metrics, the playground page, offline /docs
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from app.service import Service, get_service
from app.validation import Plan

ServiceDep = Annotated[Service, Depends(get_service)]
BIG_PROMPT = 65_536  # characters: plan (tokenize) such prompts off the event loop


async def authorized(request: Request, service: ServiceDep) -> None:
    """Dependency of every route that spends compute: 'Authorization: Bearer <key>' when a key is set (async: no
    thread-pool hop, app.guards.json_only)."""
    service.check_auth(request)


async def admit(service: Service, plan_fn, size: int, offload: bool = False):
    """Validate (the one pass: `plan_fn` builds the Plan) and admit every choice (the error handlers count
    refusals). `offload`: plan off the event loop whatever the size (a grammar to compile)."""
    service.check_open()
    plan: Plan = plan_fn() if size < BIG_PROMPT and not offload else await run_in_threadpool(plan_fn)
    return plan, service.submit(plan)
