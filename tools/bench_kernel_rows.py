"""The quantized kernel's products at R = 1, 2, 4, 8, 16 rows on a real model's layers.

    python tools/bench_kernel_rows.py MODEL_DIR [--rows 1 2 4 8 16] [--rounds 5] [--threads 0]
        [--variants A B]

Per shape of the model's first block (its q/o, k/v, gate/up and down projections) and its tied
head: microseconds per product, GB/s of weight bytes read (packed codes + scales + biases) and
that as a fraction of a bandwidth probe (numpy's float32 matrix x vector over 256 MB, BLAS
threads), and the time at R rows over the time at one row. A product of a block's shape runs
over every block's matrix of that shape in turn (so the weights come from memory, not from
the cache, as in a decode step). --variants times the kernel's multi-row loops against each
other (``K.set_qmv_rows_path``, where the module has it), alternated round by round; medians of
--rounds. Prints the CPU (lscpu's model name) and the load average.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import mlxinfer
import mlx.core as mx
import numpy as np

from mlxinfer.backends import kernels


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?"
    )


def bandwidth_gbs() -> float:
    a = np.ones((65536, 1024), np.float32)  # 256 MB
    v = np.ones(1024, np.float32)
    a @ v
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ v
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def layer_bytes(layer) -> int:
    return sum(a.nbytes for a in (layer.weight, layer.scales, layer.biases))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: the usable CPUs)")
    ap.add_argument("--variants", nargs="*", default=[])
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"bench_kernel_rows: {kernels.reason()}")
    model, _ = mlxinfer.load(args.model)
    K.set_num_threads(args.threads)  # after the load: its kernel_threads plan sets the pool
    blocks = model.model.layers
    head = model.model.embed_tokens
    shapes = {
        "q/o": [b.self_attn.q_proj for b in blocks],
        "k/v": [b.self_attn.k_proj for b in blocks],
        "gate/up": [b.mlp.gate_proj for b in blocks],
        "down": [b.mlp.down_proj for b in blocks],
        "head": [head],
    }
    gbs = bandwidth_gbs()
    variants = args.variants or [None]
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} CPUs, kernel ISA {K.isa()}, {K.num_threads()} threads; "
        f"load {os.getloadavg()[0]:.2f}; bandwidth probe {gbs:.1f} GB/s"
    )
    # (shape, rows, variant) -> seconds per product, one sample per round
    samples: dict[tuple[str, int, str | None], list[float]] = {}
    xs = {
        (n, r): mx.random.normal((r, ls[0].weight.shape[1] * 32 // ls[0].bits))
        for n, ls in shapes.items()
        for r in args.rows
    }
    mx.eval(list(xs.values()))

    def product(layer, x):
        return K.quantized_matvec(
            x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits
        )

    for _ in range(args.rounds):
        for v in variants:
            if v is not None:
                K.set_qmv_rows_path(int(v))
            for name, layers in shapes.items():
                reps = 1 if len(layers) > 1 else 4
                for r in args.rows:
                    x = xs[(name, r)]
                    mx.eval(product(layers[0], x))
                    # one eval of the shape's independent products (as in a step, where MLX
                    # schedules the next primitive while one runs), every block's matrix once
                    t = time.perf_counter()
                    for _ in range(reps):
                        mx.eval([product(layer, x) for layer in layers])
                    samples.setdefault((name, r, v), []).append(
                        (time.perf_counter() - t) / (reps * len(layers))
                    )
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(
        "| shape | N x K | bits | variant | "
        + " | ".join(f"R={r} µs" for r in args.rows)
        + " | R=1 GB/s (roofline) | "
        + " | ".join(f"R={r}/R=1" for r in args.rows[1:])
        + " |"
    )
    print("|---" * (5 + 2 * len(args.rows)) + "|")
    for name, layers in shapes.items():
        n, k = layers[0].weight.shape[0], layers[0].weight.shape[1] * 32 // layers[0].bits
        for v in variants:
            med = [statistics.median(samples[(name, r, v)]) for r in args.rows]
            g = layer_bytes(layers[0]) / med[0] / 1e9
            print(
                f"| {name} | {n}x{k} | {layers[0].bits} | {v or '-'} | "
                + " | ".join(f"{m * 1e6:.0f}" for m in med)
                + f" | {g:.1f} ({g / gbs:.0%}) | "
                + " | ".join(f"{m / med[0]:.2f}" for m in med[1:])
                + " |"
            )


if __name__ == "__main__":
    main()
