"""The int16 products' definition (csrc/src/prefill_i16.cpp, tiles.cpp), for their tests."""

import mlx.core as mx
import numpy as np


def definition(x, q, s, b, group_size, bits):
    """(float64 y, the bound): y = x (s q + b)^T exactly; the kernel rounds x to int16 per block
    of 32 (scale amax / 32767, to nearest: each x off by at most half its block's scale), and
    adds the biases' term from x itself, so |y - y_exact| <= sum_k |s q_k| scale_b / 2, plus
    float32's own rounding of the sums (1e-6 of sum |x w|: K <= 640 terms)."""
    x64 = np.array(x, np.float64)
    sq = np.array(
        mx.dequantize(q, s, mx.zeros_like(b), group_size=group_size, bits=bits), np.float64
    )
    w = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits), np.float64)
    M, Kd = x64.shape
    scale = np.abs(x64).reshape(M, Kd // 32, 32).max(-1) / 32767  # (M, blocks)
    per_block = np.abs(sq).reshape(sq.shape[0], Kd // 32, 32).sum(-1)  # (N, blocks)
    bound = scale @ per_block.T / 2 + 1e-6 * (np.abs(x64) @ np.abs(w).T)
    return x64 @ w.T, bound
