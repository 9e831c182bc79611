"""Time the compiled paged attention (K.paged_attention) for one decode step's layers.

    python tools/bench_paged_attention.py [--keys 192 512] [--block 16] [--rows 8] [--layers 30]

SmolLM2-135M's heads (9 query, 3 key/value heads of 64), `--rows` rows each seeing `--keys` keys
over its own blocks of the pool (the last block partly), f32. Prints the milliseconds for
`--layers` calls in one evaluation (median of --repeat) and the kernel's max |difference| from
MLX's own ops (reference=True).
"""

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from mlxinfer.backends import kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[192, 512])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        print(f"bench_paged_attention: {kernels.reason()}", file=sys.stderr)
        return 1
    B, n_q, n_kv, D, bs = args.rows, 9, 3, 64, args.block
    rng = np.random.default_rng(0)
    print(kernels.describe())
    for T in args.keys:
        n = -(-T // bs)
        n_blocks = B * n + 4
        keys, values = (
            mx.array(rng.standard_normal((n_blocks, n_kv, bs, D)).astype(np.float32))
            for _ in range(2)
        )
        q = mx.array(rng.standard_normal((B, n_q, 1, D)).astype(np.float32))
        table = rng.permutation(n_blocks)[: B * n].reshape(B, n).astype(np.uint32)
        blocks = mx.array(
            table[:, None, :] * n_kv + np.arange(n_kv, dtype=np.uint32)[None, :, None]
        )
        seen = np.zeros((B, n * bs), bool)
        seen[:, :T] = True
        visible = mx.array(seen.reshape(B, 1, n, 1, bs))
        args_ = (q, keys, values, blocks, visible)
        ref = K.paged_attention(*args_, scale=D**-0.5, reference=True)
        err = mx.abs(K.paged_attention(*args_, scale=D**-0.5) - ref).max().item()

        def step(inputs=args_):  # distinct scales: one call per layer, none merged
            return [
                K.paged_attention(*inputs, scale=D**-0.5 + i * 1e-7) for i in range(args.layers)
            ]

        mx.eval(step())
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            mx.eval(step())
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1000
        print(
            f"{B} rows x {T} keys, block {bs}: {args.layers} calls {ms:.2f} ms "
            f"({ms / args.layers * 1000:.0f} us each); max |kernel - MLX ops| {err:.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
