"""Timing the plans' options on the model: decode steps for the stream plans, then the
threshold kinds' crossovers (``choices``: each timed on one op alone). Every choice keeps the
plainer option unless another is 3% faster (``choices.pick``).

A decode step is timed by its parts (:class:`DecodeStep`): the first few blocks, scaled to
all of them, and the LM head alone, each part only for the kinds that act on it. For SmolLM2
the estimate is within a few percent of whole steps, and every choice takes about half a
second instead of 2.7 s (docs/performance.md).
"""

from __future__ import annotations

import math
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from ...models.base import lm_head
from . import tiles
from .choices import (
    ROUNDS,
    measure_dequantize_rows,
    measure_dequantized_attention,
    measure_int16_head,
    measure_int16_rows,
    measure_long_keys,
    measure_pad_rows,
    measure_small,
    pick,
)
from .kinds import (
    NUMERIC,
    OPTIONS,
    numeric_kinds,
    options_of,
    plan_layers,
    set_plan,
    set_plans,
)

# A decode step's blocks are timed over the first few of them, enough for about this long; the
# step is then estimated as (blocks / timed) x that time, plus the LM head timed alone.
BLOCKS_S = 0.003
# Past this estimate (slow models: float16 on the CPU, large ones) nothing is timed and the plans
# stay at their plainest: a step is then long enough that the plans are noise in it.
MAX_MEASURE_S = 4.0
# ... except the compiled kernels (``compiled``): each a several-fold gain where it wins (on the
# slow steps most), so past that estimate they are still timed against the plainest option alone,
# in fewer rounds, unless that too would take longer than this.
KERNEL_ROUNDS = 3
MAX_KERNEL_MEASURE_S = 15.0
PROMPT = 4  # tokens in the cache the decode steps are timed on


class DecodeStep:
    """A decode step of ``model`` in two parts timed apart: its first ``timed`` blocks (embedding
    and final norm included) and its LM head. Both run on the model's own layers and shapes, so
    the plans act as in a real step; a plan that acts on every block shows in each timed one."""

    def __init__(self, model: nn.Module, timed: int | None = None):
        self.model = model
        self.inner = model[model.inner_name]
        self.layers = list(model.layers)
        self.cache = model.make_cache()
        self.timed = len(self.layers) if timed is None else max(1, min(timed, len(self.layers)))
        vocab = model.args.vocab_size
        self.token = mx.array([[1]])
        prompt = mx.array([[(7 + 13 * i) % vocab for i in range(PROMPT)]])
        self.hidden = self._blocks(prompt)[:, -1:]  # what the head reads
        mx.eval(self.hidden)

    @property
    def scale(self) -> float:
        """Blocks of a step per block timed."""
        return len(self.layers) / self.timed

    def _blocks(self, tokens: mx.array) -> mx.array:
        # The layers beyond ``timed`` are left out; their caches stay (masks read them).
        self.inner[self.model.layers_name] = self.layers[: self.timed]
        try:
            return self.inner(tokens, self.cache)
        finally:
            self.inner[self.model.layers_name] = self.layers

    def blocks_seconds(self, steps: int = 1) -> float:
        """Median seconds of the timed blocks over ``steps`` decode steps."""
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            mx.eval(self._blocks(self.token))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def head_seconds(self, steps: int = 1) -> float:
        """Median seconds of the LM head on one row."""
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            mx.eval(lm_head(self.hidden, self.model.head))
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def measure(model: nn.Module, fixed: dict[str, str | int] | None = None) -> dict:
    """Choose each kind of plan the model has by timing its options; ``fixed`` kinds are not
    measured. Returns {"plans": {kind: option}, "seconds": {kind: {option: s}}, ...}: the
    seconds of a kind are whole decode steps, estimated from the parts the kind acts on."""
    fixed = dict(fixed or {})
    found = plan_layers(model)
    kinds = [kind for kind in OPTIONS if found[kind] and kind not in fixed]
    options = {kind: options_of(model, kind, found) for kind in kinds}
    chosen: dict[str, str | int] = {kind: OPTIONS[kind][0] for kind in OPTIONS if found[kind]}
    chosen.update({k: v for k, v in fixed.items() if k in NUMERIC or found.get(k)})
    set_plans(model, chosen)
    seconds: dict[str, dict] = {}
    timed, rounds = 0, None
    if kinds:
        whole = DecodeStep(model, timed=1)
        one_block = whole.blocks_seconds(3)  # the first is also a warm-up
        head = whole.head_seconds(3)
        timed = max(2, math.ceil(BLOCKS_S / max(one_block, 1e-5)))
        step = DecodeStep(model, timed=timed)
        # The budget counts the options there are without the kernels, so that whether a model
        # is timed at all does not depend on whether they are built (they add up to ~60% more).
        n_options = sum(
            sum(o != "kernel" for o in options[kind])
            for kind in kinds
            if kind not in ("matvec", "kernel_threads", "decode", "int16_decode")
        )
        part_s = step.timed * one_block + head  # one timing of a decode step, by its parts
        if n_options * ROUNDS * part_s > MAX_MEASURE_S:
            step_s = len(step.layers) * one_block + head
            seconds["skipped"] = {"step_s": step_s}
            kinds = [k for k in kinds if "kernel" in options[k] or k == "kernel_threads"]
            options = {
                k: (OPTIONS[k][0], "kernel") if "kernel" in options[k] else options[k]
                for k in kinds
            }
            rounds = KERNEL_ROUNDS
            if sum(len(options[k]) for k in kinds) * rounds * part_s > MAX_KERNEL_MEASURE_S:
                kinds = []
            seconds["skipped"]["kernels_timed"] = bool(kinds)
    # The head first: the blocks' timings add the chosen head's time to their estimate. Fusing
    # after the products' plans: a stacked product runs on the kernel only where they chose it.
    for kind in sorted(kinds, key=lambda kind: (kind != "head", kind == "fuse")):
        if kind == "kernel_threads" and "kernel" not in chosen.values():
            continue  # no kernel in use: its threads do not matter
        # The kernels' threads, and their int16 products, act on the head too.
        with_head = kind in ("kernel_threads", "int16_decode") or any(
            layer is model.head for layer in found[kind]
        )
        with_blocks = kind != "head"
        blocks = None if with_blocks else step.scale * step.blocks_seconds(3)

        def time_option(option, kind=kind, with_head=with_head, blocks=blocks, head=head):
            set_plan(model, kind, option)
            b = step.scale * step.blocks_seconds() if blocks is None else blocks
            return b + (step.head_seconds() if with_head else head)

        tried = options[kind]
        if kind == "fuse" and "kernel" in chosen.values():
            # Stacked siblings are the static default where the kernels run (``static_default``):
            # a tie keeps it (Gemma-3-270M on the Xeon VM timed 81.7 against 81.6 ms and kept
            # ``separate``, which then decoded 0.85-0.95x ``fused``).
            tried = ("fused", "separate")
        # matvec switches a split MLP's down projection between two layouts (a copy): alternated
        chosen[kind], seconds[kind] = pick(tried, time_option, rounds, alternate=kind == "matvec")
        set_plan(model, kind, chosen[kind])
        if kind == "head":
            head = seconds[kind][chosen[kind]] - blocks
    if "skipped" not in seconds:
        for kind, measure_kind in (
            ("long_keys", measure_long_keys),
            ("dequantize_rows", measure_dequantize_rows),
            ("int16_rows", measure_int16_rows),
            ("int16_head", measure_int16_head),
            ("small", measure_small),
            ("dequantized_attention", measure_dequantized_attention),
            ("pad_rows", measure_pad_rows),
        ):
            if kind not in fixed and kind in numeric_kinds(model):
                chosen[kind], seconds[kind] = measure_kind(model)
    set_plans(model, chosen)
    return {"plans": chosen, "seconds": seconds, "blocks_timed": timed}


def static_default(model: nn.Module) -> dict[str, str]:
    """What the plans are without timing, for the kinds the model has: the compiled kernel
    wherever one covers a kind's layers (on all usable CPUs), else the plainest option (one
    stream), and siblings stacked where a kernel is in use. Quiet machines measured so far chose
    it or a plan within a few percent of it."""
    found = plan_layers(model)
    default = {}
    for kind in OPTIONS:
        if found[kind]:
            options = options_of(model, kind, found)
            default[kind] = "kernel" if "kernel" in options else options[0]
    if "fuse" in default and "kernel" in default.values():
        default["fuse"] = "fused"  # siblings stacked: one kernel call for each group
    if "int16_decode" in default and tiles.available() and tiles.model_fits(model):
        # tiled 4- to 8-bit layers: their products 1.3-2x the float kernel's (SmolLM2-135M's
        # decode step 13.3 -> 9.6-10.5 ms on the Xeon VM); the few-row path alone is not a default
        default["int16_decode"] = "int16"
    return default


def confirm(model: nn.Module, result: dict, rounds: int = ROUNDS) -> dict:
    """Time whole decode steps (by parts, as ``measure``) under the measured plans and under
    :func:`static_default`, alternating, and keep the measured ones only if their fastest step
    is ``KEEP_IF_FASTER`` faster; the numeric kinds stay as measured. The kinds are chosen one
    after the other, each with the ones before it settled, so a choice timed while the machine
    was busy for part of the timing can lose as a whole: this catches it. Skipped for models
    too slow to time (``skipped``). Records the two times under ``result["confirmed"]``."""
    if "skipped" in result.get("seconds", {}):
        return result
    default = static_default(model)
    chosen = dict(result["plans"])
    if all(chosen.get(kind) == option for kind, option in default.items()):
        return result
    step = DecodeStep(model, timed=result.get("blocks_timed") or None)

    def time_plans(plans):
        set_plans(model, plans)
        return step.scale * step.blocks_seconds() + step.head_seconds()

    candidates = {"measured": chosen, "default": {**chosen, **default}}
    best, fastest = pick(("default", "measured"), lambda n: time_plans(candidates[n]), rounds)
    result = {**result, "plans": candidates[best]}
    result["confirmed"] = {"kept": best, **{f"{n}_s": s for n, s in fastest.items()}}
    set_plans(model, result["plans"])
    return result
