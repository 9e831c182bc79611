"""The int16 products' definition (csrc/src/prefill_i16.cpp, tiles.cpp), and the int8
activations' (tiles.cpp, opt-in), for their tests."""

import mlx.core as mx
import numpy as np


def definition(x, q, s, b, group_size, bits, int8=False):
    """(float64 y, the bound): y = x (s q + b)^T exactly. The kernel rounds x per block of 32 to
    int16 (scale amax / 32767) or, with ``int8``, to int8 (amax / 127), to nearest: each x off by
    at most half its block's scale. int16 adds the biases' term from x itself, so |y - y_exact|
    <= sum_k |s q_k| scale_b / 2; int8 from the rounded x, so y is the layer's exact product with
    the rounded x and the bound is sum_k |s q_k + b| scale_b / 2. Plus float32's own rounding of
    the sums (1e-6 of sum |x w|: K <= 640 terms)."""
    x64 = np.array(x, np.float64)
    w = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits), np.float64)
    rounded = w if int8 else mx.dequantize(q, s, mx.zeros_like(b), group_size=group_size, bits=bits)
    rounded = np.array(rounded, np.float64)
    M, Kd = x64.shape
    scale = np.abs(x64).reshape(M, Kd // 32, 32).max(-1) / (127 if int8 else 32767)  # (M, blocks)
    per_block = np.abs(rounded).reshape(w.shape[0], Kd // 32, 32).sum(-1)  # (N, blocks)
    bound = scale @ per_block.T / 2 + 1e-6 * (np.abs(x64) @ np.abs(w).T)
    return x64 @ w.T, bound


def random_tiled(rng, bits, group_size, half, N=96, K=384):
    """A random (N, K) layer quantized (scales and biases float16 with ``half``) and its tiles
    (``tiles.layout``): (q, s, b, tiles)."""
    from mlxinfer.backends.cpu import tiles

    w = mx.array(rng.normal(size=(N, K)).astype(np.float32) * 0.05)
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    if half:
        s, b = s.astype(mx.float16), b.astype(mx.float16)
    return q, s, b, tiles.layout(q, s, b, bits, group_size)


def outlier_rows(rng, M, K=384):
    """M rows of x, the first with an outlier in its block (30.0 at input 5)."""
    x = rng.normal(size=(M, K)).astype(np.float32)
    x[0, 5] = 30.0
    return x


def assert_within_bound(y, x, q, s, b, group_size, bits):
    """y within :func:`definition`'s bound of the float64 product."""
    exact, bound = definition(x, q, s.astype(mx.float32), b.astype(mx.float32), group_size, bits)
    assert (np.abs(np.array(y, np.float64) - exact) <= bound).all(), len(x)
