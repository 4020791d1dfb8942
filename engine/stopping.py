"""Stop strings matched on streamed text, also across token boundaries.

Text that might be the start of a stop string is held back until the next piece
of text shows whether it is; the stop string itself is never released.
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos_token"  # the model produced <|endoftext|>
    STOP = "stop_sequence"  # a stop string appeared in the text


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""  # text held back: a suffix that is a prefix of some stop string

    def feed(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text. Returns (text safe to release, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:  # longest suffix of buf that could still grow into s
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The generation ended for another reason: release what was held back."""
        text, self.pending = self.pending, ""
        return text
