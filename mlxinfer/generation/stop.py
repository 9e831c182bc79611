"""Stop strings over a text stream, without leaking a partial match.

Text that could still be the start of a stop string is held back until the
next segment decides it; once a stop string appears, only the text before it
is released, and the matcher says which stop string it was.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Add a segment; returns (text safe to emit, the stop string hit or None). Of two stop
        strings found in the same segment, the one that starts first is hit (at the same
        place: the lesser, as ``min`` orders strings)."""
        if not self.stops:
            return text, None
        buf = self._pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self._pending = ""
            at, stop = min(hits)
            return buf[:at], stop
        hold = self._longest_prefix_suffix(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """Release held-back text at the end of the stream (no stop came)."""
        text, self._pending = self._pending, ""
        return text

    def _longest_prefix_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that begins some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
