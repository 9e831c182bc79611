"""Decode speed and communication share at 1 and 2 ranks: a functional check, not a speed claim.

    python tools/bench_distributed.py -m MODEL_DIR [-n 64] [--rounds 2]

Runs ``mlxinfer generate -v`` on one process, then ``mlxinfer launch -n 2 -- mlxinfer generate
--distributed pipeline|tensor -v``, alternating, and prints each run's decode tok/s (rank 0's
table) and each rank's seconds computing against waiting on the other (``--verbose``'s rank
lines). Local ranks share this machine's cores and memory bandwidth, so two ranks cannot be
faster than one here: what the figures show is the cost of the collectives per token on
127.0.0.1, and that the runs complete (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

PROMPT = "Write a short story about a lighthouse keeper."


def run(model: str, n: int, mode: str | None) -> dict:
    generate = [sys.executable, "-m", "mlxinfer", "generate", "-m", model, "-p", PROMPT]
    generate += ["-n", str(n), "-v"]
    if mode is None:
        command = generate
    else:
        command = [sys.executable, "-m", "mlxinfer", "launch", "-n", "2", "--"]
        command += [*generate, "--distributed", mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{mode or 'one process'}: exit {done.returncode}\n{done.stderr[-2000:]}")
    decode = [float(x) for x in re.findall(r"^decode\s+([\d.]+) tok/s", done.stderr, re.M)]
    ranks = re.findall(
        r"rank (\d)/2: .* ([\d.]+) s computing, ([\d.]+) s waiting on other ranks", done.stderr
    )
    return {"decode": decode[0] if decode else float("nan"), "ranks": sorted(ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-n", type=int, default=64, help="tokens per run")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    modes = [None, "pipeline", "tensor"]
    results: dict = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:  # alternated: a loaded machine drifts
            results[mode].append(run(args.model, args.n, mode))
    print(f"| run | decode tok/s (median of {args.rounds}) | per rank: computing / waiting |")
    print("|---|---|---|")
    for mode in modes:
        decode = statistics.median(r["decode"] for r in results[mode])
        last = results[mode][-1]["ranks"]
        share = "; ".join(f"rank {r}: {c} s / {w} s" for r, c, w in last) or "-"
        print(f"| {mode or 'one process'} | {decode:.1f} | {share} |")


if __name__ == "__main__":
    main()
