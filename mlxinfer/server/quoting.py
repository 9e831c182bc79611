"""Values quoted in one-line error messages: short, printable, never a huge integer's digits."""

from __future__ import annotations

from typing import Any

SHOWN_CHARS = 80  # of a value quoted in an error message


def shown(value: Any) -> str:
    """``value`` for a one-line error message: its repr, cut short (a huge integer by its size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def named(name: str) -> str:
    """A field's name for an error message: as it is when printable and short, else ``shown``."""
    return name if name and name.isprintable() and len(name) <= SHOWN_CHARS else shown(name)
