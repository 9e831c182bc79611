"""The tiled int16 products at R rows against the dot product's peak (tools/vnni_peak_probe.c).

    python tools/bench_tile_rate.py [--rows 8] [--threads 1 2] [--rounds 7]

Random layers as SmolLM2-135M's (4-bit 1536 x 576 and 576 x 1536, 16 matrices in turn so their
codes come from memory; the 8-bit 49152 x 576 head), group size 32, float16 scales, laid out as
tiles (``tiles.layout``). For each product: milliseconds a pass (best of --rounds), nanoseconds
a pair of inputs for 32 outputs on each thread (16 ``vpdpwssd`` at 8 rows), and G int16 products
a second. The probe's loop runs a pair in 16 instructions' time (4.37 ns at 3.65 G a second on
the AMD EPYC VM); what the whole product adds is its epilogue, x's rounding and the threads'
sharing. Prints the CPU (its model name) and the load average (docs/performance.md).
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import time

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)
import mlx.core as mx
import numpy as np

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import tiles
from mlxinfer.platform.machine import cpu_name

SHAPES = ((4, 1536, 576, 16), (4, 576, 1536, 16), (8, 49152, 576, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[8])
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if min(args.rows + args.threads + [args.rounds]) < 1:
        ap.error(
            f"--rows, --threads and --rounds: expected positive integers, found "
            f"{args.rows}, {args.threads}, {args.rounds}"
        )
    K = kernels.load()
    if K is None or not K.tiles_wide_vnni():
        raise SystemExit("needs the compiled kernels on a CPU with AVX-512 VNNI")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    before = K.num_threads()
    try:
        for bits, n, k, count in SHAPES:
            layers = []
            for _ in range(count):
                w = mx.array(rng.normal(size=(n, k)).astype(np.float32) * 0.05)
                q, s, b = mx.quantize(w, group_size=32, bits=bits)
                layers.append(tiles.layout(q, s.astype(mx.float16), b.astype(mx.float16), bits, 32))
            mx.eval(layers)
            pairs = count * (n // 32) * (k // 2)
            for m in args.rows:
                x = mx.array(rng.normal(size=(m, k)).astype(np.float32))
                for th in args.threads:
                    K.set_num_threads(th)
                    reps = max(1, int(2e7 // (pairs * m)))
                    best = float("inf")
                    for _ in range(args.rounds):
                        t = time.perf_counter()
                        for _ in range(reps):
                            mx.eval([K.quantized_matvec(x, *t_, 32, bits) for t_ in layers])
                        best = min(best, (time.perf_counter() - t) / reps)
                    ns = best / pairs * th * 1e9 * 8 / m  # a pair's time at 8 rows' instructions
                    rate = pairs * 32 * 2 * m / best / 1e9
                    print(
                        f"{bits}-bit {n} x {k} x{count}, {m} rows, {th} thread(s): "
                        f"{best * 1e3:.3f} ms, {ns:.2f} ns a pair a thread (as 8 rows), "
                        f"{rate:.0f} G products/s",
                        flush=True,
                    )
    finally:
        K.set_num_threads(before)


if __name__ == "__main__":
    main()
