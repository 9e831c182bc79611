"""Decode speed and communication share at 1 and 2 ranks: a functional check, not a speed claim.

    python tools/bench_distributed.py -m MODEL_DIR [-n 64] [--rounds 2] [--batch B]

Runs ``mlxinfer generate -v`` on one process, then ``mlxinfer launch -n 2 -- mlxinfer generate
--distributed pipeline|tensor -v``, alternating, and prints each run's decode tok/s (rank 0's
table) and each rank's seconds computing against waiting on the other (``--verbose``'s rank
lines). Local ranks share this machine's cores and memory bandwidth, so two ranks cannot be
faster than one here: what the figures show is the cost of the collectives per token on
127.0.0.1, and that the runs complete (docs/distributed.md).

``--batch B``: the batching engine instead: B prompts of mixed lengths submitted together, n
tokens each, timed on rank 0 (loading and a warm-up request left out): the aggregate tok/s
(prefill included) of one process, then of two ranks (this file run as each rank by
``mlxinfer launch``): the pipeline with micro-batched decode (flights of rows, one at each rank:
the default), without it (``micro_batches=False``: every row through the ranks one after
another), and tensor. ``--pin``: each rank (and the one process) on one CPU of its own
(``sched_setaffinity``: rank r on CPU r), as if each were a machine of one core: two ranks then
do not take each other's cores, and what micro-batched decode does with the second rank's time
shows (their memory bandwidth is still shared).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

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


BATCH_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List three prime numbers.",
    "Explain, step by step, how a bill becomes a law in a parliamentary system of government.",
    "Hi",
    "Translate to French: the weather is nice today and we are going to the beach.",
    "What is 12 times 12?",
    "Name the planets of the solar system in order from the sun, with one fact about each.",
    "Summarise the plot of Hamlet in two sentences.",
]


def batch_rank(model: str, n: int, b: int, mode: str, pin: bool = False) -> None:
    """One rank (or the one process, ``mode`` "none") of ``--batch``: prints rank 0's line."""
    if pin:  # before MLX and the BLAS start their threads
        os.sched_setaffinity(0, {int(os.environ.get("MLX_RANK", "0")) % os.cpu_count()})
    import mlxinfer
    from mlxinfer.batch import Engine

    distributed = None if mode == "none" else mode.split("/")[0]
    options = {"micro_batches": False} if mode.endswith("/plain") else {}
    llm, tokenizer = mlxinfer.load(model, distributed=distributed, **options)
    prompts = [tokenizer.encode(BATCH_PROMPTS[i % len(BATCH_PROMPTS)]) for i in range(b)]
    with Engine(llm) as engine:  # no EOS given: every request makes its n tokens
        list(engine.submit(prompts[0], max_tokens=2).steps())  # warm up
        start = time.perf_counter()
        handles = [engine.submit(p, max_tokens=n) for p in prompts]
        made = sum(len(list(h.steps())) for h in handles)
        seconds = time.perf_counter() - start
    if distributed is None or llm.ranks.first:
        print(f"batch: {made / seconds:.2f} tok/s ({made} tokens in {seconds:.1f} s)")
    if distributed is not None:
        print(llm.ranks.summary(), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_batch(model: str, n: int, b: int, mode: str | None, pin: bool = False) -> dict:
    rank = [sys.executable, __file__, "--rank", mode or "none", "-m", model, "-n", str(n)]
    rank += ["--batch", str(b)] + (["--pin"] if pin else [])
    command = rank if mode is None else [sys.executable, "-m", "mlxinfer", "launch", "-n", "2"]
    if mode is not None:
        command += ["--", *rank]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{mode or 'one process'}: exit {done.returncode}\n{done.stderr[-2000:]}")
    rate = [float(x) for x in re.findall(r"^batch: ([\d.]+) tok/s", done.stdout, re.M)]
    ranks = re.findall(
        r"rank (\d)/2: .* ([\d.]+) s computing, ([\d.]+) s waiting on other ranks", done.stderr
    )
    return {"decode": rate[0] if rate else float("nan"), "ranks": sorted(ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-n", type=int, default=64, help="tokens per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="prompts per batch_generate")
    parser.add_argument("--pin", action="store_true", help="--batch: rank r on CPU r alone")
    parser.add_argument(
        "--modes", default=None, help="a subset, e.g. one,pipeline,pipeline/plain (--batch)"
    )
    parser.add_argument("--rank", default=None, help=argparse.SUPPRESS)  # one rank of --batch
    args = parser.parse_args()
    if args.rank is not None:
        return batch_rank(args.model, args.n, args.batch, args.rank, args.pin)
    modes = [None, "pipeline", "pipeline/plain", "tensor"] if args.batch else [None, "pipeline"]
    modes += [] if args.batch else ["tensor"]
    if args.modes:
        modes = [None if m == "one" else m for m in args.modes.split(",")]
    results: dict = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:  # alternated: a loaded machine drifts
            if args.batch:
                results[mode].append(run_batch(args.model, args.n, args.batch, mode, args.pin))
            else:
                results[mode].append(run(args.model, args.n, mode))
    what = f"batch of {args.batch}, tok/s" if args.batch else "decode tok/s"
    print(f"| run | {what} (median of {args.rounds}) | per rank: computing / waiting |")
    print("|---|---|---|")
    for mode in modes:
        decode = statistics.median(r["decode"] for r in results[mode])
        last = results[mode][-1]["ranks"]
        share = "; ".join(f"rank {r}: {c} s / {w} s" for r, c, w in last) or "-"
        name = {None: "one process", "pipeline/plain": "pipeline, micro_batches=False"}
        print(f"| {name.get(mode, mode)} | {decode:.1f} | {share} |")


if __name__ == "__main__":
    main()
