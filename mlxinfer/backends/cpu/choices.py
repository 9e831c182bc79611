"""Choosing between options by timing them: :func:`pick` (interleaved rounds, the plainer
option kept unless another is ``KEEP_IF_FASTER`` faster) for the stream plans (``timing``), and
the threshold kinds' crossovers, each timed on one op alone (:func:`crossover`): from how many
keys, rows or elements the other form wins (``kinds.THRESHOLDS``).
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ...models import layers as model_layers
from . import compiled, ops, parallel, quantized
from .kinds import (
    NEVER,
    attention_layers,
    exponential_users,
    float_products,
    int16_heads,
    int16_linears,
    quantized_linears,
)

ROUNDS = 5  # interleaved rounds per choice timed on decode steps
KEEP_IF_FASTER = 0.97  # a plan must save at least 3% of a step over the plainer option
CROSSOVER_ROUNDS = 3  # ... per size of a crossover (one op alone, many runs per timing: less noisy)
# A crossover stops after two sizes in a row where the other option takes under this fraction of
# the plain one's time: every crossover timed here widens with the size (the quantized kernel's time grows with
# the rows, the dequantized product's hardly; the long form and the fast exponential gain more on
# more elements), so past such a size the plain option does not come back.
FAR = 0.5
CROSSOVER_RUN_S = 0.003  # about how long one timing of a crossover's option runs (repeated runs)
LONG_KEYS_TRIED = (512, 1024, 2048, 4096, 8192)
# Rows tried for dequantize_rows; from 64 rows on the BLAS product won by far on every machine
# measured (at 512 rows ~10x), and the quantized kernel's time grows with the rows.
DEQUANTIZE_ROWS_TRIED = (2, 4, 8, 16, 32, 64)
# Rows tried for int16_rows: on the AMD EPYC VM the int16 product won from 32 rows (1.7-2.8x at
# 127 rows, against the several-row kernel and the dequantized BLAS product alike).
INT16_ROWS_TRIED = (8, 16, 32, 64, 128)
# Rows tried for int16_head: a decode step's (1) and the batching engine's (its rows a step).
INT16_HEAD_TRIED = (1, 2, 4, 8, 16)
SMALL_TRIED = tuple(1 << n for n in range(12, 20))  # elements tried for small
# Query rows tried for dequantized_attention, over a cache of DEQUANTIZED_KEYS 8-bit keys.
DEQUANTIZED_ROWS_TRIED = (2, 4, 8, 16, 32)
DEQUANTIZED_KEYS = 512
PAD_ROWS_TRIED = (2, 3, 4, 6, 8, 11, 15)  # rows tried for pad_rows (each padded to 16)


def pick(
    options: tuple,
    time_option: Callable[[object], float],
    rounds: int | None = None,
    *,
    alternate: bool = False,
) -> tuple[object, dict]:
    """The plainest option unless a later one is ``KEEP_IF_FASTER`` faster than the best so far;
    options timed in ``rounds`` (default ``ROUNDS``) interleaved rounds (with ``alternate``, every
    other round in reverse order: one switch per round, for options that are costly to switch).
    Returns (option, fastest seconds by option): other work on the machine only ever adds time,
    so an option's fastest round is the nearest to its quiet time."""
    seconds: dict = {option: [] for option in options}
    for n in range(ROUNDS if rounds is None else rounds):
        for option in options[::-1] if alternate and n % 2 else options:
            seconds[option].append(time_option(option))
    fastest = {option: min(s) for option, s in seconds.items()}
    best = options[0]
    for option in options[1:]:
        if fastest[option] < KEEP_IF_FASTER * fastest[best]:
            best = option
    return best, fastest


def compute_dtype(layer: nn.Module) -> mx.Dtype:
    """The float dtype ``layer`` computes in: an affine layer's scales', a float layer's weight's;
    float32 for MLX's float modes (mxfp4, nvfp4, mxfp8), whose scales are uint8 exponents."""
    for key in ("scales", "weight"):
        if key in layer and mx.issubdtype(layer[key].dtype, mx.floating):
            return layer[key].dtype
    return mx.float32


def attention_shapes(model: nn.Module) -> tuple[int, int, int, mx.Dtype] | None:
    """(query heads, kv heads, head size, dtype) of the model's grouped-query attention."""
    for module in attention_layers(model):
        if all(hasattr(module, a) for a in ("n_heads", "n_kv_heads", "head_dim")):
            proj = module.get("o_proj")
            dtype = compute_dtype(proj) if proj is not None else mx.float32
            return module.n_heads, module.n_kv_heads, module.head_dim, dtype
    return None


def measure_long_keys(model: nn.Module) -> tuple[int, dict]:
    """The fewest cached keys from which the long-context decode attention is faster, timed on
    random queries, keys and values of the model's shapes; ``NEVER`` if it never is."""
    shapes = attention_shapes(model)
    if shapes is None:
        return ops.DECODE_LONG_KEYS, {}
    n_q, n_kv, d, dtype = shapes
    q = mx.random.normal((1, n_q, 1, d)).astype(dtype)
    # Random keys of the shortest length, repeated: MLX's CPU normal sampler would take longer
    # than the timings themselves.
    block = [mx.random.normal((1, n_kv, LONG_KEYS_TRIED[0], d)).astype(dtype) for _ in range(2)]

    def timer(t):
        k, v = (mx.tile(b, (1, 1, t // b.shape[2], 1)) for b in block)
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
    dtype = compute_dtype(layer)

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


def measure_int16_rows(model: nn.Module) -> tuple[int, dict]:
    """The fewest rows from which a quantized layer's int16 product (``compiled.int16_product``)
    is faster than the product it replaces at that many rows (the few-row kernel below
    ``dequantize_rows``, which is timed first, the dequantized BLAS product from there), timed on
    the largest layer it takes."""
    linears = [m for m in int16_linears(model) if isinstance(m, quantized.CPUQuantizedLinear)]
    if not linears:  # a tied head alone: as the blocks' products would have it, never
        return NEVER, {}
    layer = max(linears, key=lambda m: m["weight"].size)
    in_features = layer["scales"].shape[-1] * layer.group_size
    dtype = compute_dtype(layer)

    def timer(rows):
        x = mx.random.normal((1, rows, in_features)).astype(dtype)
        mx.eval(x)

        def run(threshold):
            if rows >= threshold:
                mx.eval(compiled.int16_product(x, layer))
            else:
                mx.eval(layer._few_rows(x) if rows < layer.MIN_ROWS else layer._many_rows(x))

        return run

    threshold, seconds = crossover(INT16_ROWS_TRIED, timer, NEVER, 1)
    return threshold, {r: {"float": a, "int16": b} for r, (a, b) in seconds.items()}


def measure_int16_head(model: nn.Module) -> tuple[int, dict]:
    """The most rows up to which a quantized tied LM head's few-row products (decode) are faster
    through the int16 kernel (``compiled.int16_product``, its few-row path) than through the
    product they replace (``parallel.quantized_product``), timed on the head alone at each of
    ``INT16_HEAD_TRIED`` while it wins; 0 if it loses at one row."""
    head = getattr(model, "head", None)
    if head is None or head not in int16_heads(model):
        return 0, {}
    dtype = compute_dtype(head)
    seconds: dict = {}
    most = 0
    for rows in INT16_HEAD_TRIED:
        x = mx.random.normal((1, rows, head["scales"].shape[-1] * head.group_size)).astype(dtype)
        mx.eval(x)
        forms = {
            "float": lambda x=x: parallel.quantized_product(x, head),
            "int16": lambda x=x: compiled.int16_product(x, head),
        }
        mx.eval(forms["float"]())  # warm-up
        reps = max(2, min(20, int(CROSSOVER_RUN_S / max(_seconds(forms["float"]), 1e-6))))

        def time_option(option, reps=reps, forms=forms):
            start = time.perf_counter()
            for _ in range(reps):
                mx.eval(forms[option]())
            return (time.perf_counter() - start) / reps

        form, fastest = pick(("float", "int16"), time_option, CROSSOVER_ROUNDS)
        seconds[rows] = fastest
        if form != "int16":
            break
        most = rows
    return most, seconds


def _seconds(run) -> float:
    start = time.perf_counter()
    mx.eval(run())
    return time.perf_counter() - start


def measure_small(model: nn.Module) -> tuple[int, dict]:
    """The fewest elements from which SwiGLU through the fast exponential beats MLX's own ops."""
    dtype = mx.float32
    for module in exponential_users(model):
        if isinstance(module, model_layers.GatedMLP):
            dtype = compute_dtype(module.up_proj)
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


def measure_pad_rows(model: nn.Module) -> tuple[int, dict]:
    """The fewest rows (of fewer than ``ops.PAD_ROWS``) from which a float product is faster
    padded to ``ops.PAD_ROWS`` rows, timed on the blocks' largest float weight (the LM head
    follows it)."""
    weights = []
    head = getattr(model, "head", None)
    for m in (m for m in float_products(model) if m is not head):
        if getattr(m, "cpu_fused", None) is not None:
            weights.append(m.cpu_fused[0].weight)
        else:
            weights.append(m["weight_t"].T if "weight_t" in m else m["weight"])
    w = max(weights, key=lambda w: w.size)

    def timer(rows):
        x = mx.random.normal((1, rows, w.shape[1])).astype(w.dtype)
        mx.eval(x)
        return lambda pad_rows: mx.eval(ops.padded_product(x, lambda z: z @ w.T, pad_rows))

    threshold, seconds = crossover(PAD_ROWS_TRIED, timer, NEVER, 1)
    return threshold, {r: {"own": a, "padded": b} for r, (a, b) in seconds.items()}


def crossover(sizes: tuple[int, ...], timer, plain, other) -> tuple[int, dict]:
    """The smallest size from which ``other`` is faster than ``plain`` at that size and every larger
    one tried (``NEVER`` if at none), or up to where it wins by far twice (``FAR``);
    ``timer(size)`` gives ``run(option)``. Each size's two options are timed in interleaved rounds
    (:func:`pick`), a few runs per timing."""
    seconds, threshold, far = {}, NEVER, 0
    for size in sizes:
        run = timer(size)
        start = time.perf_counter()
        run(plain)  # also a warm-up
        reps = max(2, min(20, int(CROSSOVER_RUN_S / max(time.perf_counter() - start, 1e-6))))

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
        far = far + 1 if medians[other] < FAR * medians[plain] else 0
        if far == 2:
            break  # won by far at two sizes in a row: the larger ones are not timed
    return threshold, seconds
