"""Sliding-window layers holding only their window: the KV bytes the batch holds, with the window
pool and without it (every layer keeping every key), on a model with sliding layers.

    python tools/bench_window_pool.py MODEL_DIR [--requests 4] [--prompt-tokens 1200] [--max-tokens 16]

One engine each way, the same prompts submitted at once (distinct random token ids, greedy).
Prints the bytes of the stores at the end (what the process holds for keys and values), the
peak of the blocks the requests hold (sampled every 50 ms; the full layers' and the window
pool's), the wall time, and checks that both ways give the same tokens.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

import mlxinfer
from mlxinfer.batch import Engine
from mlxinfer.bench.bandwidth import report_runs


def run(model, prompts, max_tokens: int, hold_windows: bool) -> dict:
    with Engine(model, max_batch=len(prompts), hold_windows=hold_windows) as engine:
        pools = {"pool": engine.pool, "window_pool": engine.window_pool}
        peak = dict.fromkeys(pools, 0)
        done = threading.Event()

        def sample() -> None:  # the blocks the requests hold, every 50 ms
            while not done.wait(0.05):
                for name, pool in pools.items():
                    if pool is not None:
                        peak[name] = max(peak[name], pool.stats().bytes_in_use)

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.perf_counter()
        handles = [engine.submit(p, max_tokens=max_tokens) for p in prompts]
        tokens = [[s.token for s in h.steps()] for h in handles]
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        window = engine.window_pool
        return {
            "hold_windows": hold_windows,
            "store_bytes": engine.pool.nbytes + (window.nbytes if window else 0),
            "window_store_bytes": window.nbytes if window else 0,
            "peak_held_bytes": peak["pool"] + peak["window_pool"],
            "peak_held_bytes_full_layers": peak["pool"],
            "peak_held_bytes_window_pool": peak["window_pool"],
            "wall_s": wall,
            "tokens": tokens,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model, _ = mlxinfer.load(args.model)
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(10, model.args.vocab_size, args.prompt_tokens).tolist()
        for _ in range(args.requests)
    ]
    rows = []
    for hold in (True, False):
        r = run(model, prompts, args.max_tokens, hold)
        rows.append(r)
        print(
            f"hold_windows={hold!s:>5}: stores {r['store_bytes'] / 1e6:7.1f} MB "
            f"(window pool {r['window_store_bytes'] / 1e6:.1f} MB), peak held "
            f"{r['peak_held_bytes'] / 1e6:7.1f} MB (window pool "
            f"{r['peak_held_bytes_window_pool'] / 1e6:.1f} MB), {r['wall_s']:.1f} s",
            flush=True,
        )
    report_runs(rows, args.json, "both ways")


if __name__ == "__main__":
    main()
