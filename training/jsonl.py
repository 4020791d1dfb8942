"""One line of a JSON Lines file (the fine-tuning inputs: task items, chat conversations) → its value, or a
one-line error that names the file and line: invalid UTF-8, not JSON. Blank lines are skipped (None)."""

from __future__ import annotations

import json
from typing import Any


def parse_line(line_bytes: bytes, where: str, error: type[Exception]) -> Any | None:
    """`where` is "FILE:LINE"; `error` the caller's error class (TaskDataError, ChatDataError)."""
    try:
        line = line_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: invalid UTF-8 at byte {e.start} of the line") from None
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
