"""The benches' harness for servers over HTTP: a free port, a server process (start, wait until it serves, stop it and
what it left behind), a lean SSE client, and a process tree's memory and CPU time from /proc.

    server = Server("ours", argv, {"GPT_COMPILE": "auto"}, log, port)   # or app_server(checkpoint, ...)
    server.start(); seconds = server.wait_ready(300)                      # /health, then a background compile
    rec = await SSEConnection("127.0.0.1", port).post_stream("/generate_stream", body, timeout)
    tree_memory_mb(server.proc.pid); server.stop()
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO


def compile_bytecode(tree: Path = REPO) -> None:
    """Compile a checkout's bytecode before its server's start is timed, as an install leaves it (pip writes .pyc, the
    image runs compileall): where PYTHONDONTWRITEBYTECODE is set and none was written, each start compiled our
    modules from source, 0.15-0.5 s of GPT-2's start on a 2-vCPU host (docs/performance.md, "Start-up")."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "model", "engine", "app"], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------- processes (Linux /proc)

def proc_children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def proc_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc)."""
    kids, out, todo = proc_children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def start_time(pid: int) -> str | None:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError):
        return None


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of process `pid`, from /proc (None where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def tree_memory_mb(pid: int) -> dict[str, Any]:
    """RSS and PSS (MB) summed over pid's process tree (PSS splits shared pages, so the sum does not double count)."""
    rss = pss = 0
    pids = proc_tree(pid)
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    hwm = 0  # peak resident memory of each process (VmHWM), summed: an upper bound of the tree's peak
    for p in pids:
        try:
            hwm += next(int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                        if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            continue
    return {"rss_mb": round(rss / 1024, 1), "pss_mb": round(pss / 1024, 1), "peak_rss_mb": round(hwm / 1024, 1),
            "processes": len(pids)}


# ---------------------------------------------------------------- a server process

@dataclass
class Server:
    """A server process on 127.0.0.1:port (ours, llama-server, vLLM), its output appended to `log`.

    `env` is added to this process's environment, less the names in `unset`. `wait_compile`: wait_ready also
    waits for our server's background compile of the decode step (GPT_COMPILE), so a timing measures the steady
    state."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    port: int
    unset: tuple[str, ...] = ()
    wait_compile: bool = True
    proc: subprocess.Popen | None = None
    started: float = 0.0
    family: list[tuple[int, str | None]] = field(default_factory=list)
    compile_wait_s: float = 0.0  # after /health: our background compile of the decode step (GPT_COMPILE)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.logf = open(self.log, "a")
        self.logf.write(f"\n$ {' '.join(self.argv)}\n")
        self.logf.flush()
        self.started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k not in self.unset}
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env={**env, **self.env}, stdout=self.logf,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds from start to /health answering 200 (and /v1/models listing the model), polled every 20 ms over
        one client (every 0.25 s with a new client each time, the figure came in steps of 0.25 s: bench.startup)."""
        import httpx

        deadline = self.started + timeout
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"exited with {self.proc.returncode} during start-up: {tail(self.log, 800)}")
                try:
                    if (client.get(self.url + "/health", timeout=2).status_code == 200
                            and client.get(self.url + "/v1/models", timeout=5).status_code == 200):
                        ready = time.monotonic() - self.started
                        if self.wait_compile:
                            self.compile_wait_s = self.wait_compiled(deadline)
                        return ready
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
        raise RuntimeError(f"not ready after {timeout:.0f} s: {tail(self.log, 800)}")

    def wait_compiled(self, deadline: float) -> float:
        """Our server compiles its decode step in the background after it is healthy (GPT_COMPILE): wait until that
        is over, so a timing measures the steady state; a 1-token request lets the core install the step. Seconds
        waited (0 for a server with no /info or no compile)."""
        import httpx

        t0 = time.monotonic()
        while time.monotonic() < deadline:
            try:
                info = httpx.get(self.url + "/info", timeout=5)
                if info.status_code != 200 or not (info.json().get("engine") or {}).get("compiling"):
                    return round(time.monotonic() - t0, 2)
                httpx.post(self.url + "/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}},
                           timeout=30)
            except (httpx.HTTPError, ValueError):
                return round(time.monotonic() - t0, 2)
            time.sleep(1.0)
        raise RuntimeError(f"the decode step was still compiling at the start-up deadline: {tail(self.log, 800)}")

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the server process has used so far."""
        return proc_cpu_s(self.proc.pid)

    def remember_family(self) -> None:
        """Record the process tree (pid, start time) so stop() can end children that outlive the parent."""
        if self.proc is not None:
            self.family = [(p, start_time(p)) for p in proc_tree(self.proc.pid)]

    def stop(self) -> None:
        if self.proc is None:
            return
        self.remember_family()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid, st in self.family[1:]:  # descendants that outlived it (same pid *and* start time: ours)
            if st is not None and start_time(pid) == st:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.logf.close()
        self.proc = None


def app_server(checkpoint: Path, max_batch: int | None, threads: int | None, log: Path, engine: str | None = None,
               extra_env: dict[str, str] | None = None) -> Server:
    """`python -m app` on a free port, started: fp32 on the CPU, a deep queue, warnings only; max_batch None leaves
    GPT_MAX_BATCH_SIZE to the app's default and threads None (or 0) GPT_TORCH_THREADS (any value in the
    environment is dropped); `engine` process (the default: the core in its own process) or thread. wait_ready
    returns at /health, without waiting for a background compile (as bench.serve always has)."""
    port = free_port()
    env = {"GPT_LOG_LEVEL": "warning", "GPT_DEVICE": "cpu", "GPT_DTYPE": "fp32", "GPT_MAX_QUEUE": "1000"}
    if threads:
        env["GPT_TORCH_THREADS"] = str(threads)
    if max_batch is not None:
        env["GPT_MAX_BATCH_SIZE"] = str(max_batch)
    if engine is not None:
        env["GPT_ENGINE"] = engine
    env.update(extra_env or {})
    argv = [sys.executable, "-m", "app", "--checkpoint", str(checkpoint), "--host", "127.0.0.1", "--port", str(port)]
    server = Server("ours", argv, env, log, port, unset=("GPT_MAX_BATCH_SIZE", "GPT_TORCH_THREADS"),
                    wait_compile=False)
    server.start()
    return server


# ---------------------------------------------------------------- the SSE client

def parse_sse_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Split an SSE byte buffer into complete events' `data:` payloads (comments and [DONE] dropped) and
    the incomplete rest. Events end with a blank line (\\n\\n or \\r\\n\\r\\n)."""
    buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    out = []
    for ev in events:
        data = b"\n".join(line[5:].lstrip() for line in ev.split(b"\n") if line.startswith(b"data:"))
        if data and data != b"[DONE]":
            out.append(data)
    return out, rest


class SSEConnection:
    """A lean HTTP/1.1 client for SSE streams (asyncio streams): POST a JSON body, timestamp each event.

    Why not httpx: on a 2-core machine that runs the server too, httpx's per-line parsing costs about
    0.4 of a core at 2,000 events/s, which the server then loses (measured: 2,420 vs 3,750 tok/s for
    the same server at 64 streams). This client only splits chunks and events and timestamps them.
    `keep_alive`: its requests one after another on one connection; else one connection per request
    (`Connection: close`, a body chunked or read to its end).
    """

    def __init__(self, host: str, port: int, keep_alive: bool = True) -> None:
        self.host, self.port, self.keep_alive = host, port, keep_alive
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: dict[str, Any], timeout: float,
                          on_data: Callable[[float, bytes], None] | None = None) -> dict[str, Any]:
        """One streaming request: {"start", "times", "error"}. Each event's data goes to `on_data(seconds since the
        send, data)`; without it every event is a token (TGI's /generate_stream) whose time goes into `times`, and
        an error event is the request's error."""
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"start": t0, "times": [], "error": None}
        if on_data is None:
            times = rec["times"]

            def on_data(now: float, data: bytes) -> None:
                if data.startswith(b'{"error"'):  # JSON parsed only for an error
                    rec["error"] = f"error event: {json.loads(data).get('error')}"
                else:
                    times.append(now)
        try:
            await asyncio.wait_for(self._exchange(path, body, t0, on_data, rec), timeout)
        except Exception as e:  # noqa: BLE001 - any failure of a request is counted, not fatal
            rec["error"] = f"{type(e).__name__}: {e}"
            self.close()
        if not self.keep_alive:
            self.close()
        return rec

    async def _exchange(self, path: str, body: dict[str, Any], t0: float, on_data: Callable[[float, bytes], None],
                        rec: dict[str, Any]) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        close = "" if self.keep_alive else "Connection: close\r\n"
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json"
                          f"\r\nAccept: text/event-stream\r\nContent-Length: {len(data)}\r\n{close}\r\n".encode()
                          + data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = head.lower()
        chunked = b"transfer-encoding: chunked" in headers
        length = int(headers.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in headers \
            else None
        if status != 200:
            payload = await (self.reader.readexactly(length) if length is not None and not chunked
                             else self.reader.read(2000))
            rec["error"] = f"HTTP {status}: {payload[:300]!r}"
            if chunked or length is None:  # the rest of the body is still on the connection
                self.close()
            return
        pending = b""
        while True:
            if chunked:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                piece = (await self.reader.readexactly(size + 2))[:-2]
                if size == 0:
                    return
            elif length is not None:
                if length == 0:
                    return
                piece = await self.reader.read(min(length, 65536))
                if not piece:
                    return
                length -= len(piece)
            else:
                piece = await self.reader.read(65536)
                if not piece:
                    return
            now = time.perf_counter() - t0
            events, pending = parse_sse_events(pending + piece)
            for ev in events:
                on_data(now, ev)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
