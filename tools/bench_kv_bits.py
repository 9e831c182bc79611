"""Decode with keys and values in float and quantized with ``--kv-bits`` 8 and 4, alternated in
one process: one row (``generate_step`` over its own cache) and the batching engine's rows.

    python tools/bench_kv_bits.py MODEL [-p 128 1024] [--rows 1 8] [-n 64] [--rounds 2]

For each prompt length and row count, each round runs every KV setting in turn (the order
rotating round by round) on the same seeded random prompts and prints the medians of decode
tok/s (one row: the tokens after the first over their wall time; rows: the engine's counters,
decode tokens over its decode steps' seconds), the CPU (lscpu's model name) and the load
average. Run it with another checkout first on ``PYTHONPATH`` to compare two versions.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)
import numpy as np

from mlxinfer import load
from mlxinfer.batch import Engine
from mlxinfer.cache.prompt import PromptCache
from mlxinfer.generation import generate_step

SETTINGS = (None, 8, 4)


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    return names[0] if names else "unknown CPU"


def one_row(model, prompt: list[int], n: int, bits: int | None) -> float:
    cache = PromptCache(model.make_cache(kv_bits=bits))
    start, count = None, 0
    for _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n):
        if start is None:
            start = time.perf_counter()  # after the prompt and the first token
        else:
            count += 1
    return count / (time.perf_counter() - start)


def rows(model, prompts: list[list[int]], n: int, bits: int | None) -> float:
    options = {} if bits is None else {"kv_bits": bits}
    with Engine(model, max_batch=len(prompts), **options) as engine:
        handles = [engine.submit(p, max_tokens=n) for p in prompts]
        for h in handles:
            for _ in h.steps(timeout=600):
                pass
        return engine.decode_tokens / engine.decode_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--prompt", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; {mlxinfer.__file__}"
    )
    rng = np.random.default_rng(0)
    for p in args.prompt:
        for r in args.rows:
            prompts = rng.integers(3, vocab, (r, p)).tolist()
            rates: dict[int | None, list[float]] = {b: [] for b in SETTINGS}
            for k in range(args.rounds):
                order = SETTINGS[k % 3 :] + SETTINGS[: k % 3]
                for bits in order:
                    if r == 1:
                        rate = one_row(model, prompts[0], args.max_tokens, bits)
                    else:
                        rate = rows(model, prompts, args.max_tokens, bits)
                    rates[bits].append(rate)
            cells = ", ".join(
                f"{'float' if b is None else f'{b}-bit'} {statistics.median(v):.1f}"
                for b, v in rates.items()
            )
            print(f"prompt {p:>5}, {r} row{'s' if r > 1 else ' '}: decode tok/s {cells}")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
