"""`python -m app [--checkpoint DIR] [--host H] [--port P] [--device D] [--dtype T] ...`

Flags override the `GPT_*` environment variables. The engine core process is started and the checkpoint
loaded before uvicorn starts, so a bad one ends the process at once with a one-line reason and exit status 1.
SIGTERM / SIGINT drain: new requests get 503 and /health turns 503, in-flight requests finish
(for at most GPT_SHUTDOWN_TIMEOUT_S), then the front and the core exit 0. A second signal exits at once.
If the engine core dies, every open stream gets its final error event, /live turns 503 and the server exits 1.
With --api-servers N (GPT_API_SERVERS), N front processes share the port and the one core (app/launcher.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing

from app import __version__
from engine.build import CoreConfig, StartupError
from engine.core_process import CoreProcess

# app.config (pydantic, ~0.1 s) is imported inside the functions: the engine core's process, started first in main,
# imports this module again (multiprocessing's spawn) before it can load torch

log = logging.getLogger("app")


def _flag_type(annotation) -> type | None:
    """argparse's type for a settings field: bool (None: a --x / --no-x pair), int, float; the rest go to pydantic
    as text, as environment variables do."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if typing.get_origin(annotation) is typing.Literal:
        args = [type(a) for a in args]
    elif len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
        args = [type(a) for a in typing.get_args(args[0])]
    if all(a is bool for a in args):
        return None
    for t in (int, float):
        if all(a is t for a in args):
            return t
    return str


def _choices(annotation) -> tuple:
    for a in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(a) is typing.Literal:
            return typing.get_args(a)
    return ()


def _default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return ",".join(map(str, value)) if value else "empty"
    value = field.default
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


def build_parser() -> argparse.ArgumentParser:
    """One flag per `Settings` field, generated (a setting is declared once, in app/config.py): --name-with-dashes,
    help from the field's description, with its GPT_ variable and default. Every flag defaults to None, so an
    unset flag leaves the environment's value."""
    from app.config import Settings

    p = argparse.ArgumentParser(prog="python -m app", description="Serve a GPT checkpoint over HTTP "
                                "(TGI- and OpenAI-compatible). Flags override GPT_* environment variables.")
    for name, field in Settings.model_fields.items():
        kind = _flag_type(field.annotation)
        env = f"GPT_{name.upper()}"
        text = field.description or name.replace("_", " ")
        choices = _choices(field.annotation)
        if choices:
            text = f"{' | '.join(map(str, choices))}: {text}" if field.description else " | ".join(map(str, choices))
        help_ = f"{text} (env {env}, default {_default_text(field)})".replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        if kind is None:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            p.add_argument(flag, dest=name, type=kind, default=None, help=help_,
                           metavar=name.upper() if kind is str else None)
    p.add_argument("--version", action="version", version=f"gpt-serve {__version__}")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _settings(argv: list[str] | None):
    """The settings from the flags over the environment; None after printing why they are invalid."""
    from app.config import SettingsError, load_settings

    args = parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return load_settings(**overrides)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    # the engine core's process starts first and loads torch while this one parses its settings and imports the HTTP
    # stack (app.serve, which loads no torch): side by side on a multi-core machine instead of one after the other
    # (docs/performance.md, "Start-up"); it gets its settings once they are known, and is stopped unused otherwise
    early = CoreProcess(None)
    early.start()
    try:
        settings = _settings(argv)
    except BaseException:  # a bad flag or setting, --help, --version
        early.stop()
        raise
    if settings is None:
        early.stop()
        return 2
    started = None
    if settings.engine != "thread":
        started = early
        started.configure(CoreConfig.from_settings(settings))
    else:
        early.stop()
    from app.serve import serve
    from app.service import start_engine

    try:
        loaded, core = start_engine(settings, started)
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if settings.api_servers > 1:
        from app.launcher import run_fronts

        return run_fronts(settings, core)
    try:
        return serve(settings, loaded=loaded, core=core)
    finally:
        if core is not None and core.process is not None:
            core.process.stop()


if __name__ == "__main__":
    sys.exit(main())
