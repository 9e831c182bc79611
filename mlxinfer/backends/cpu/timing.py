"""Timing the plans' options on the model: decode steps for the stream plans, one op alone
for the crossovers. Every choice keeps the plainer option unless another is 3% faster.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ...models import layers as model_layers
from . import ops, quantized
from .kinds import (
    NEVER,
    NUMERIC,
    OPTIONS,
    attention_layers,
    exponential_users,
    numeric_kinds,
    plan_layers,
    quantized_linears,
    set_plan,
    set_plans,
)

ROUNDS = 5  # interleaved rounds per choice timed on decode steps
CROSSOVER_ROUNDS = 3  # ... per size of a crossover (one op alone, many runs per timing: less noisy)
BUDGET_S = 1.5  # about how long all decode-step timings together may take
# Past this estimate (slow models: float16 on the CPU, large ones) nothing is timed and the plans
# stay at their plainest: a step is then long enough that the plans are noise in it.
MAX_MEASURE_S = 4.0
KEEP_IF_FASTER = 0.97  # a plan must save at least 3% of a step over the plainer option
LONG_KEYS_TRIED = (512, 1024, 2048, 4096, 8192)
# Rows tried for dequantize_rows; from 64 rows on the BLAS product won by far on every machine
# measured (at 512 rows ~10x), and the quantized kernel's time grows with the rows.
DEQUANTIZE_ROWS_TRIED = (2, 4, 8, 16, 32, 64)
SMALL_TRIED = tuple(1 << n for n in range(12, 20))  # elements tried for small
# Query rows tried for dequantized_attention, over a cache of DEQUANTIZED_KEYS 8-bit keys.
DEQUANTIZED_ROWS_TRIED = (2, 4, 8, 16, 32)
DEQUANTIZED_KEYS = 512


def prompt_cache(model: nn.Module) -> list:
    """A cache holding a 4-token prompt, for the decode steps that are timed."""
    vocab = model.args.vocab_size
    cache = model.make_cache()
    mx.eval(model(mx.array([[(7 + 13 * i) % vocab for i in range(4)]]), cache))
    return cache


def decode_step_seconds(model: nn.Module, steps: int, cache: list | None = None) -> float:
    """Median seconds of ``steps`` decode steps after a 4-token prompt in ``cache`` (one is
    made if None; the steps extend it)."""
    cache = prompt_cache(model) if cache is None else cache
    token = mx.array([[1]])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        mx.eval(model(token, cache))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pick(
    options: tuple, time_option: Callable[[object], float], rounds: int | None = None
) -> tuple[object, dict]:
    """The plainest option unless a later one is ``KEEP_IF_FASTER`` faster than the best so far;
    options timed in ``rounds`` (default ``ROUNDS``) interleaved rounds. Returns (option, median
    seconds by option)."""
    seconds: dict = {option: [] for option in options}
    for _ in range(ROUNDS if rounds is None else rounds):
        for option in options:
            seconds[option].append(time_option(option))
    medians = {option: statistics.median(s) for option, s in seconds.items()}
    best = options[0]
    for option in options[1:]:
        if medians[option] < KEEP_IF_FASTER * medians[best]:
            best = option
    return best, medians


def measure(model: nn.Module, fixed: dict[str, str | int] | None = None) -> dict:
    """Choose each kind of plan the model has by timing its options; ``fixed`` kinds are not
    measured. Returns {"plans": {kind: option}, "seconds": {kind: {option: s}}, ...}."""
    fixed = dict(fixed or {})
    found = plan_layers(model)
    kinds = [kind for kind in OPTIONS if found[kind] and kind not in fixed]
    chosen: dict[str, str | int] = {kind: OPTIONS[kind][0] for kind in OPTIONS if found[kind]}
    chosen.update({k: v for k, v in fixed.items() if k in NUMERIC or found.get(k)})
    set_plans(model, chosen)
    seconds: dict[str, dict] = {}
    steps = 0
    if kinds:
        # One cache for every timing: a quantized prefill is slow (MLX's scalar kernel).
        cache = prompt_cache(model)
        first = decode_step_seconds(model, 1, cache)  # also a warm-up
        n_options = sum(len(OPTIONS[kind]) for kind in kinds)
        steps = max(1, min(8, int(BUDGET_S / (n_options * ROUNDS * max(first, 1e-4)))))
        if steps * n_options * ROUNDS * first > MAX_MEASURE_S:
            kinds, seconds["skipped"] = [], {"step_s": first}
    for kind in kinds:

        def time_option(option, kind=kind):
            set_plan(model, kind, option)
            return decode_step_seconds(model, steps, cache)

        chosen[kind], seconds[kind] = pick(OPTIONS[kind], time_option)
        set_plan(model, kind, chosen[kind])
    if "skipped" not in seconds:
        for kind, measure_kind in (
            ("long_keys", measure_long_keys),
            ("dequantize_rows", measure_dequantize_rows),
            ("small", measure_small),
            ("dequantized_attention", measure_dequantized_attention),
        ):
            if kind not in fixed and kind in numeric_kinds(model):
                chosen[kind], seconds[kind] = measure_kind(model)
    set_plans(model, chosen)
    return {"plans": chosen, "seconds": seconds, "steps": steps}


def attention_shapes(model: nn.Module) -> tuple[int, int, int, mx.Dtype] | None:
    """(query heads, kv heads, head size, dtype) of the model's grouped-query attention."""
    for module in attention_layers(model):
        if all(hasattr(module, a) for a in ("n_heads", "n_kv_heads", "head_dim")):
            proj = module.get("o_proj")
            dtype = proj["scales"].dtype if proj is not None and "scales" in proj else None
            if proj is not None and dtype is None:
                dtype = proj["weight"].dtype
            return module.n_heads, module.n_kv_heads, module.head_dim, dtype or mx.float32
    return None


def measure_long_keys(model: nn.Module) -> tuple[int, dict]:
    """The fewest cached keys from which the long-context decode attention is faster, timed on
    random queries, keys and values of the model's shapes; ``NEVER`` if it never is."""
    shapes = attention_shapes(model)
    if shapes is None:
        return ops.DECODE_LONG_KEYS, {}
    n_q, n_kv, d, dtype = shapes
    q = mx.random.normal((1, n_q, 1, d)).astype(dtype)

    def timer(t):
        k, v = (mx.random.normal((1, n_kv, t, d)).astype(dtype) for _ in range(2))
        mx.eval(q, k, v)
        return lambda long_keys: mx.eval(
            ops.attention(q, k, v, scale=d**-0.5, mask=None, long_keys=long_keys)
        )

    threshold, seconds = crossover(LONG_KEYS_TRIED, timer, NEVER, 1)
    return threshold, {t: {"short": a, "long": b} for t, (a, b) in seconds.items()}


def measure_dequantize_rows(model: nn.Module) -> tuple[int, dict]:
    """The fewest rows from which a quantized layer's dequantize-and-BLAS product is faster than
    its quantized kernel (the decode plan's, by parts), timed on the largest quantized layer."""
    layer = max(quantized_linears(model), key=lambda m: m["weight"].size)
    in_features = layer["scales"].shape[-1] * layer.group_size
    dtype = layer["scales"].dtype

    def timer(rows):
        x = mx.random.normal((1, rows, in_features)).astype(dtype)
        mx.eval(x)
        # threshold NEVER: the quantized kernel; 1: the dequantized product
        return lambda min_rows: mx.eval(
            layer._few_rows(x) if min_rows > rows else layer._many_rows(x)
        )

    threshold, seconds = crossover(DEQUANTIZE_ROWS_TRIED, timer, NEVER, 1)
    if threshold == NEVER:  # never faster up to the largest tried: take it from past there
        threshold = 2 * DEQUANTIZE_ROWS_TRIED[-1]
    return threshold, {r: {"quantized": a, "dequantized": b} for r, (a, b) in seconds.items()}


def measure_small(model: nn.Module) -> tuple[int, dict]:
    """The fewest elements from which SwiGLU through the fast exponential beats MLX's own ops."""
    dtype = mx.float32
    for module in exponential_users(model):
        if isinstance(module, model_layers.GatedMLP) and "weight" in module.up_proj:
            dtype = module.up_proj["weight"].dtype
            break
        if isinstance(module, model_layers.GatedMLP) and "scales" in module.up_proj:
            dtype = module.up_proj["scales"].dtype
            break

    def timer(n):
        g, u = (mx.random.normal((1, n)).astype(dtype) for _ in range(2))
        mx.eval(g, u)
        return lambda small: mx.eval(ops.swiglu(g, u, small=small))

    threshold, seconds = crossover(SMALL_TRIED, timer, NEVER, 1)
    return threshold, {n: {"mlx": a, "fast_exp": b} for n, (a, b) in seconds.items()}


def measure_dequantized_attention(model: nn.Module) -> tuple[int, dict]:
    """The fewest queries from which attention over a quantized (8-bit) KV cache is faster
    dequantized first than through MLX's quantized matmul, on the model's attention shapes."""
    shapes = attention_shapes(model)
    group = 64  # the quantized cache's default group (QuantizedKVCache)
    if shapes is None or shapes[2] % group:
        return ops.DEQUANTIZED_ATTENTION_ROWS, {}
    n_q, n_kv, d, dtype = shapes
    k, v = (
        mx.quantize(mx.random.normal((1, n_kv, DEQUANTIZED_KEYS, d)), group_size=group, bits=8)
        for _ in range(2)
    )
    mx.eval(k, v)

    def timer(rows):
        q = mx.random.normal((1, n_q, rows, d)).astype(dtype)
        mx.eval(q)

        def run(threshold):
            if rows < threshold:
                out = model_layers.quantized_attention(
                    q, k, v, scale=d**-0.5, mask="causal", group_size=group, bits=8
                )
            else:
                kd, vd = (
                    quantized.dequantize(*t, group_size=group, bits=8).astype(dtype) for t in (k, v)
                )
                out = ops.attention(q, kd, vd, scale=d**-0.5, mask="causal")
            mx.eval(out)

        return run

    threshold, seconds = crossover(DEQUANTIZED_ROWS_TRIED, timer, NEVER, 1)
    if threshold == NEVER:  # never faster up to the largest tried: take it from past there
        threshold = 2 * DEQUANTIZED_ROWS_TRIED[-1]
    return threshold, {r: {"quantized": a, "dequantized": b} for r, (a, b) in seconds.items()}


def crossover(sizes: tuple[int, ...], timer, plain, other) -> tuple[int, dict]:
    """The smallest size from which ``other`` is faster than ``plain`` at that size and every larger
    one tried (``NEVER`` if at none); ``timer(size)`` gives ``run(option)``. Each size's two
    options are timed in interleaved rounds (:func:`pick`), a few runs per timing."""
    seconds, threshold = {}, NEVER
    for size in sizes:
        run = timer(size)
        start = time.perf_counter()
        run(plain)  # also a warm-up
        reps = max(2, min(20, int(0.01 / max(time.perf_counter() - start, 1e-6))))

        def time_option(option, reps=reps, run=run):
            start = time.perf_counter()
            for _ in range(reps):
                run(option)
            return (time.perf_counter() - start) / reps

        form, medians = pick((plain, other), time_option, CROSSOVER_ROUNDS)
        seconds[size] = (medians[plain], medians[other])
        if form == other and threshold == NEVER:
            threshold = size
        elif form == plain:
            threshold = NEVER  # only a crossover that holds for every larger size counts
    return threshold, seconds
