"""Whether the CPU backend's float decode plans pay on this machine: measured, not assumed.

The float plans (``cpu_parallel``) spread a decode step's one-row products over
two CPU streams: large Linear layers cut by rows (``CPULinear``), gated MLPs
as two half MLPs (``TransposedLinear``), the LM head in blocks (``project``).
Tuned on one machine (bandwidth probe 23.6 GB/s), they decoded SmolLM2-135M
f32 1.45–1.58× as fast as mlx-lm; on an AMD EPYC (33.6 GB/s) they made it
0.60–0.80× as fast, and without them it was 24.6 against 16.4 tok/s
(docs/performance.md). So at load :func:`choose` times the model's own
decode step with the plans on and off, a few interleaved rounds, and keeps
the faster. The answer is cached in the user cache (``cpu-plans.json``),
keyed by the CPU, the number of CPUs, MLX, the BLAS and the model's shapes,
so the timing runs once per machine and model.

``MLXINFER_CPU_PLANS=on`` or ``=off`` skips the measurement. Quantized
models keep their plans (MLX's quantized CPU kernel is single-threaded, and
running it on two streams paid on both machines measured).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..blas import preloaded_blas
from ..machine import cpu_name, user_cache_dir
from . import cpu_parallel

ENV = "MLXINFER_CPU_PLANS"
ROUNDS = 3  # interleaved off/on rounds
BUDGET_S = (
    0.6  # about how long the whole measurement may take; fewer steps per round for big models
)
KEEP_IF_FASTER = 0.97  # the plans must save at least 3% of a step to be kept


def float_plan_layers(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The layers the float plans touch: cut Linears, split MLPs' down projections, LM heads."""
    layers = {"cut": [], "halves": [], "head": []}
    for module in model.modules():
        if isinstance(module, cpu_parallel.TransposedLinear):
            layers["halves"].append(module)
        elif "_float_plan_cut" in module.__dict__ or type(module) is cpu_parallel.CPULinear:
            layers["cut"].append(module)
        elif (
            isinstance(module, (nn.Linear, nn.Embedding))
            and "scales" not in module
            and module.weight.shape[0] > 2 * cpu_parallel.HEAD_CHUNK
        ):
            layers["head"].append(module)
    return layers


def set_float_plans(model: nn.Module, on: bool) -> None:
    """Turn the float plans on or off; outputs stay the same (up to float rounding)."""
    layers = float_plan_layers(model)
    for layer in layers["cut"]:
        layer.__dict__["_float_plan_cut"] = True
        layer.__class__ = cpu_parallel.CPULinear if on else nn.Linear
    for layer in layers["halves"]:
        layer.__dict__["_halves"] = on
    for layer in (*layers["cut"], *layers["head"]):  # an untied LM head may be a cut Linear too
        layer.__dict__["_blocked"] = on


def has_float_plans(model: nn.Module) -> bool:
    return any(float_plan_layers(model)[kind] for kind in ("cut", "halves"))


def decode_step_seconds(model: nn.Module, steps: int) -> float:
    """Median seconds of ``steps`` decode steps after a 16-token prompt, in a fresh cache."""
    vocab = model.args.vocab_size
    cache = model.make_cache()
    mx.eval(model(mx.array([[(7 + 13 * i) % vocab for i in range(16)]]), cache))
    token = mx.array([[1]])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        mx.eval(model(token, cache))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(model: nn.Module) -> dict:
    """Time decode steps with the plans off and on (interleaved rounds); the medians and the choice."""
    set_float_plans(model, True)
    first = decode_step_seconds(model, 1)  # also a warm-up
    steps = max(2, min(8, int(BUDGET_S / (2 * ROUNDS * max(first, 1e-4)))))
    seconds = {"off": [], "on": []}
    for _ in range(ROUNDS):
        for choice in ("off", "on"):
            set_float_plans(model, choice == "on")
            seconds[choice].append(decode_step_seconds(model, steps))
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    return {"on": on < KEEP_IF_FASTER * off, "step_s_off": off, "step_s_on": on, "steps": steps}


def cache_key(model: nn.Module) -> str:
    """The machine, MLX, the BLAS and the shapes the plans act on."""
    shapes = sorted(
        (type(m).__name__, tuple(m[k].shape), str(m[k].dtype))
        for kind in float_plan_layers(model).values()
        for m in kind
        for k in ("weight", "weight_t")
        if k in m
    )
    parts = [
        cpu_name(),
        os.cpu_count(),
        mx.__version__,
        preloaded_blas(),
        shapes,
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def cache_path() -> Path:
    return user_cache_dir() / "cpu-plans.json"


def choose(model: nn.Module, *, log=None) -> bool:
    """Set the float plans the way that is faster on this machine for this model; True if on.

    ``MLXINFER_CPU_PLANS`` = ``on`` / ``off`` decides without measuring.
    """
    if not has_float_plans(model):
        return False
    forced = os.environ.get(ENV, "measure")
    if forced in ("on", "off"):
        set_float_plans(model, forced == "on")
        return forced == "on"
    key = cache_key(model)
    path = cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key) if isinstance(known, dict) else None
    if not isinstance(entry, dict) or "on" not in entry:
        entry = measure(model)
        _store(path, {**(known if isinstance(known, dict) else {}), key: entry})
        if log is not None:
            log(
                f"CPU float plans {'on' if entry['on'] else 'off'}: a decode step took "
                f"{entry['step_s_on'] * 1e3:.1f} ms with them, {entry['step_s_off'] * 1e3:.1f} ms without"
            )
    set_float_plans(model, bool(entry["on"]))
    return bool(entry["on"])


def _store(path: Path, data: dict) -> None:
    """Write to a temporary file and rename it into place. A cache that cannot be written is
    skipped (the plans are measured again next time); the library prints nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
