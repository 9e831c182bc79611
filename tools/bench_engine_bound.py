"""How far the batching engine's rows can go against one ``generate`` stream on this machine's
cores: the decode step's work timed on one kernel thread and on all, with no Python beside it.

    python tools/bench_engine_bound.py [MODEL] [--rows 8] [-p 128] [-n 64] [--rounds 6] [--kv-bits 8]

MODEL: a checkpoint or GGUF (default: the test suite's SmolLM2-135M GGUF). Each round, in one
process: one ``generate`` stream (``bench.runs.time_run``, as ``mlxinfer bench`` times it: its ms a
token), the engine's rows as ``mlxinfer bench --batch`` times them (steps queued ahead of their
tokens, ``batch/ahead.py``), then the engine with every step in turn (``ahead.ON`` off), where
each step's evaluation (the ``mx.eval`` that hands its tokens out; nothing else runs then) is
timed on all the kernel threads (E, the median step) and on one (E1). Printed per round and as
medians over the rounds:

- ``ratio``: the rows' aggregate decode over the stream's (the issue's comparison);
- ``scaling``: E1 / (threads x E), how close the threads come to sharing the step evenly;
- ``bound``: rows x the stream's ms a token / (E1 / threads), the ratio the rows would reach
  were the step's work split evenly over the threads with no Python beside it (the engine's
  Python builds the next step on the same cores).

The stream is held by memory bandwidth and the step by the kernels' arithmetic, so a machine
whose neighbours take bandwidth slows the stream more than the step: compare rounds whose stream
is at its quiet rate. The CPU (its model name, `platform.machine.cpu_name`), its CPUs and the load average are printed.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)
import mlx.core as mx

from mlxinfer import load
from mlxinfer.backends import kernels
from mlxinfer.batch import ahead, scheduler
from mlxinfer.bench.batch import time_batch
from mlxinfer.bench.runs import prompt_ids, time_run
from mlxinfer.platform.machine import cpu_name


def machine() -> str:
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu_name()}, {os.cpu_count()} CPUs, load average {load_avg}"


class _TimedEval:
    """The scheduler module's ``mx`` for one run: ``eval`` timed, the rest MLX's own."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __getattr__(self, name: str):
        return getattr(mx, name)

    def eval(self, *arrays) -> None:
        t0 = time.perf_counter()
        mx.eval(*arrays)
        self.times.append(time.perf_counter() - t0)


def step_eval_ms(
    model, prompts: list[list[int]], tokens: int, threads: int, kv_bits: int | None
) -> float:
    """The median of the engine's step evaluations (every step in turn) on ``threads``."""
    K = kernels.load()
    before_threads, before_on = K.num_threads(), ahead.ON
    timed = _TimedEval()
    K.set_num_threads(threads)
    ahead.ON = False
    scheduler.mx = timed  # type: ignore[assignment]
    try:
        time_batch(model, prompts, tokens, kv_bits)
    finally:
        scheduler.mx = mx
        ahead.ON = before_on
        K.set_num_threads(before_threads)
    steps = timed.times[len(prompts) :]  # the first steps run beside the prompts' prefill
    return statistics.median(steps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=128)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kv-bits", type=int, choices=(4, 8), default=None)
    args = ap.parse_args()
    if min(args.rows, args.prompt_tokens, args.rounds) < 1 or args.tokens < 2 * args.rows:
        ap.error(
            "--rows, -p and --rounds: expected positive integers, -n at least twice --rows; "
            f"found {args.rows}, {args.prompt_tokens}, {args.rounds}, {args.tokens}"
        )
    K = kernels.load()
    if K is None:
        raise SystemExit("needs the compiled kernels (python tools/build_kernels.py)")
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.support import fixtures

        args.model = str(fixtures.smollm2_gguf_path())
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    prompts = [prompt_ids(args.prompt_tokens, vocab, seed=i) for i in range(args.rows)]
    prompt = prompt_ids(args.prompt_tokens, vocab, seed=0)
    threads = K.num_threads()
    kv = args.kv_bits
    keys = f", keys and values {kv}-bit" if kv else ""
    print(f"{args.model}{keys}\n{machine()}; {threads} kernel threads")
    time_batch(model, prompts, 16, kv)  # warm: plans, pools, the kernels' threads
    time_run(model, prompt, 16, kv)
    rows = []
    for r in range(args.rounds):
        stream_ms = 1e3 / time_run(model, prompt, args.tokens, kv)[0].decode_tps
        engine = time_batch(model, prompts, args.tokens, kv).decode_tps
        e = step_eval_ms(model, prompts, args.tokens, threads, kv)
        e1 = step_eval_ms(model, prompts, args.tokens, 1, kv)
        row = {
            "stream_ms": stream_ms,
            "ratio": engine * stream_ms / 1e3,
            "E": e,
            "E1": e1,
            "scaling": e1 / (threads * e),
            "bound": args.rows * stream_ms / (e1 / threads),
        }
        rows.append(row)
        print(
            f"round {r + 1}: stream {stream_ms:.2f} ms a token; {args.rows} rows {engine:.1f} tok/s, "
            f"ratio {row['ratio']:.2f}; step E {e:.2f} ms, E1 {e1:.2f} ms, scaling "
            f"{row['scaling']:.2f}; bound {row['bound']:.2f}",
            flush=True,
        )
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(
        f"medians: stream {med['stream_ms']:.2f} ms a token, ratio {med['ratio']:.2f}, "
        f"E {med['E']:.2f} ms, E1 {med['E1']:.2f} ms, scaling {med['scaling']:.2f}, "
        f"bound {med['bound']:.2f}\n{machine()}"
    )


if __name__ == "__main__":
    main()
