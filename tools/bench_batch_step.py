"""Where a batched decode step's time goes: one forward of B rows through the paged pool
(attention over the pages in place, and over a gathered copy), against the same B rows on one
dense contiguous cache (no pool), and one row alone.

    python tools/bench_batch_step.py MODEL_DIR [B]      # default B = 8, 128-token contexts

Prints milliseconds per step (10 steps after a warm-up, each kind twice, interleaved) and the
projections alone at 1, 4, 8 and 16 rows (the sgemm-vs-gemv effect of docs/batching.md).
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import sys
import time

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)
import mlx.core as mx
import numpy as np

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


def main() -> None:
    model, _ = mlxinfer.load(sys.argv[1])
    B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
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
    for name, step in kinds * 2:
        print(f"{name:>30}: {per_step_ms(step):.1f} ms per step")

    w = [mx.random.normal((1536, 576)) for _ in range(60)]
    mx.eval(w)
    for rows in (1, 4, 8, 16):
        x = mx.random.normal((rows, 576))
        ms = per_step_ms(lambda x=x: mx.eval([x @ m.T for m in w]), 5)
        print(f"60 products 1536x576, {rows:>2} rows: {ms:.1f} ms")


if __name__ == "__main__":
    main()
