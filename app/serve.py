"""One HTTP front under uvicorn that drains before it stops: the runner `python -m app` (app/__main__.py) and each
front process of app/launcher.py call.

SIGTERM / SIGINT drain: new requests get 503 and /health turns 503, in-flight requests finish (for at most
GPT_SHUTDOWN_TIMEOUT_S), then the front exits 0. A second signal exits at once. If the engine core dies, every
open stream gets its final error event, /live turns 503 and the front exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

import uvicorn

from app.server import create_app
from app.service import CoreHandle, Service

log = logging.getLogger("app")


class DrainingServer(uvicorn.Server):
    """uvicorn that drains before it stops: the listener stays open so new requests get a clean 503."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self._drain_started = False
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        service.on_engine_dead = self.engine_died

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def engine_died(self, reason: str) -> None:
        """(On the event loop.) The core is gone: the streams already got their final error events; exit 1 so
        compose / Kubernetes restart the server. If uvicorn's shutdown hangs, exit anyway."""
        self.exit_code = 1
        self.service.begin_drain()
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, setattr, self, "should_exit", True)
        loop.call_later(10.0, os._exit, 1)

    def handle_exit(self, sig, frame) -> None:
        if self._drain_started:
            # A second signal: the operator wants out now. Exit at once with status 0; os._exit skips the
            # interpreter teardown that would otherwise abort while the engine thread is inside torch
            # ("terminate called without an active exception", SIGABRT).
            log.warning("second signal during the drain: exiting now, abandoning %d requests in flight",
                        self.service.engine.n_in_flight if self.service.engine else 0)
            core = self.service.core
            if core is not None and core.process is not None:
                core.process.abandon()
            logging.shutdown()
            sys.stderr.flush()
            os._exit(0)
        if not self.started:  # not serving yet: stop now
            self.should_exit = True
            return
        self._drain_started = True
        self.service.begin_drain()
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        # Past the timeout the service stops the engine, which ends every open request with an error item:
        # each stream sends its final error event (and [DONE] on OpenAI streams) and closes normally, so
        # uvicorn finds no open response to cut and nothing logs a traceback.
        done = asyncio.run_coroutine_threadsafe(self.service.drain(self.service.settings.shutdown_timeout_s),
                                                self.loop)
        if not done.result():
            time.sleep(0.2)  # let the streams write their last event
        self.should_exit = True  # uvicorn closes the listener, waits for open responses, runs the lifespan shutdown



def serve(settings, loaded=None, core: CoreHandle | None = None, front_index: int = 0, sockets=None) -> int:
    """One HTTP front under uvicorn (draining on SIGTERM); its exit code."""
    app = create_app(settings, loaded=loaded, core=core, front_index=front_index)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            lifespan="on", timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout_s)))
    server = DrainingServer(config, app.state.service)
    server.run(sockets=sockets)
    if not server.started:
        return 1
    return server.exit_code
