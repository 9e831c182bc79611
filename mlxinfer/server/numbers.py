"""A body's numbers as every API checks them: an integer past float's range, and a span with
its ends open or closed, as each API's message names it (each raises in its own words)."""

from __future__ import annotations

import math


def as_float(value: int | float) -> float:
    """``value`` as a float; one past float's range (a huge JSON integer) as an infinity of its
    sign, which no span here holds."""
    return float(value) if abs(value) < 1e300 else math.inf if value > 0 else -math.inf


def outside(
    value: float, lo: float, hi: float, *, above: bool = False, below: bool = False
) -> str | None:
    """The span, written ``[lo, hi]`` (``(lo`` with ``above``: > lo; ``hi)`` with ``below``:
    < hi), when ``value`` falls outside it; None when inside."""
    if (lo < value if above else lo <= value) and (value < hi if below else value <= hi):
        return None
    return f"{'(' if above else '['}{lo:g}, {hi:g}{')' if below else ']'}"
