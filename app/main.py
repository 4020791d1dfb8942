"""`uvicorn app.main:app`: the app built from the environment (`GPT_*`).

The engine core process is started and the checkpoint loaded here, before uvicorn serves: a missing or corrupt
one ends the process with one line naming the file and the problem, and exit status 1 (2 for a bad setting).
If the core dies later, the open streams get their final error events and the process exits 1 (uvicorn alone
has no drain: use `python -m app` for that).
"""

from __future__ import annotations

import asyncio
import os
import sys

from app.config import SettingsError, load_settings
from app.server import create_app
from app.service import StartupError, start_engine

try:
    settings = load_settings()
except SettingsError as e:  # one line, no traceback; uvicorn exits non-zero
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
try:
    loaded, core = start_engine(settings)
except StartupError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(1) from None

app = create_app(settings, loaded=loaded, core=core)


def _engine_died(reason: str) -> None:
    asyncio.get_running_loop().call_later(0.5, os._exit, 1)  # the streams got their final events first


app.state.service.on_engine_dead = _engine_died
