"""Which BLAS MLX's CPU matmuls run on, and how fast: one prefill- and one decode-shaped product.

Run it once per library, each in a fresh process (the binding is fixed when MLX is imported):

    MLXINFER_BLAS=reference python tools/bench_blas.py
    python tools/bench_blas.py                                   # what mlxinfer picks (docs/blas.md)
    MLXINFER_BLAS=/path/to/libmkl_rt.so.3 python tools/bench_blas.py

Prints the library, the CPU, and the median time of 512 x 576 @ 576 x 1,536 (SmolLM2-135M's
gate projection over a 512-token prefill) and of 1 x 576 @ the same (one decode row).
"""

from __future__ import annotations

import statistics
import time

from mlxinfer.platform.blas import blas_in_use, preload_openblas

preload_openblas()  # before the first `import mlx` (import mlxinfer does it too)

import mlx.core as mx

from mlxinfer.platform.machine import cpu_name


def median_seconds(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    w = mx.random.normal((1536, 576))
    rows, row = mx.random.normal((512, 576)), mx.random.normal((1, 576))
    mx.eval(w, rows, row)
    prefill = median_seconds(lambda: mx.eval(rows @ w.T), 20)
    decode = median_seconds(lambda: mx.eval(row @ w.T), 200)
    print(f"BLAS: {blas_in_use()}\nCPU: {cpu_name()}, MLX {mx.__version__}")
    print(
        f"512x576 @ 576x1536: {prefill * 1e3:.2f} ms ({2 * 512 * 576 * 1536 / prefill / 1e9:.1f} GFLOP/s)"
    )
    print(f"1x576 @ 576x1536: {decode * 1e6:.0f} us ({w.nbytes / decode / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
