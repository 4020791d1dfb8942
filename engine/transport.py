"""The core process's side of the fronts' sockets over ZMQ: one ROUTER bound to the core's address, each front a
DEALER identity; one MessagePack frame per message (`engine/wire.py`). The fronts' side is `engine/client.py`."""

from __future__ import annotations

import logging
import os

import zmq

from engine.wire import Shutdown, decode_to_core, encode

log = logging.getLogger("engine")


class ZmqTransport:
    """The core's side of the fronts' sockets: one ROUTER, each front a DEALER identity."""

    def __init__(self, sock, parent_pid: int, ctx=None) -> None:
        self.sock, self.parent_pid, self.ctx = sock, parent_pid, ctx

    @classmethod
    def bind(cls, address: str, parent_pid: int) -> ZmqTransport:
        """A ROUTER bound to `address`; `parent_pid` is the server's, whose exit ends the core."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a front that went away: its frames are dropped, never block
        sock.bind(address)
        return cls(sock, parent_pid, ctx)

    def recv(self, timeout: float) -> list:
        if timeout > 0 and not self.sock.poll(int(timeout * 1000)):
            if os.getppid() != self.parent_pid:  # the server is gone (PDEATHSIG is Linux-only)
                return [(b"", Shutdown())]
            return []
        msgs = []
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append((ident, decode_to_core(frame)))
            except Exception as e:  # noqa: BLE001 - a malformed frame is dropped, never fatal
                log.error("dropped a malformed message from a front: %s", e)

    def send(self, client: bytes, msg) -> None:
        if client:
            self.sock.send_multipart([client, encode(msg)], copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
