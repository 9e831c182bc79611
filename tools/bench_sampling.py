"""Sampling one token on the CPU: the compiled kernel (``K.sample``) against MLX's own ops
(``generation.sampling``'s filter and ``mx.random.categorical``), each setting timed in turn,
15 times, the median; random logits (standard normal x 3) of SmolLM2's and Gemma-3's vocabulary
sizes. ``python tools/bench_sampling.py``; results in docs/performance.md ("Sampling in one
kernel call")."""

import time

import mlx.core as mx
import numpy as np

from mlxinfer import backends
from mlxinfer.backends import kernels
from mlxinfer.generation.sampling import make_sampler

K = kernels.load()
SETTINGS = (
    dict(temperature=0.7),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=40),
    dict(temperature=0.7, min_p=0.05),
)


def median_ms(fn, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    backends.sample = lambda *a, **k: None  # make_sampler below: MLX's own ops
    print("| vocabulary | settings | kernel ms | MLX ops ms | speed-up |")
    print("|---:|---|---:|---:|---:|")
    for vocab in (49152, 262144):
        x = mx.array((rng.standard_normal((1, vocab)) * 3).astype(np.float32))
        u = mx.array(rng.random(1).astype(np.float32))
        mx.eval(x, u)
        for settings in SETTINGS:
            sampler = make_sampler(**settings, seed=0)
            kernel = median_ms(lambda x=x, u=u, s=settings: K.sample(x, u, **s))
            ops = median_ms(lambda x=x, sampler=sampler: sampler(x))
            name = ", ".join(f"{k} {v}" for k, v in settings.items())
            print(f"| {vocab:,} | {name} | {kernel:.2f} | {ops:.2f} | {ops / kernel:.1f}x |")


if __name__ == "__main__":
    main()
