"""The tiled products on a CPU's AVX2 paths against what they replace, in one process.

    python tools/bench_tiles_avx2.py [--rows 1 2 8 31] [--prompt-rows 32 128 512] [--rounds 5]

Random layers of four shapes (4-bit 1536 x 576 and 5-, 6-bit 2048 x 640, 16 or 12 matrices in
turn so their codes come from memory; SmolLM2's 8-bit 49152 x 576 head), group size 32, scales
rounded to float16 as a GGUF import's are. For --rows: the float kernel held at AVX2 against the
tiles at AVX2 (``vpmaddwd`` + ``vpaddd``) and, on a CPU with AVX-VNNI, at ``avxvnni``
(``vpdpwssd``), or at the ``--levels`` given (``avx512bw``: the 512-bit tiles without VNNI). For --prompt-rows: the prompt path the tiles replace on AVX2 (the compiled
dequantize, then the BLAS product) against the same tiles. Milliseconds per pass over the
matrices, best of --rounds; prints the CPU and the load average (docs/performance.md).
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import subprocess
import time

import mlxinfer  # noqa: F401
import mlx.core as mx
import numpy as np

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import tiles
from mlxinfer.backends.cpu.quantized import dequantize

SHAPES = ((4, 1536, 576, 16), (5, 2048, 640, 12), (6, 2048, 640, 12), (8, 49152, 576, 1))


def best_ms(rounds: int, reps: int, fn, *args) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        times.append((time.perf_counter() - t) / reps * 1e3)
    return min(times)


def blas(K, x, layers, bits) -> None:
    mx.eval([x @ dequantize(*a, group_size=32, bits=bits).T for a, _ in layers])


def float_kernel(K, x, layers, bits) -> None:
    mx.eval([K.quantized_matvec(x, *a, 32, bits) for a, _ in layers])


def tiled(K, x, layers, bits) -> None:
    mx.eval([K.quantized_matvec(x, *t, 32, bits) for _, t in layers])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 8, 31])
    parser.add_argument("--prompt-rows", type=int, nargs="*", default=[32, 128, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--levels",
        nargs="*",
        help="the tiles' levels to time (default: avx2, and avxvnni where the CPU has it); "
        "e.g. avx2 avx512bw avx512vnni: the 512-bit tiles without and with VNNI",
    )
    args = parser.parse_args()
    K = kernels.load()
    if K is None or not hasattr(K, "avx_vnni_available"):
        raise SystemExit(f"needs the compiled kernels of this checkout: {kernels.reason()}")
    K.set_max_isa("avxvnni")
    levels = [("avx2", "avx2")] + ([("avxvnni", "avxvnni")] if K.avx_vnni_available() else [])
    if args.levels:
        levels = [(level, level) for level in args.levels]
    K.set_max_isa("avx2")
    if not K.tiles_available():
        raise SystemExit("needs an x86 CPU with AVX2")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "?")
    print(f"CPU: {name}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; levels {levels}")
    K.set_int16_decode_rows(0)
    rng = np.random.default_rng(0)
    try:
        for bits, n, k, count in SHAPES:
            layers = []
            for _ in range(count):
                w = mx.array(rng.normal(size=(n, k)).astype(np.float32) * 0.05)
                q, s, b = mx.quantize(w, group_size=32, bits=bits)
                s, b = (
                    s.astype(mx.float16).astype(mx.float32),
                    b.astype(mx.float16).astype(mx.float32),
                )
                layers.append(((q, s, b), tiles.layout(q, s, b, bits, 32)))
            mx.eval(layers)
            for m, prompt in [(m, False) for m in args.rows] + [
                (m, True) for m in args.prompt_rows
            ]:
                x = mx.array(rng.normal(size=(m, k)).astype(np.float32))
                K.set_max_isa("avx2")
                base = best_ms(
                    args.rounds,
                    2 if prompt else 4,
                    blas if prompt else float_kernel,
                    K,
                    x,
                    layers,
                    bits,
                )
                line = f"{bits}-bit {n} x {k} x{count}, {m:3d} rows: {'BLAS' if prompt else 'float'} {base:7.2f} ms"
                for label, level in levels:
                    K.set_max_isa(level)
                    ms = best_ms(args.rounds, 4, tiled, K, x, layers, bits)
                    line += f"  {label} tiles {ms:7.2f} ({base / ms:.2f}x)"
                print(line, flush=True)
    finally:
        K.set_max_isa("best")


if __name__ == "__main__":
    main()
