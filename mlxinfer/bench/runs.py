"""mlxinfer's timed runs and the benchmark that puts them beside mlx-lm's."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
from mlx import nn

from .. import backends
from ..platform.device import wired_limit
from .bandwidth import (
    comparison_notes,
    environment,
    measure_bandwidth,
    roofline,
    weight_bytes_per_token,
)
from .common import ENGINES, METRICS, Log, Run
from .peer import require_mlx_lm, run_mlx_lm

# ---------------------------------------------------------------- input


def parse_lengths(text: str, option: str = "-p/--prompt-tokens") -> list[int]:
    """``"128,512"`` -> ``[128, 512]``; ValueError naming ``option`` otherwise."""
    items = [t.strip() for t in str(text).split(",")]
    try:
        values = [int(t) for t in items]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{option}: expected comma-separated positive integers, found '{text}'")
    return values


def parse_count(text: str, option: str, minimum: int) -> int:
    """An integer option of at least ``minimum``; ValueError naming ``option`` otherwise."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{option}: expected an integer >= {minimum}, found '{text}'")
    return value


def prompt_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """``n`` seeded random token ids, past the usual special ids 0–2."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab_size, n).tolist()


# ---------------------------------------------------------------- mlxinfer runs


def time_run(
    model: nn.Module,
    ids: list[int],
    max_tokens: int,
    kv_bits: int | None,
    prefill_step: int | None = None,
) -> tuple[Run, int, int]:
    """One greedy generation of exactly ``max_tokens`` tokens with a fresh cache.

    Returns ``(run, cache bytes, cached tokens)`` as the cache ends (it holds
    the prompt and all generated tokens but the last).
    """
    from ..cache.prompt import PromptCache
    from ..generation import generate_step
    from ..generation.prefill import DEFAULT_PREFILL_STEP

    mx.synchronize()
    mx.reset_peak_memory()
    count, t_first, t_last = 0, 0.0, 0.0
    t0 = time.perf_counter()
    pc = PromptCache(model.make_cache(kv_bits=kv_bits))
    with wired_limit():  # as stream_generate runs it (Metal only)
        for _token, _logprobs in generate_step(
            ids,
            model,
            prompt_cache=pc,
            max_tokens=max_tokens,
            prefill_step_size=prefill_step or DEFAULT_PREFILL_STEP,
        ):
            t_last = time.perf_counter()  # the token is a Python int: its step has finished
            if count == 0:
                t_first = t_last
            count += 1
    mx.synchronize()
    if count != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {count}")
    ttft = t_first - t0
    decode = count / (t_last - t_first) if t_last > t_first else float("nan")
    run = Run(
        ttft_s=ttft,
        prefill_tps=len(ids) / ttft,
        decode_tps=decode,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
    )
    return run, pc.nbytes, len(pc.tokens)


def summarize(runs: list[Run]) -> dict:
    """``{"runs": [...], "median": {metric: v}, "spread": {metric: [min, max]}}``."""
    rows = [asdict(r) for r in runs]
    return {
        "runs": rows,
        "median": {m: statistics.median(r[m] for r in rows) for m in METRICS},
        "spread": {m: [min(r[m] for r in rows), max(r[m] for r in rows)] for m in METRICS},
    }


# ---------------------------------------------------------------- the benchmark


def run_benchmark(
    model: nn.Module,
    model_dir: Path,
    prompt_lengths: list[int],
    *,
    max_tokens: int = 128,
    reps: int = 3,
    kv_bits: int | None = None,
    prefill_step: int | None = None,
    compare: str | None = None,
    bandwidth: tuple[float, str] | None = None,
    log: Log | None = None,
) -> dict:
    """Measure ``model`` at each prompt length; with ``compare="mlx-lm"`` mlx-lm too, alternating.

    Args:
        model: a loaded mlxinfer model (its weights are evaluated here).
        model_dir: its directory (mlx-lm loads the same one).
        prompt_lengths: prompt tokens per measurement.
        max_tokens: tokens generated per run (at least 2: decode speed needs two).
        reps: timed runs per prompt length and engine, after one warm-up.
        kv_bits: quantize mlxinfer's KV cache (4 or 8).
        prefill_step: prompt tokens per prefill chunk for both engines (None: each its own default).
        compare: ``"mlx-lm"`` or None.
        bandwidth: ``(GB/s, description)``; default :func:`measure_bandwidth`.
        log: progress messages.

    Returns the whole result as a JSON-ready dict (see ``mlxinfer bench --json``).
    """
    if not prompt_lengths or min(prompt_lengths) < 1:
        raise ValueError(f"prompt lengths: expected positive integers, found {prompt_lengths}")
    if max_tokens < 2:
        raise ValueError(
            f"max_tokens: expected at least 2 (decode speed needs two tokens), found {max_tokens}"
        )
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, found {reps}")
    if prefill_step is not None and prefill_step < 1:
        raise ValueError(f"prefill_step: expected at least 1, found {prefill_step}")
    if compare not in (None, "mlx-lm"):
        raise ValueError(f"compare: expected 'mlx-lm' or None, found {compare!r}")
    if compare:
        require_mlx_lm()
    log = log or (lambda _: None)
    mx.eval(model.parameters())  # weights are mapped lazily: load them outside the timed runs
    if bandwidth is None:
        log("measuring memory bandwidth …")
        bandwidth = measure_bandwidth()
    notes = comparison_notes(model, model_dir, kv_bits) if compare else []
    results = []
    for p in prompt_lengths:
        ids = prompt_ids(p, model.args.vocab_size)
        log(f"p={p}: mlxinfer warm-up")
        _, cache_bytes, cached = time_run(model, ids, max_tokens, kv_bits, prefill_step)
        weights = weight_bytes_per_token(model)  # after a decode: the CPU's tiles made
        runs = []
        for rep in range(reps):
            run, _, _ = time_run(model, ids, max_tokens, kv_bits, prefill_step)
            runs.append(run)
            log(
                f"p={p}: mlxinfer {rep + 1}/{reps}  prefill {run.prefill_tps:.1f} tok/s  "
                f"decode {run.decode_tps:.1f} tok/s  peak {run.peak_memory_gb * 1000:.0f} MB"
            )
        entry = {"prompt_tokens": p, "engines": {"mlxinfer": summarize(runs)}}
        if compare:
            log(
                f"p={p}: mlx-lm (python -m mlx_lm.benchmark, warm-up + {reps} trial{'s' * (reps > 1)}) …"
            )
            theirs = run_mlx_lm(model_dir, p, max_tokens, reps, prefill_step)
            entry["engines"]["mlx-lm"] = summarize(theirs)
            ours_m, theirs_m = (entry["engines"][e]["median"] for e in ENGINES)
            entry["ratios"] = {
                m: ours_m[m] / theirs_m[m] if theirs_m[m] else float("nan") for m in METRICS
            }
        entry["roofline"] = roofline(
            weights,
            cache_bytes,
            cached,
            p,
            max_tokens,
            bandwidth[0],
            entry["engines"]["mlxinfer"]["median"]["decode_tps"],
        )
        results.append(entry)
    return {
        "environment": environment(compare),
        "engine": backends.describe(model),
        "model": str(model_dir),
        "settings": {
            "prompt_tokens": list(prompt_lengths),
            "max_tokens": max_tokens,
            "reps": reps,
            "kv_bits": kv_bits,
            "prefill_step": prefill_step,
            "compare": compare,
        },
        "bandwidth": {"gb_per_s": bandwidth[0], "probe": bandwidth[1]},
        "notes": notes,
        "results": results,
    }
