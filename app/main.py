"""`uvicorn app.main:app`: the app built from the environment (`GPT_*`).

The checkpoint is loaded in the lifespan start-up; a missing or corrupt one makes uvicorn log one
line with the reason and exit with a non-zero status.
"""

from __future__ import annotations

import sys

from app.config import SettingsError, load_settings
from app.server import create_app

try:
    settings = load_settings()
except SettingsError as e:  # one line, no traceback; uvicorn exits non-zero
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None

app = create_app(settings)
