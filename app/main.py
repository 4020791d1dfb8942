"""`uvicorn app.main:app`: the app built from the environment (`GPT_*`).

The checkpoint is loaded here, before uvicorn serves: a missing or corrupt one ends the process with one
line naming the file and the problem, and exit status 1 (2 for a bad setting).
"""

from __future__ import annotations

import sys

from app.config import SettingsError, load_settings
from app.server import create_app
from app.service import StartupError, load_model

try:
    settings = load_settings()
except SettingsError as e:  # one line, no traceback; uvicorn exits non-zero
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
try:
    loaded = load_model(settings)
except StartupError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(1) from None

app = create_app(settings, loaded=loaded)
