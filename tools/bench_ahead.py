"""The batching engine's decode with its plain steps queued ahead of their tokens' landing
(``mlxinfer/batch/ahead.py``) against every step in turn, alternated in one process.

    python tools/bench_ahead.py MODEL_DIR [--rows 1 8] [--rounds 4] [-p 128] [-n 256]

Each round runs ``rows`` random prompts of ``-p`` tokens for ``-n`` greedy tokens each through a
fresh engine, once with ``ahead.ON`` off and once on (the order alternating round by round), and
checks that both give the same tokens. Prints per setting the medians of the engine's decode
rate (its counters: decode tokens over the seconds in its decode steps) and of the whole run's
wall seconds (prefill included), the CPU (lscpu's model name) and the load average.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)

from mlxinfer import load
from mlxinfer.batch import Engine, ahead


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    return names[0] if names else "unknown CPU"


def one_run(model, prompts: list[list[int]], n: int, on: bool) -> tuple[float, float, list]:
    """(decode tok/s by the engine's counters, wall seconds, the tokens) with ``ahead.ON = on``."""
    ahead.ON = on
    t0 = time.perf_counter()
    with Engine(model, max_batch=len(prompts)) as engine:
        handles = [engine.submit(p, max_tokens=n) for p in prompts]
        tokens = [[s.token for s in h.steps(600)] for h in handles]
        rate = engine.decode_tokens / max(engine.decode_s, 1e-9)
    return rate, time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-p", type=int, default=128, help="prompt tokens")
    ap.add_argument("-n", type=int, default=256, help="tokens generated per row")
    args = ap.parse_args()
    model, _ = load(args.model)
    rng = random.Random(0)
    print(f"{cpu_name()} × {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    for rows in args.rows:
        prompts = [[rng.randrange(100, 30000) for _ in range(args.p)] for _ in range(rows)]
        one_run(model, prompts, 8, True)  # warm-up
        seen: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        reference = None
        for r in range(args.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                rate, wall, tokens = one_run(model, prompts, args.n, on)
                reference = reference or tokens
                assert tokens == reference, "the tokens differ between the settings"
                seen[on].append((rate, wall))
        med = {on: [statistics.median(x[k] for x in seen[on]) for k in (0, 1)] for on in seen}
        for on in (False, True):
            rates = ", ".join(f"{x[0]:.1f}" for x in seen[on])
            print(
                f"{rows} rows, ahead {'on ' if on else 'off'}: decode {med[on][0]:.1f} tok/s "
                f"({rates}), wall {med[on][1]:.2f} s"
            )
        print(
            f"{rows} rows: ahead/in turn decode {med[True][0] / med[False][0]:.3f}x, "
            f"wall {med[False][1] / med[True][1]:.3f}x"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
