"""Timing the plans' options on the model: decode steps for the stream plans, one op alone
for the crossovers. Every choice keeps the plainer option unless another is 3% faster.

A decode step is timed by its parts (:class:`DecodeStep`): the first few blocks, scaled to
all of them, and the LM head alone, each part only for the kinds that act on it. For SmolLM2
the estimate is within a few percent of whole steps, and every choice takes about half a
second instead of 2.7 s (docs/performance.md).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ...models import layers as model_layers
from ...models.base import lm_head
from . import compiled, ops, quantized
from .kinds import (
    NEVER,
    NUMERIC,
    OPTIONS,
    attention_layers,
    exponential_users,
    float_products,
    int16_linears,
    numeric_kinds,
    options_of,
    plan_layers,
    quantized_linears,
    set_plan,
    set_plans,
)

ROUNDS = 5  # interleaved rounds per choice timed on decode steps
CROSSOVER_ROUNDS = 3  # ... per size of a crossover (one op alone, many runs per timing: less noisy)
# A crossover stops after two sizes in a row where the other option takes under this fraction of
# the plain one's time: every crossover timed here widens with the size (the quantized kernel's time grows with
# the rows, the dequantized product's hardly; the long form and the fast exponential gain more on
# more elements), so past such a size the plain option does not come back.
FAR = 0.5
CROSSOVER_RUN_S = 0.003  # about how long one timing of a crossover's option runs (repeated runs)
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
KEEP_IF_FASTER = 0.97  # a plan must save at least 3% of a step over the plainer option
LONG_KEYS_TRIED = (512, 1024, 2048, 4096, 8192)
# Rows tried for dequantize_rows; from 64 rows on the BLAS product won by far on every machine
# measured (at 512 rows ~10x), and the quantized kernel's time grows with the rows.
DEQUANTIZE_ROWS_TRIED = (2, 4, 8, 16, 32, 64)
# Rows tried for int16_rows: on the AMD EPYC VM the int16 product won from 32 rows (1.7-2.8x at
# 127 rows, against the several-row kernel and the dequantized BLAS product alike).
INT16_ROWS_TRIED = (8, 16, 32, 64, 128)
SMALL_TRIED = tuple(1 << n for n in range(12, 20))  # elements tried for small
# Query rows tried for dequantized_attention, over a cache of DEQUANTIZED_KEYS 8-bit keys.
DEQUANTIZED_ROWS_TRIED = (2, 4, 8, 16, 32)
DEQUANTIZED_KEYS = 512
PAD_ROWS_TRIED = (2, 3, 4, 6, 8, 11, 15)  # rows tried for pad_rows (each padded to 16)
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
            if kind not in ("matvec", "kernel_threads", "decode")
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
        # The kernels' threads act on the head too.
        with_head = kind == "kernel_threads" or any(layer is model.head for layer in found[kind])
        with_blocks = kind != "head"
        blocks = None if with_blocks else step.scale * step.blocks_seconds(3)

        def time_option(option, kind=kind, with_head=with_head, blocks=blocks, head=head):
            set_plan(model, kind, option)
            b = step.scale * step.blocks_seconds() if blocks is None else blocks
            return b + (step.head_seconds() if with_head else head)

        # matvec switches a split MLP's down projection between two layouts (a copy): alternated
        chosen[kind], seconds[kind] = pick(
            options[kind], time_option, rounds, alternate=kind == "matvec"
        )
        set_plan(model, kind, chosen[kind])
        if kind == "head":
            head = seconds[kind][chosen[kind]] - blocks
    if "skipped" not in seconds:
        for kind, measure_kind in (
            ("long_keys", measure_long_keys),
            ("dequantize_rows", measure_dequantize_rows),
            ("int16_rows", measure_int16_rows),
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
