"""Which of the CPU backend's decode plans pay on this machine: measured, not assumed.

The plans (``parallel``) spread a decode step's one-row products over two CPU
streams. Tuned on one machine (bandwidth probe 23.6 GB/s) they decoded
SmolLM2-135M f32 1.45–1.58× as fast as mlx-lm; on an AMD EPYC (33.6 GB/s) they
made it 0.60–0.80× as fast (docs/performance.md). So each is a *choice*, and
at load :func:`choose` times the model's own decode step under each option,
keeping an option only if it beats the plainer one by 3%:

- ``cut``: large float Linears cut by rows over the two streams, or one call;
- ``halves``: float gated MLPs as two half MLPs side by side, or one MLP;
- ``head``: the float LM head in blocks over the two streams, or one product;
- ``fuse``: float siblings (q/k/v, gate/up) as one stacked product, or one product each
  (``fused``);
- ``quantized``: quantized layers in one call, cut in halves over the two streams, with
  siblings (q/k/v, gate/up) whole side by side, or side by side with the largest cut to
  balance the streams (``parallel.plan_siblings``);
- ``long_keys``: from how many cached keys decode attention takes its long-context
  form (``ops._attend``), timed on the model's attention shapes alone;
- ``dequantize_rows``: from how many rows a quantized layer dequantizes its weight for
  a BLAS product instead of running MLX's quantized kernel (short prompts, speculative
  verification), timed on the model's largest quantized layer alone;
- ``small``: from how many elements the softmax and SwiGLU use the fast exponential's
  kernels instead of MLX's own ops, timed on SwiGLU alone (short prompts).

The choices are made one after the other (each with the ones before it
settled), in interleaved rounds, in about a second. The answer is cached in
the user cache (``cpu-plans.json``), keyed by the CPU, the number of CPUs, MLX,
the BLAS and the model's shapes, so the timing runs once per machine and model.

``MLXINFER_CPU_PLANS`` skips the measurement: ``off`` (every plan at its
plainest: one stream, no long-context form), ``on`` (every plan at its most
parallel, long-context form from ``ops.DECODE_LONG_KEYS`` keys), or a list
such as ``cut=two,halves=one,quantized=siblings,long_keys=2048`` (the kinds
not named are measured).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ...blas import preloaded_blas
from ...machine import cpu_name, user_cache_dir
from ...models import layers as model_layers
from . import ops, parallel, quantized

ENV = "MLXINFER_CPU_PLANS"
VERSION = 5  # of the cached entries: bump when the kinds or options change
ROUNDS = 5  # interleaved rounds per choice timed on decode steps
CROSSOVER_ROUNDS = 3  # ... per size of a crossover (one op alone, many runs per timing: less noisy)
BUDGET_S = 1.5  # about how long all decode-step timings together may take
# Past this estimate (slow models: float16 on the CPU, large ones) nothing is timed and the plans
# stay at their plainest: a step is then long enough that the plans are noise in it.
MAX_MEASURE_S = 4.0
KEEP_IF_FASTER = 0.97  # a plan must save at least 3% of a step over the plainer option
NEVER = 1 << 30  # long_keys: the long-context form is never taken
LONG_KEYS_TRIED = (512, 1024, 2048, 4096, 8192)
# Rows tried for dequantize_rows; from 64 rows on the BLAS product won by far on every machine
# measured (at 512 rows ~10x), and the quantized kernel's time grows with the rows.
DEQUANTIZE_ROWS_TRIED = (2, 4, 8, 16, 32, 64)
SMALL_TRIED = tuple(1 << n for n in range(12, 20))  # elements tried for small
NUMERIC = ("long_keys", "dequantize_rows", "small")  # kinds whose option is a threshold

# kind -> options, plainest first.
OPTIONS: dict[str, tuple[str, ...]] = {
    "cut": ("one", "two"),
    "halves": ("one", "two"),
    "head": ("one", "two"),
    "fuse": ("separate", "fused"),
    "quantized": ("one", "halves", "siblings", "balanced"),
}
MOST_PARALLEL = {
    "cut": "two",
    "halves": "two",
    "head": "two",
    "fuse": "fused",
    "quantized": "siblings",
}


def plan_layers(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The layers each kind of plan acts on (empty lists for kinds the model lacks)."""
    found: dict[str, list[nn.Module]] = {kind: [] for kind in OPTIONS}
    head = getattr(model, "head", None)
    for module in model.modules():
        if isinstance(module, parallel.TransposedLinear):
            found["halves"].append(module)
        elif isinstance(module, parallel.CPULinear):
            found["cut"].append(module)
        elif isinstance(module, quantized.CPUQuantizedLinear):
            found["quantized"].append(module)
        if getattr(module, "cpu_fused", (None, 1))[1] == 0:  # the first of its siblings
            found["fuse"].append(module)
    if (
        head is not None
        and "scales" not in head
        and head["weight"].shape[0] > 2 * parallel.HEAD_CHUNK
    ):
        found["head"].append(head)
    elif head is not None and "scales" in head and not isinstance(head, nn.QuantizedLinear):
        found["quantized"].append(head)  # a quantized tied embedding, by parts
    return found


def attention_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, model_layers.Attention)]


def quantized_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, quantized.CPUQuantizedLinear)]


def exponential_users(model: nn.Module) -> list[nn.Module]:
    """The layers that choose between MLX's ops and the fast exponential (``ops.SMALL``)."""
    kinds = (model_layers.Attention, model_layers.GatedMLP)
    return [m for m in model.modules() if isinstance(m, kinds)]


def numeric_kinds(model: nn.Module) -> list[str]:
    """The threshold kinds that act on this model."""
    return [
        kind
        for kind, layers in (
            ("long_keys", attention_layers(model)),
            ("dequantize_rows", quantized_linears(model)),
            ("small", exponential_users(model)),
        )
        if layers
    ]


def set_plan(model: nn.Module, kind: str, option: str | int) -> None:
    """Set one kind of plan on every layer it acts on; outputs stay the same (up to rounding)."""
    if kind == "long_keys":
        for module in attention_layers(model):
            object.__setattr__(module, "cpu_long_keys", int(option))
        return
    if kind == "dequantize_rows":
        for module in quantized_linears(model):
            object.__setattr__(module, "MIN_ROWS", int(option))
        return
    if kind == "small":
        for module in exponential_users(model):
            object.__setattr__(module, "cpu_small", int(option))
        return
    if option not in OPTIONS[kind]:
        raise ValueError(f"{ENV}: '{kind}' takes one of {', '.join(OPTIONS[kind])}, not '{option}'")
    for layer in plan_layers(model)[kind]:
        if kind == "fuse":
            layer.cpu_fused[0].on = option == "fused"
            continue
        plan = parallel.plan_of(layer)
        plan.two_streams = option != "one"
        if kind == "quantized":
            parts = {"siblings": plan.sibling_parts, "balanced": plan.balanced_parts}
            plan.parts = parts.get(option)


def current(model: nn.Module) -> dict[str, str | int]:
    """The plans the model's layers hold now, {kind: option}."""
    plans: dict[str, str | int] = {}
    for kind, found in plan_layers(model).items():
        if found and kind == "fuse":
            plans[kind] = "fused" if found[0].cpu_fused[0].on else "separate"
        elif found:
            plan = parallel.plan_of(found[0])
            if not plan.two_streams:
                plans[kind] = "one"
            elif kind == "quantized":
                plans[kind] = "halves"
                for m in found:
                    plan = parallel.plan_of(m)
                    if plan.parts is not None and plan.parts != plan.sibling_parts:
                        plans[kind] = "balanced"
                        break
                    if plan.parts is not None:
                        plans[kind] = "siblings"
            else:
                plans[kind] = "two"
    attention = attention_layers(model)
    if attention:
        plans["long_keys"] = getattr(attention[0], "cpu_long_keys", ops.DECODE_LONG_KEYS)
    if quantized_linears(model):
        plans["dequantize_rows"] = quantized_linears(model)[0].MIN_ROWS
    if exponential_users(model):
        plans["small"] = getattr(exponential_users(model)[0], "cpu_small", ops.SMALL)
    return plans


def set_plans(model: nn.Module, plans: dict[str, str | int]) -> None:
    for kind, option in plans.items():
        set_plan(model, kind, option)


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


def cache_key(model: nn.Module) -> str:
    """The machine, MLX, the BLAS and the shapes the plans act on."""
    shapes = sorted(
        (kind, type(m).__name__, tuple(m[k].shape), str(m[k].dtype))
        for kind, found in plan_layers(model).items()
        for m in found
        for k in ("weight", "weight_t")
        if k in m
    )
    parts = [
        VERSION,
        cpu_name(),
        os.cpu_count(),
        mx.__version__,
        preloaded_blas(),
        shapes,
        attention_shapes(model) and [str(s) for s in attention_shapes(model)],
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def cache_path() -> Path:
    return user_cache_dir() / "cpu-plans.json"


def forced_plans(value: str | None = None) -> dict[str, str | int] | None:
    """What ``value`` (by default ``MLXINFER_CPU_PLANS``) fixes: None (measure all), or
    {kind: option}."""
    value = (os.environ.get(ENV, "measure") if value is None else value).strip()
    if value in ("", "measure"):
        return None
    rows = quantized.CPUQuantizedLinear.MIN_ROWS
    if value == "off":
        plainest = {kind: options[0] for kind, options in OPTIONS.items()}
        return {**plainest, "long_keys": NEVER, "dequantize_rows": rows, "small": ops.SMALL}
    if value == "on":
        thresholds = {
            "long_keys": ops.DECODE_LONG_KEYS,
            "dequantize_rows": rows,
            "small": ops.SMALL,
        }
        return {**MOST_PARALLEL, **thresholds}
    plans: dict[str, str | int] = {}
    for item in value.split(","):
        kind, _, option = item.strip().partition("=")
        if kind in NUMERIC and option.isdigit():
            plans[kind] = int(option)
        elif kind in OPTIONS and option in OPTIONS[kind]:
            plans[kind] = option
        else:
            kinds = "; ".join(f"{k}: {'/'.join(o)}" for k, o in OPTIONS.items())
            raise ValueError(
                f"{ENV}={value!r}: expected 'on', 'off', 'measure' or kind=option items "
                f"({kinds}; long_keys, dequantize_rows, small: a number), found {item!r}"
            )
    return plans


def choose(model: nn.Module, *, log=None) -> dict[str, str | int]:
    """Set the decode plans to what is fastest on this machine for this model; returns them."""
    found = plan_layers(model)
    if not any(found.values()) and not attention_layers(model):
        return {}
    fixed = forced_plans()
    complete = fixed is not None and all(k in fixed for k in OPTIONS if found[k])
    if complete and all(k in fixed for k in numeric_kinds(model)):
        plans = {k: v for k, v in fixed.items() if k in numeric_kinds(model) or found.get(k)}
        set_plans(model, plans)
        return plans
    key = cache_key(model)
    path = cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    entry = known.get(key) if fixed is None else None
    if not isinstance(entry, dict) or not isinstance(entry.get("plans"), dict):
        entry = measure(model, fixed)
        if fixed is None:
            _store(path, {**known, key: entry})
        if log is not None:
            log(f"CPU decode plans (timed here, once): {describe(entry)}")
    set_plans(model, entry["plans"])
    return dict(entry["plans"])


def describe(entry: dict) -> str:
    parts = []
    skipped = entry.get("seconds", {}).get("skipped")
    if skipped:
        parts.append(f"not timed, a decode step takes {skipped['step_s']:.2f} s")
    for kind, option in entry["plans"].items():
        times = entry.get("seconds", {}).get(kind, {})
        if kind in NUMERIC:
            parts.append(f"{kind}={'never' if option == NEVER else option}")
        elif times:
            ms = ", ".join(f"{o} {s * 1e3:.1f} ms" for o, s in times.items())
            parts.append(f"{kind}={option} ({ms} per step)")
        else:
            parts.append(f"{kind}={option}")
    return "; ".join(parts)


def _store(path: Path, data: dict) -> None:
    """Write to a temporary file and rename it into place. A cache that cannot be written is
    skipped (the plans are measured again next time); the library prints nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, path)
    except OSError:
        pass
