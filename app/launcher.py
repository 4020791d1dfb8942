"""Several HTTP fronts on one engine core (GPT_API_SERVERS=N, vLLM's --api-server-count): a machine's cores serve
SSE in parallel while one process owns the model.

This process binds the port once, starts the core process (already done by `python -m app`), then N front
processes (spawned) that share the listening socket and each connect to the core; the kernel hands each new
connection to one of them. Request counters and histograms go through prometheus-client's multiprocess mode
(a private PROMETHEUS_MULTIPROC_DIR), so any front's /metrics adds them all up.

Supervision: SIGTERM is passed on to the fronts, which drain and exit 0; then the core is stopped and this exits 0.
(A terminal's Ctrl-C already reaches every process of the group: the fronts drain, the core ignores it.) If the
core or any front dies, the others are stopped and this exits 1, so compose / Kubernetes restart the whole server.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
from multiprocessing.connection import wait

log = logging.getLogger("app")


def _front_main(settings, index: int, core_args: tuple, sock: socket.socket) -> None:
    from app.serve import serve
    from app.service import CoreHandle

    code = serve(settings, core=CoreHandle(*core_args), front_index=index, sockets=[sock])
    raise SystemExit(code)


def run_fronts(settings, core) -> int:
    """Serve with `settings.api_servers` front processes on the started `core` (a CoreHandle); the exit code."""
    n = settings.api_servers
    prom_dir = tempfile.mkdtemp(prefix="gpt-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir  # before the fronts import prometheus_client
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    code = 0
    fronts: list[mp.Process] = []
    try:
        try:
            sock.bind((settings.host, settings.port))
        except OSError as e:
            print(f"error: cannot listen on {settings.host}:{settings.port}: {e.strerror}", flush=True)
            return 1
        sock.listen(2048)
        sock.set_inheritable(True)
        ctx = mp.get_context("spawn")
        core_args = (core.address, core.pid, core.info)
        fronts = [ctx.Process(target=_front_main, args=(settings, i, core_args, sock), name=f"gpt-front-{i}")
                  for i in range(n)]
        for p in fronts:
            p.start()
        log.info("%d HTTP fronts on %s:%d, engine core pid %d", n, settings.host, settings.port, core.pid)
        stopping = {"yes": False}

        def on_term(signum, frame) -> None:
            stopping["yes"] = True
            for p in fronts:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, lambda *_: stopping.update(yes=True))  # the fronts got it from the terminal
        core_proc = core.process.proc
        while any(p.is_alive() for p in fronts):
            wait([p.sentinel for p in fronts if p.is_alive()] + ([core_proc.sentinel] if core_proc.is_alive() else []),
                 timeout=1.0)
            failed = [p for p in fronts if p.exitcode not in (None, 0)]
            if not stopping["yes"] and (not core_proc.is_alive() or failed):
                why = (f"the engine core exited (status {core_proc.exitcode})" if not core_proc.is_alive()
                       else f"front {failed[0].name} exited with status {failed[0].exitcode}")
                log.error("%s; stopping the server", why)
                code, stopping["yes"] = 1, True
                for p in fronts:
                    if p.is_alive():
                        p.terminate()
    finally:
        for p in fronts:
            if p.is_alive():
                p.kill()
                p.join()
        sock.close()
        core.process.stop()
        shutil.rmtree(prom_dir, ignore_errors=True)
    return code
