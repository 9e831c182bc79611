"""One request's decode with a fused block's four kernel calls as one node of MLX's graph
(``blocks.FUSE``, ``K.fuse``) and as four, alternated in one process.

    python tools/bench_fuse.py MODEL [-p 128 1024] [--kv-bits none 8] [-n 128] [--rounds 4]

For each prompt length and KV setting, each round runs both settings in turn (the order
swapped every round) on one seeded random prompt, ``generate_step`` over its own cache, and
prints each setting's decode tok/s per round (``mlxinfer bench``'s: ``bench.runs.time_run``),
their medians and ratio, the CPU's model name and the load average.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import statistics

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)
import numpy as np

from mlxinfer import load
from mlxinfer.backends.cpu import blocks
from mlxinfer.bench.runs import time_run
from mlxinfer.platform.machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--prompt", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--kv-bits", nargs="+", default=["none", "8"])
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    model, _ = load(args.model)
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; {mlxinfer.__file__}"
    )
    rng = np.random.default_rng(0)
    for p in args.prompt:
        prompt = rng.integers(3, model.args.vocab_size, p).tolist()
        for kv in args.kv_bits:
            bits = None if kv == "none" else int(kv)
            rates: dict[bool, list[float]] = {True: [], False: []}
            for k in range(args.rounds):
                for fuse in (True, False) if k % 2 == 0 else (False, True):
                    blocks.FUSE = fuse
                    rates[fuse].append(time_run(model, prompt, args.max_tokens, bits)[0].decode_tps)
            one, four = (statistics.median(rates[f]) for f in (True, False))
            print(
                f"prompt {p:>5}, kv {kv:>4}: one node {one:.1f} tok/s "
                f"({' '.join(f'{x:.1f}' for x in rates[True])}), four {four:.1f} "
                f"({' '.join(f'{x:.1f}' for x in rates[False])}): {one / four:.3f}x"
            )
    blocks.FUSE = True
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
