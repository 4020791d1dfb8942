"""The engine core in its own process: it owns the device and the weights; the HTTP fronts talk to it over ZMQ.

    core = CoreProcess(CoreConfig.from_settings(settings))
    core.start(); info = core.wait_loaded()     # a bad checkpoint: StartupError with one line
    # or: CoreProcess(None).start() before the settings are known (torch loads meanwhile), then .configure(cfg)
    ... fronts connect ProcessEngineClient(core.address, ...) ...
    core.stop()

Why a process: with the model loop and the HTTP front in one interpreter, the decode step waited for the GIL
after every torch op while the event loop encoded JSON and walked Starlette's send chain (12–18 ms steps in the
server vs 7 ms alone, issue 16). Here the core's process does nothing but schedule, compute and send one
MessagePack frame per step and front (`engine/wire.py`); detokenizing, stop strings and SSE stay in the fronts.

The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group: the front drains and then tells
the core to stop), ends its requests and exits 0 on SIGTERM or a `Shutdown` message, and gets SIGTERM when its
parent dies (Linux `PR_SET_PDEATHSIG`), so it never outlives the server. Its socket lives in a private temporary
directory that the parent removes.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine.build import CoreConfig, StartupError, build_core
from engine.cpu_tuning import (
    THREADS,
    KernelChoices,
    choose_threads,
    core_threads,
    set_openmp_waits,
    thread_model_key,
)
from engine.heap import keep_freed_memory, release_freed_memory

log = logging.getLogger("engine")


DEVICE_FAILED_EXIT = 3  # the core process's status after a sticky device error (1: it could not start)


# ---------------------------------------------------------------------------------------------- the child
def _die_with_parent() -> None:
    try:  # Linux: SIGTERM when the parent exits, so the core never outlives the server
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None elsewhere: in the core, what its imports took."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# the longest the core waits for its parent to finish starting before its timings go ahead anyway
QUIET_WAIT_S = 60.0


def wait_quiet(quiet=None, timeout: float = QUIET_WAIT_S) -> float:
    """Wait until `quiet` is set (the parent has finished its own start and only waits for this process); the
    seconds waited. The core's timings at start-up (tune's kernel choice per shape, kept on disk; the thread count)
    need the CPUs to themselves, and the parent imports the HTTP stack meanwhile (app/__main__.py): a one-row step
    timed beside that took 5-11 ms instead of 2.3 (an OpenMP barrier waiting on a thread the import displaced),
    which chose every thread for the bundled model where one then served a stream 1.2-1.5x faster (eager steps)."""
    t0 = time.perf_counter()
    if quiet is not None:
        quiet.wait(timeout)
    return time.perf_counter() - t0


def kept_thread_choice(core, cfg, before_timing) -> dict:
    """`choose_threads`' choice, made on this machine's first start for this model and format and kept on disk with
    the kernel choices (engine.cpu_tuning.KernelChoices): a later start neither times it (0.1-0.4 s) nor makes it
    beside whatever else happens to run then (a training run beside a start chose 2 threads for the bundled
    model, 0.7x its speed with 1: docs/performance.md). /info's `thread_choice.kept` says which."""
    import torch

    choices, model = KernelChoices(cfg.compile_cache), thread_model_key(core)
    kept = choices.kept(THREADS + model)
    if isinstance(kept, int) and not isinstance(kept, bool) and 0 < kept <= cfg.torch_threads:
        torch.set_num_threads(kept)
        log.info("torch threads: %d of %d, kept from an earlier start (%s)", kept, cfg.torch_threads, choices.path)
        return {"threads": kept, "cores": cfg.torch_threads, "one_row_step_ms": None, "last_thread_gain": None,
                "chosen": "all" if kept == cfg.torch_threads else "n-1", "kept": True}
    before_timing()  # where the engine had nothing to time
    choice = choose_threads(core, cfg.torch_threads)
    choices.keep(THREADS + model, choice["threads"])
    return {**choice, "kept": False}


def run_core_process(cfg_dict: dict | None, address: str, conn, parent_pid: int, quiet=None,
                     settings_conn=None) -> None:
    """The child's main: load, report to the parent through `conn`, then serve the fronts until told to stop.
    `quiet` (an Event, optional): set by the parent once it has nothing else to do but wait for this process.
    `cfg_dict` None: started before the parent knew its settings; torch loads while they come through
    `settings_conn` (its end closed unsent: the parent will not serve, and this process exits 0)."""
    t0, imports = time.perf_counter(), process_age()
    set_openmp_waits()  # read when torch loads libgomp, so before that
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    malloc_tuned = keep_freed_memory()
    waits: list[float] = []  # loading and converting the weights run beside the parent's imports, timings after them
    settings_wait = 0.0
    if cfg_dict is None:
        import torch  # noqa: F401 - the longest import of the start, made while the parent parses its settings

        t_wait = time.perf_counter()
        try:
            cfg_dict = settings_conn.recv()
        except EOFError:
            sys.exit(0)
        finally:
            settings_conn.close()
        settings_wait = time.perf_counter() - t_wait
    cfg = CoreConfig(**cfg_dict)
    measure_threads = not cfg.torch_threads
    cfg.torch_threads = core_threads(cfg)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s:     [core] %(message)s")

    def before_timing() -> None:
        if not waits:
            waits.append(wait_quiet(quiet))

    try:
        core, info, classify = build_core(cfg, before_timing=before_timing)
    except StartupError as e:
        conn.send(("error", str(e)))
        sys.exit(1)
    info["malloc_keeps_freed_memory"] = malloc_tuned
    built, in_build = time.perf_counter(), sum(waits)
    if measure_threads:
        info["thread_choice"] = kept_thread_choice(core, cfg, before_timing)
        info["torch_threads"] = info["thread_choice"]["threads"]
    # where this process's start went (/info `startup_seconds`; the warm-up after it: stats' `warmup_seconds`)
    times = {"imports": None if imports is None else round(imports, 2), "load": info["load_seconds"],
             "front_wait": round(settings_wait + sum(waits), 2),
             "engine": round(built - t0 - info["load_seconds"] - in_build - settings_wait, 2),
             "threads": round(time.perf_counter() - built - (sum(waits) - in_build), 2)}
    info["startup_seconds"] = times
    log.info("loaded: %s", ", ".join(f"{k} {v} s" for k, v in times.items() if v is not None))
    release_freed_memory()  # the weights as loaded, freed by the swap to their served format
    # imported here, not at the top: both load torch, and the spawned child imports this module before
    # set_openmp_waits runs
    from engine.core_loop import CoreLoop, DeviceFailed
    from engine.transport import ZmqTransport

    transport = ZmqTransport.bind(address, parent_pid)
    loop = CoreLoop(core, transport, info=info, classify=classify, warmup=cfg.warmup,
                    stream_interval_s=cfg.stream_interval_ms / 1000)

    def on_term(signum, frame) -> None:  # ends the loop after the current step; open requests get SHUTDOWN
        loop.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    conn.send(("loaded", info))
    conn.close()
    try:
        loop.run()
    except DeviceFailed as e:  # a sticky CUDA error: exit, so the server's /live fails and it is restarted
        log.error("the device failed, the engine core exits: %s", e)
        sys.exit(DEVICE_FAILED_EXIT)
    finally:
        transport.close()


# ---------------------------------------------------------------------------------------------- the parent
class CoreProcess:
    """The parent's handle on the core process: start it, wait until the model is loaded, stop it."""

    def __init__(self, cfg: CoreConfig | None) -> None:
        """`cfg` None: a process started before the settings are known, which loads torch meanwhile; `configure`
        sends them (`python -m app`: GPT-2's start 0.1-0.2 s sooner, docs/performance.md), `stop` ends it unused."""
        self.cfg = cfg
        self.dir = Path(tempfile.mkdtemp(prefix="gpt-core-"))
        self.address = f"ipc://{self.dir / 'engine.sock'}"
        ctx = mp.get_context("spawn")  # never fork a process that holds threads (uvicorn's, torch's) or CUDA
        self._conn, child = ctx.Pipe(duplex=False)
        child_settings, self._settings = ctx.Pipe(duplex=False) if cfg is None else (None, None)
        self._quiet = ctx.Event()  # set in wait_loaded: this process has finished its own start (run_core_process)
        self.proc = ctx.Process(target=run_core_process,
                                args=(None if cfg is None else asdict(cfg), self.address, child, os.getpid(),
                                      self._quiet, child_settings),
                                name="gpt-engine-core", daemon=False)
        self._child_ends = [c for c in (child, child_settings) if c is not None]
        self.info: dict[str, Any] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def start(self) -> None:
        self.proc.start()
        for c in self._child_ends:
            c.close()

    def configure(self, cfg: CoreConfig) -> None:
        """The settings of a process started without them."""
        assert self.cfg is None and self._settings is not None, "configured already"
        self.cfg = cfg
        self._settings.send(asdict(cfg))
        self._settings.close()

    def wait_loaded(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the model is loaded and the core built: its info; StartupError with the child's line."""
        end = None if timeout is None else time.monotonic() + timeout
        self._quiet.set()
        while not self._conn.poll(0.1):
            if not self.proc.is_alive():
                self.proc.join()
                self.cleanup()
                raise StartupError(f"the engine core process exited with status {self.proc.exitcode} while loading")
            if end is not None and time.monotonic() > end:
                self.stop()
                raise StartupError(f"the engine core process did not load the model in {timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.proc.join()
            self.cleanup()
            raise StartupError(f"the engine core process exited with status {self.proc.exitcode} while loading") \
                from None
        if kind == "error":
            self.proc.join(10)
            self.cleanup()
            raise StartupError(value)
        self.info = value
        return value

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (the core ends its requests and exits 0), SIGKILL past `timeout`; the exit code."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        elif self.proc.pid is not None:
            self.proc.join(0)
        self.cleanup()
        return self.proc.exitcode

    def cleanup(self) -> None:
        self._conn.close()
        if self._settings is not None:
            self._settings.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def abandon(self) -> None:
        """Kill the core without waiting and remove its socket directory: for a parent about to `os._exit` (a
        second signal during the drain), which would otherwise leave the directory behind."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
