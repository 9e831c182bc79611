"""Where a batched decode step's time goes: one forward of B rows through the paged pool
(attention over the pages in place, and over a gathered copy), against the same B rows on one
dense contiguous cache (no pool), and one row alone.

    python tools/bench_batch_step.py MODEL_DIR [B] [--rounds 2] [--variants 0 1 | --int16-rows 0 4] [--products]
    # default B = 8, 128-token contexts

Prints milliseconds per step (10 steps after a warm-up; the kinds interleaved, --rounds times;
medians), the aggregate decode of B rows against one row alone, the CPU (lscpu's model name)
and the load average; --variants alternates the quantized kernel's multi-row loops
(``K.set_qmv_rows_path``) round by round, --int16-rows the rows up to which products take the
int16 kernel's few-row path (``K.set_int16_decode_rows``: 0 none, up to 4) and, above 0, tiled
layers (``tiles.set_on``); --products times the float projections alone at 1,
4, 8 and 16 rows (the sgemm-vs-gemv effect of docs/batching.md).
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)
import mlx.core as mx
import numpy as np

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import blocks, tiles
from mlxinfer.batch.layout import layer_shapes
from mlxinfer.batch.pool import KVPool
from mlxinfer.batch.views import StepBatch

CONTEXT = 128


def per_step_ms(step, n: int = 10) -> float:
    step()
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n * 1000


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    lines = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    return lines[0] if lines else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("B", type=int, nargs="?", default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", type=int, nargs="*", default=[])
    ap.add_argument("--int16-rows", type=int, nargs="*", default=[])
    ap.add_argument("--products", action="store_true")
    args = ap.parse_args()
    model, _ = mlxinfer.load(args.model)
    B = args.B
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, model.args.vocab_size, (B, CONTEXT))

    pool = KVPool(layer_shapes(model))
    seqs = []
    for row in prompts.tolist():
        seq = pool.admit(row, 200)
        model(mx.array([row]), StepBatch(pool, [seq], [row]).views())
        mx.eval(pool.keys, pool.values)
        seqs.append(seq)
    dense, one = model.make_cache(), model.make_cache()
    model(mx.array(prompts), dense)
    model(mx.array(prompts[:1]), one)
    mx.eval([c.state for c in dense + one])
    token = mx.array([[5]] * B)

    def paged(form):
        out = model(token, StepBatch(pool, seqs, [[5]] * B, form=form).views())[:, -1]
        mx.eval(out, pool.keys, pool.values)

    def contiguous():
        mx.eval(model(token, dense)[:, -1])

    def alone():
        mx.eval(model(token[:1], one)[:, -1])

    kinds = [
        (f"{B} rows, pool, over the pages", lambda: paged("pages")),
        (f"{B} rows, pool, gathered", lambda: paged("gather")),
        (f"{B} rows, one dense cache", contiguous),
        ("1 row, contiguous cache", alone),
    ]
    K = kernels.load()
    variants = args.variants or args.int16_rows or [None]

    def int16_rows(rows: int) -> None:  # the int16_decode plan's few-row path and tiled layers
        K.set_int16_decode_rows(rows)
        tiles.set_on(rows > 0)
        blocks.EPOCH += 1  # the fused blocks read their layers' arrays again

    setter = int16_rows if args.int16_rows else K.set_qmv_rows_path
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}", file=sys.stderr
    )
    times: dict[tuple[str, int | None], list[float]] = {}
    for _ in range(args.rounds):
        for v in variants:
            if v is not None:
                setter(v)
            for name, step in kinds:
                times.setdefault((name, v), []).append(per_step_ms(step))
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} CPUs; load after {os.getloadavg()[0]:.2f}; {args.rounds} rounds"
    )
    for v in variants:
        med = {name: statistics.median(times[(name, v)]) for name, _ in kinds}
        for name, ms in med.items():
            print(f"{'' if v is None else f'[{v}] '}{name:>30}: {ms:.1f} ms per step (median)")
        pages, alone = med[kinds[0][0]], med[kinds[-1][0]]
        print(
            f"{'' if v is None else f'[{v}] '}{B} rows over the pages: {B * alone / pages:.2f}x one row's decode"
        )

    if not args.products:
        return
    w = [mx.random.normal((1536, 576)) for _ in range(60)]
    mx.eval(w)
    for rows in (1, 4, 8, 16):
        x = mx.random.normal((rows, 576))
        ms = per_step_ms(lambda x=x: mx.eval([x @ m.T for m in w]), 5)
        print(f"60 products 1536x576, {rows:>2} rows: {ms:.1f} ms")


if __name__ == "__main__":
    main()
