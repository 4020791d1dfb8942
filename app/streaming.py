"""Responses that follow running generations: server-sent events and whole-result collection, sharing one
disconnect watcher (a client that goes away cancels its requests at once, freeing their KV-cache slots).

Why not sse-starlette or FastAPI's own SSE: both run each stream through anyio task groups and memory
streams, and sse-starlette ends every stream on the first SIGTERM (it hooks uvicorn's exit), where this
server drains: streams finish, or end with an error event when the drain times out. Per-token work on the
event loop competes with the engine thread for the GIL (bench/stack.py), so this is one task per stream
plus a sleeping keep-alive task: a `: ping` comment after `PING_S` seconds without an event, so proxies
and clients do not time out during a long queue wait.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import ApiError, error_type_of, status_of
from engine.output_processor import Failed, RequestState, TokenOut

PING_S = 15.0
DONE = b"data: [DONE]\n\n"

Item = TokenOut | Failed


def sse(data: dict | str, prefix: str = "data:") -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{prefix}{payload}\n\n".encode()


async def watch_disconnect(receive: Receive, reqs: list[RequestState], gone: Callable[[], None] | None = None
                           ) -> None:
    """Wait for the client to go away, then cancel its requests (the engine frees the slots next step)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if gone is not None:
                gone()
            for r in reqs:
                if not r.closed:
                    r.disconnect()
            return


async def merged(reqs: list[tuple[int, RequestState]]) -> AsyncIterator[tuple[int, Item]]:
    """(choice index, item) from several requests as they arrive; one request is passed straight through."""
    if len(reqs) == 1:
        index, r = reqs[0]
        async for item in r.events():
            yield index, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, r: RequestState) -> None:
        try:
            async for item in r.events():
                queue.put_nowait((index, item))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in reqs]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for t in tasks:
            t.cancel()


class ClientGone(Exception):
    """The client disconnected before the result was complete."""


async def collect(receive: Receive, reqs: list[tuple[int, RequestState]]) -> dict[int, list[TokenOut]]:
    """Wait for whole generations: {choice index: tokens}. Failed → its ApiError; a disconnect → ClientGone."""
    watcher = asyncio.create_task(watch_disconnect(receive, [r for _, r in reqs]))
    out: dict[int, list[TokenOut]] = {i: [] for i, _ in reqs}
    try:
        async for index, item in merged(reqs):
            if isinstance(item, Failed):
                raise ApiError(status_of(item.kind), item.message, error_type_of(item.kind), started=True)
            out[index].append(item)
        if any(not toks or toks[-1].finished is None for toks in out.values()):
            raise ClientGone()
        return out
    finally:
        watcher.cancel()
        for _, r in reqs:
            if not r.closed:
                r.cancel()


async def answer(receive: Receive, reqs: list[tuple[int, RequestState]], stream: AsyncIterator[bytes] | None,
                 ping_s: float = PING_S) -> StreamingResponse | Response | dict[int, list[TokenOut]]:
    """The two ways a route answers: a stream of `stream`'s events when given, else the whole results
    ({choice index: tokens}), or a bare 499 when the client left first."""
    if stream is not None:
        return EventStream(stream, [r for _, r in reqs], ping_s)
    try:
        return await collect(receive, reqs)
    except ClientGone:
        return Response(status_code=499)


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator of encoded events, for the given requests."""

    def __init__(self, events: AsyncIterator[bytes], reqs: list[RequestState], ping_s: float = PING_S) -> None:
        super().__init__(events, status_code=200, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events, self.reqs, self.ping_s = events, reqs, ping_s
        self.gone = False
        self.last_sent = 0.0

    def _gone(self) -> None:
        self.gone = True

    async def _ping(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wait = self.last_sent + self.ping_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self.last_sent = loop.time()
            await send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.last_sent = loop.time()
        watcher = asyncio.create_task(watch_disconnect(receive, self.reqs, self._gone))
        pinger = asyncio.create_task(self._ping(send)) if self.ping_s else None
        try:
            async for chunk in self.events:
                if self.gone:
                    break
                self.last_sent = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self.gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke while sending
            self._gone()
        finally:
            watcher.cancel()
            if pinger is not None:
                pinger.cancel()
            for r in self.reqs:
                if not r.closed:
                    r.cancel()
            await self.events.aclose()
