"""The machine and the model's bounds: memory bandwidth probes, the decode roofline, the
environment recorded with every figure, and notes on what makes a comparison unfair."""

from __future__ import annotations

import json
import math
import os
import platform
import struct
import time
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from ..platform.blas import blas_in_use
from ..platform.machine import cpu_name

# ---------------------------------------------------------------- roofline


def weight_bytes_per_token(model: nn.Module) -> int:
    """Parameter bytes one decode step reads, as loaded.

    Every parameter is read once, except embedding tables that are only
    gathered: one row per token. The token embedding is read whole when it is
    also the LM head (tied); position tables (GPT-2's ``wpe``) never are. Where
    the CPU backend's products read tiles (made at the first decode step), their
    bytes count instead of the arrays' (``tiles.bytes_not_read``).
    """
    from ..backends.cpu import tiles

    total = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - tiles.bytes_not_read(model)
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
    from ..loading.loader import weight_files

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


def report_runs(rows: list[dict], json_path=None, label: str = "every run") -> bool:
    """For a tool's alternating runs, each a dict with its ``tokens``: print whether every run
    gave the first run's tokens, and write the runs without their tokens, with the environment,
    to ``json_path`` (if given) as JSON. Returns whether they were the same."""
    import json

    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"same tokens {label}: {same}")
    if json_path is not None:
        runs = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
        report = {"environment": environment(None), "same": same, "rows": runs}
        json_path.write_text(json.dumps(report, indent=1))
    return same
