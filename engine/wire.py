"""Messages between the HTTP fronts and the engine core process: msgspec structs in MessagePack frames.

As vLLM V1's `core_client.py`: the core binds one ZMQ ROUTER socket and every front connects a DEALER with its
own identity, so one socket carries both directions and the core answers each front on its own route. The core
sends each front **one message per engine step** (`Outputs`: every request's new tokens, plus the core's stats).
msgspec is used because it encodes the engine's own dataclasses (`EngineRequest`, `RequestOutput`) directly,
several times faster than json or pickle on these small frames, with typed decoding (a frame of the wrong shape
raises, never half-decodes).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.request import EngineRequest, RequestOutput


# ---------------------------------------------------------------------------------------------- front → core
class Hello(msgspec.Struct, tag="hello"):
    """A front connected; the core answers with Ready once it has warmed up."""


class Add(msgspec.Struct, tag="add"):
    request: EngineRequest


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Classify(msgspec.Struct, tag="classify"):
    call_id: int
    items: list[Any]


class Pause(msgspec.Struct, tag="pause"):
    """Test hook: hold admission and decoding (deadlines are still enforced) until `paused` is false."""

    paused: bool


class Shutdown(msgspec.Struct, tag="shutdown"):
    """End every request still in the core (SHUTDOWN) and exit."""


# ---------------------------------------------------------------------------------------------- core → front
class Ready(msgspec.Struct, tag="ready"):
    info: dict[str, Any]  # device, dtype, parameters, slots, warmup_error, ...


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutput]
    stats: dict[str, Any]


class Classified(msgspec.Struct, tag="classified"):
    call_id: int
    result: list[dict[str, float]] | None = None
    error: str | None = None
    error_kind: str | None = None  # "invalid" (an item the task refuses) or "failed"


ToCore = Hello | Add | Abort | Classify | Pause | Shutdown
ToFront = Ready | Outputs | Classified

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_to_front = msgspec.msgpack.Decoder(ToFront)


def encode(msg: ToCore | ToFront) -> bytes:
    return _encoder.encode(msg)


def decode_to_core(frame: bytes) -> ToCore:
    return _to_core.decode(frame)


def decode_to_front(frame: bytes) -> ToFront:
    return _to_front.decode(frame)
