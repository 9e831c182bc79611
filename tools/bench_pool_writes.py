"""The batching engine's decode and its pool copies a step, in this checkout or alternated with
another (one process per round).

    python tools/bench_pool_writes.py MODEL [--rows 1 8] [-n 200] [--grow 0] [--kv-bits 8]
        [--compare OTHER_CHECKOUT] [--rounds 3]

For each row count: an engine serves that many 128-token prompts (8 tokens, so their prefixes
are cached), then the same prompts again for ``-n`` tokens, timed; prints aggregate decode tok/s
and ``K.attention_buffer_copies()`` a step (the kernels' writes that could not update the pool
in place: each copies a layer's keys or values whole). ``--grow N`` first serves N 1,000-token
prompts, kept as the prefix cache, so the pool is as large as a server's after some use.
``--compare DIR`` runs each round here and in DIR (another checkout with its kernels built, e.g.
``git worktree add /tmp/base HEAD~1``), the order swapped every round. Prints the CPU's model
name and the load average (docs/performance.md: the pool copied every step before ``d5c7d76``).
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlxinfer
import numpy as np

from mlxinfer.backends import kernels
from mlxinfer.batch import Engine
from mlxinfer.platform.machine import cpu_name


def measure(args) -> dict[str, list[float]]:
    K = kernels.load()
    if K is None:
        raise SystemExit(f"the kernels are not loaded: {kernels.reason()}")
    model, _ = mlxinfer.load(args.model)
    rng = np.random.default_rng(0)
    out: dict[str, list[float]] = {}
    for rows in args.rows:
        with Engine(model, kv_bits=args.kv_bits) as engine:
            grow = [engine.submit(rng.integers(3, 30000, 1000).tolist(), max_tokens=2)
                    for _ in range(args.grow)]  # fmt: skip
            for h in grow:
                list(h.steps(timeout=600))
            prompts = [rng.integers(3, 30000, 128).tolist() for _ in range(rows)]
            for h in [engine.submit(p, max_tokens=8) for p in prompts]:
                list(h.steps(timeout=600))
            copies, steps = K.attention_buffer_copies(), engine.steps_run
            t = time.perf_counter()
            handles = [engine.submit(p, max_tokens=args.max_tokens) for p in prompts]
            tokens = sum(len(list(h.steps(timeout=600))) for h in handles)
            dt = time.perf_counter() - t
            per_step = (K.attention_buffer_copies() - copies) / max(engine.steps_run - steps, 1)
            out[str(rows)] = [tokens / dt, per_step, engine.pool.keys[0].shape[0]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("-n", "--max-tokens", type=int, default=200)
    ap.add_argument("--grow", type=int, default=0)
    ap.add_argument("--kv-bits", type=int, default=None)
    ap.add_argument("--compare", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--json", action="store_true", help=argparse.SUPPRESS
    )  # one round, for --compare
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args)))
        return
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    sides = {"this": str(Path(__file__).resolve().parents[1])}
    if args.compare:
        sides["other"] = args.compare
    cmd = [sys.executable, __file__, args.model, "--json", "-n", str(args.max_tokens)]
    cmd += ["--rows", *map(str, args.rows), "--grow", str(args.grow)]
    cmd += ["--kv-bits", str(args.kv_bits)] if args.kv_bits else []
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else reversed(list(sides)):
            env = dict(os.environ, PYTHONPATH=sides[side])
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            got = json.loads(run.stdout.splitlines()[-1])
            cells = [
                f"{rows} rows {tok_s:.1f} tok/s, {copies:.1f} copies a step (pool {blocks} blocks)"
                for rows, (tok_s, copies, blocks) in got.items()
            ]
            print(f"round {r + 1} {side} ({sides[side]}): " + "; ".join(cells), flush=True)
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
