"""The settings within a size budget that minimise the summed measured cost (issue 48, item 5).

A knapsack solved by dynamic programming over the budget in 4,096 units (sizes rounded up, so
it always fits), then the bytes the rounding left go to the upgrades with the best cost saved per
byte; the output head kept at :data:`HEAD_MIN_BITS` or more unless that floor starves the rest
(:func:`choose_with_head`). The tensors and their costs: :mod:`mlxinfer.quant.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from .plan import Setting, Tensor

# The output head, tied to the embedding or not, never goes below 4 bits in a plan (mlx-lm's
# mixed_3_6 leaves SmolLM2's tied head at 3 bits: it answers "New York"); above that, its KL
# is measured at every candidate setting, not extrapolated. Measured on SmolLM2 at 4.5 bpw
# (evaluation corpus, KLD vs float32): a fixed 6-bit floor (llama.cpp's Q6_K) 0.281, 5-bit 0.203,
# the measured choice (4-bit group 32) 0.186: the floor's bytes do more in the blocks.
HEAD_MIN_BITS = 4
# ... unless keeping it there makes the plan's predicted KL this many times the plan without
# the floor: at a budget so small that the floor starves the blocks. Gemma-3-270M at 122.4 MB
# (3.65 bits per weight, the tied head 63 % of the parameters): with the floor the head took
# 4-bit g128 (89 MB) and the blocks mostly 2 bits, predicted KL 3.00, evaluation KLD 1.874,
# top-1 46.0 %; without the floor the head took 3-bit g128: predicted 1.00, KLD 0.594, 64.9 %.
FLOOR_YIELDS = 2.0


def protect_head(tensors: Sequence[Tensor], budget: int) -> int | None:
    """Keep the head's candidates at :data:`HEAD_MIN_BITS` or more, unless even that cannot fit
    the budget beside every other tensor's smallest setting (then the measured costs alone
    decide). Returns the floor kept, or None."""
    others = sum(
        min(s.nbytes(t.numel) for s in t.candidates) if t.fixed is None else t.fixed.nbytes(t.numel)
        for t in tensors
        if t.role != "head"
    )
    for t in tensors:
        if t.role != "head" or t.fixed is not None:
            continue
        kept = [s for s in t.candidates if s.bits >= HEAD_MIN_BITS]
        if kept and min(s.nbytes(t.numel) for s in kept) + others <= budget:
            t.candidates = kept
            return HEAD_MIN_BITS
    return None


def choose_with_head(
    tensors: Sequence[Tensor], budget: int
) -> tuple[dict[str, Setting], int | None]:
    """:func:`choose` with the head kept at :data:`HEAD_MIN_BITS` or more (:func:`protect_head`),
    unless that plan's predicted KL is :data:`FLOOR_YIELDS` times the plan's without the floor or
    more (then the head's candidates are all kept). Returns (settings, the floor kept or None)."""
    free = choose(tensors, budget)
    heads = {id(t): list(t.candidates) for t in tensors if t.role == "head"}
    floor = protect_head(tensors, budget)
    if floor is None:
        return free, None
    kept = choose(tensors, budget)

    def predicted(settings: dict[str, Setting]) -> float:
        return sum(t.cost(settings[t.path]) for t in tensors if t.fixed is None)

    if predicted(kept) >= FLOOR_YIELDS * predicted(free):
        for t in tensors:
            if id(t) in heads:
                t.candidates = heads[id(t)]
        return free, None
    return kept, floor


def check_fits(tensors: Sequence[Tensor], budget: int) -> None:
    """Raise ConfigError when even the smallest setting of every tensor exceeds ``budget``."""
    need = sum(
        t.fixed.nbytes(t.numel) if t.fixed else min(s.nbytes(t.numel) for s in t.candidates)
        for t in tensors
    )
    if need > budget:
        raise ConfigError(
            f"size budget: expected at least {need} bytes for the quantized tensors at their "
            f"smallest settings, found a budget of {budget}"
        )


def choose(tensors: Sequence[Tensor], budget: int) -> dict[str, Setting]:
    """The settings minimising the summed cost with ``sum(bytes) <= budget``.

    Raises ConfigError when even the smallest setting of every tensor does not fit.
    """
    check_fits(tensors, budget)
    planned = [t for t in tensors if t.fixed is None]
    room = budget - sum(t.fixed.nbytes(t.numel) for t in tensors if t.fixed is not None)

    choice = _knapsack(planned, room)

    def size(choice: list[Setting]) -> int:
        return sum(s.nbytes(t.numel) for t, s in zip(planned, choice))

    left = room - size(choice)
    while True:  # spend what is left on the best cost saved per byte
        best, best_gain = None, 0.0
        for i, (t, s) in enumerate(zip(planned, choice)):
            for c in t.candidates:
                extra = c.nbytes(t.numel) - s.nbytes(t.numel)
                gain = t.cost(s) - t.cost(c)
                if 0 < extra <= left and gain > 0 and gain / extra > best_gain:
                    best, best_gain = (i, c, extra), gain / extra
        if best is None:
            break
        i, c, extra = best
        choice[i], left = c, left - extra
    plan = {t.path: s for t, s in zip(planned, choice)}
    plan.update({t.path: t.fixed for t in tensors if t.fixed is not None})
    return plan


def _knapsack(planned: Sequence[Tensor], room: int, buckets: int = 4096) -> list[Setting]:
    """One setting per tensor minimising the summed cost within ``room`` bytes: dynamic
    programming over the budget cut into ``buckets`` units (each tensor's size rounded up to
    whole units, so the plan always fits; at most a unit per tensor is left unspent, which
    the caller's greedy pass spends)."""
    unit = max(1, -(-room // buckets))
    n = room // unit
    best = np.zeros(n + 1)  # best[b]: least cost of the tensors so far within b units
    picks = []
    for t in planned:
        new = np.full(n + 1, np.inf)
        arg = np.zeros(n + 1, np.int16)
        for j, c in enumerate(t.candidates):
            w = -(-c.nbytes(t.numel) // unit)
            if w > n:
                continue
            cand = np.full(n + 1, np.inf)
            cand[w:] = best[: n + 1 - w] + t.cost(c)
            better = cand < new
            new[better], arg[better] = cand[better], j
        best = new
        picks.append(arg)
    b = int(np.argmin(best))
    if not np.isfinite(best[b]):  # fits only in exact bytes: the smallest settings
        return [min(t.candidates, key=lambda c: c.nbytes(t.numel)) for t in planned]
    choice = []
    for t, arg in zip(reversed(planned), reversed(picks)):
        c = t.candidates[int(arg[b])]
        choice.append(c)
        b -= -(-c.nbytes(t.numel) // unit)
    return choice[::-1]


def plan_bytes(tensors: Sequence[Tensor], plan: dict[str, Setting]) -> int:
    return sum(plan[t.path].nbytes(t.numel) for t in tensors if t.path in plan)


def budget_from_bpw(bpw: float, parameters: int, other_bytes: int) -> int:
    """Bytes for the quantized tensors so the whole weight files hold ``bpw`` bits per parameter."""
    return math.floor(bpw * parameters / 8) - other_bytes
