"""``mlxinfer bench``: prefill, decode, TTFT and memory per prompt length, llama-bench style.

Definitions are mlx-lm's own (``mlx_lm.generate.stream_generate``, which its
``mlx_lm.benchmark`` reports), so that mlxinfer / mlx-lm ratios compare like
with like:

- TTFT (time to first token): from the call into the token generator to the
  first token received — prefill of the whole prompt plus the first sampled
  token;
- prefill tok/s = p / TTFT, for a prompt of p tokens;
- decode tok/s = n / (t_last − t_first) for n generated tokens: all n tokens
  over the time after the first one arrived (mlx-lm's ``generation_tps`` at
  its last step; the n − 1 intervals make it n / (n − 1) above the per-step
  rate);
- peak memory = ``mx.get_peak_memory()``, reset before each run; it includes
  the resident weights, as mlx-lm's does (its benchmark never resets it, so
  its peak also covers loading and its warm-up run).

Each run: p seeded random token ids (no tokenizer in the timed path), greedy,
EOS ignored, exactly n tokens from :func:`mlxinfer.generation.generate_step`
with a fresh cache. One warm-up run per prompt length, then ``reps`` timed runs.

mlx-lm is never imported: ``--compare mlx-lm`` runs ``python -m
mlx_lm.benchmark`` in a child process (on the same BLAS, via ``LD_PRELOAD``)
and parses its ``Trial`` lines. Each engine keeps its own defaults, e.g. its
prefill chunk (mlxinfer 512 tokens, mlx-lm's benchmark 2048), unless
``--prefill-step-size`` sets one for both.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import re
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from . import backends
from .blas import blas_in_use, preloaded_blas
from .device import wired_limit
from .errors import MlxInferError
from .machine import cpu_name

ENGINES = ("mlxinfer", "mlx-lm")
METRICS = ("prefill_tps", "decode_tps", "ttft_s", "peak_memory_gb")
Log = Callable[[str], None]


class BenchError(MlxInferError):
    """The mlx-lm child process failed or printed no results."""


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


@dataclass
class Run:
    """One timed generation (either engine)."""

    ttft_s: float
    prefill_tps: float
    decode_tps: float
    peak_memory_gb: float


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
    from .generation import generate_step
    from .prefill import DEFAULT_PREFILL_STEP
    from .prompt_cache import PromptCache

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


# ---------------------------------------------------------------- mlx-lm (child process)


def require_mlx_lm() -> None:
    """Raise unless mlx-lm can be run; looked up without importing it."""
    if importlib.util.find_spec("mlx_lm") is None:
        raise MlxInferError("--compare mlx-lm: mlx-lm is not installed (pip install mlx-lm)")


_TRIAL = re.compile(r"^\s*Trial\s+\d+:\s*(.*)$", re.MULTILINE)


def parse_trials(output: str) -> list[dict[str, float]]:
    """The ``Trial N:  prompt_tps=…, generation_tps=…, peak_memory=…, total_time=…`` lines of
    ``mlx_lm.benchmark``'s output, as dicts (peak_memory in GB)."""
    trials = []
    for fields in _TRIAL.findall(output):
        trial = {}
        for item in fields.split(","):
            key, sep, value = item.strip().partition("=")
            if sep:
                try:
                    trial[key] = float(value)
                except ValueError:
                    pass
        if {"prompt_tps", "generation_tps", "peak_memory"} <= trial.keys():
            trials.append(trial)
    if not trials:
        tail = (
            " | ".join(line.strip() for line in output.strip().splitlines()[-5:]) or "(no output)"
        )
        raise BenchError(
            f"mlx_lm.benchmark printed no 'Trial N: prompt_tps=…' lines; its output ended: {tail}"
        )
    return trials


def mlx_lm_command(
    model_dir: Path, prompt_tokens: int, max_tokens: int, reps: int, prefill_step: int | None = None
) -> list[str]:
    step = ["--prefill-step-size", str(prefill_step)] if prefill_step else []
    return [
        sys.executable,
        "-m",
        "mlx_lm.benchmark",
        "--model",
        str(model_dir),
        "-p",
        str(prompt_tokens),
        "-g",
        str(max_tokens),
        "-n",
        str(reps),
        *step,
    ]


def child_env() -> dict[str, str]:
    """This process's environment, plus ``LD_PRELOAD`` of the BLAS we preloaded (same BLAS for both)."""
    env = dict(os.environ)
    blas = preloaded_blas()
    if blas:
        env["LD_PRELOAD"] = ":".join(p for p in (blas, env.get("LD_PRELOAD")) if p)
    return env


def run_mlx_lm(
    model_dir: Path, prompt_tokens: int, max_tokens: int, reps: int, prefill_step: int | None = None
) -> list[Run]:
    """mlx-lm's own benchmark (its own warm-up, then ``reps`` trials) in a child process."""
    proc = subprocess.run(
        mlx_lm_command(model_dir, prompt_tokens, max_tokens, reps, prefill_step),
        env=child_env(),
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in proc.stdout.strip().splitlines()[-5:])
        raise BenchError(f"mlx_lm.benchmark exited with code {proc.returncode}: {tail}")
    runs = []
    for t in parse_trials(proc.stdout):
        ttft = prompt_tokens / t["prompt_tps"] if t["prompt_tps"] > 0 else float("nan")
        runs.append(
            Run(
                ttft_s=ttft,
                prefill_tps=t["prompt_tps"],
                decode_tps=t["generation_tps"],
                peak_memory_gb=t["peak_memory"],
            )
        )
    return runs


# ---------------------------------------------------------------- roofline


def weight_bytes_per_token(model: nn.Module) -> int:
    """Parameter bytes one decode step reads, as loaded.

    Every parameter is read once, except embedding tables that are only
    gathered: one row per token. The token embedding is read whole when it is
    also the LM head (tied); position tables (GPT-2's ``wpe``) never are.
    """
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    # GPT-2's args carry no flag: its head is always the token embedding.
    tied = getattr(model.args, "tie_word_embeddings", True)
    for _, module in model.named_modules():
        if not isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            continue
        rows = module.weight.shape[0]
        if tied and rows == model.args.vocab_size:
            continue
        table = sum(
            v.nbytes for _, v in tree_flatten(module.parameters())
        )  # weight (+ scales, biases)
        total -= table - table // rows
    return total


def roofline(
    weight_bytes: int,
    cache_bytes: int,
    cached_tokens: int,
    prompt_tokens: int,
    max_tokens: int,
    bandwidth_gb_s: float,
    decode_tps: float,
) -> dict:
    """The bandwidth-bound decode limit: each step reads the weights and the KV cache once.

    Decode steps 1..n−1 attend over p+1..p+n−1 tokens: on average p + n/2.
    The cache bytes per token come from a finished run (linear in tokens; a
    sliding-window layer that evicted is counted at its window, slightly low).
    """
    context = prompt_tokens + max_tokens / 2
    kv = cache_bytes / cached_tokens * context if cached_tokens else 0.0
    per_token = weight_bytes + kv
    limit = bandwidth_gb_s * 1e9 / per_token
    return {
        "mean_context": context,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv,
        "bytes_per_token": per_token,
        "bandwidth_gb_s": bandwidth_gb_s,
        "limit_tps": limit,
        "decode_tps": decode_tps,
        "fraction": decode_tps / limit,
    }


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, str]:
    """Memory bandwidth in GB/s and a description naming the probe that won.

    On MLX's default device: the best of ``repeats`` sums over an ``nbytes``
    float32 array. On the CPU backend also numpy's float32 matvec ``A @ x``
    over an ``nbytes`` matrix: multithreaded BLAS gemv streams memory far
    faster than MLX's single-threaded CPU reductions. The larger one is taken.
    """
    probes = {}
    a = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(a)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(mx.sum(a))
        best = min(best, time.perf_counter() - t)
    probes[f"MLX sum on the {mx.default_device().type.name}"] = a.nbytes / best / 1e9
    del a
    mx.clear_cache()
    if mx.default_device() == mx.cpu:
        import numpy as np

        side = math.isqrt(nbytes // 4)
        A, x = np.ones((side, side), dtype=np.float32), np.ones(side, dtype=np.float32)
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            A @ x
            best = min(best, time.perf_counter() - t)
        probes["numpy float32 matvec (multithreaded BLAS)"] = A.nbytes / best / 1e9
    name = max(probes, key=probes.get)
    others = "".join(f"; {k}: {v:.1f} GB/s" for k, v in probes.items() if k != name)
    return probes[name], f"{name} over {nbytes / 2**20:.0f} MB{others}"


# ---------------------------------------------------------------- environment and notes


def environment(compare: str | None) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": mx.default_device().type.name,
        "blas": blas_in_use(),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        # other work on the machine skews every number; the ratios less so
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if compare == "mlx-lm":
        try:
            env["mlx_lm"] = version("mlx-lm")
        except PackageNotFoundError:
            env["mlx_lm"] = None
    return env


def stored_half_dtypes(model_dir: Path) -> set[str]:
    """The 16-bit float dtypes (``F16``, ``BF16``) in the checkpoint's safetensors headers."""
    from .loader import weight_files

    found = set()
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        found |= {t["dtype"] for k, t in header.items() if k != "__metadata__"} & {"F16", "BF16"}
    return found


def comparison_notes(model: nn.Module, model_dir: Path, kv_bits: int | None) -> list[str]:
    """What differs between the engines beyond the code under test."""
    notes = []
    if kv_bits:
        notes.append(
            f"mlxinfer's KV cache was quantized to {kv_bits} bits; mlx-lm's benchmark has no "
            "KV-quantization flag, so mlx-lm ran with its float cache."
        )
    ours = {
        v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    }
    half = stored_half_dtypes(model_dir)
    if half and ours == {mx.float32}:
        notes.append(
            f"the checkpoint stores {', '.join(sorted(half))} floats: mlxinfer computes in float32 on "
            "MLX's CPU backend, mlx-lm in the stored dtype."
        )
    return notes


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
    weights = weight_bytes_per_token(model)
    notes = comparison_notes(model, model_dir, kv_bits) if compare else []
    results = []
    for p in prompt_lengths:
        ids = prompt_ids(p, model.args.vocab_size)
        log(f"p={p}: mlxinfer warm-up")
        _, cache_bytes, cached = time_run(model, ids, max_tokens, kv_bits, prefill_step)
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
