"""GPTQ: rounding that compensates each column's error in the columns not yet quantized.

Frantar et al. 2022 ("GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"). A linear layer ``y = W x`` with ``W`` (N, K) is quantized to minimise the output
error on calibration inputs, ``||(W - Q) X||**2 = tr((W - Q) H (W - Q)^T)`` with
``H = X X^T / n`` (K, K), the inputs' second moment. The columns are quantized in order; after
column ``j`` is rounded, its error ``e = (w_j - q_j) / U_jj`` is pushed onto the columns not yet
quantized, ``W[:, j+1:] -= e U[j, j+1:]``, where ``U`` is the upper Cholesky factor of ``H^-1``
(``H^-1 = U^T U``): the optimal update of the Optimal Brain Surgeon for the remaining columns,
in a form that needs no re-inversion per column. The updates are applied lazily, a block of
columns at a time (``BLOCK``), which changes only the order of the additions.

The output is MLX's affine format unchanged (per group of ``group_size`` inputs a scale and a
bias, codes ``0 .. 2**bits - 1``), so every MLX app loads it:

* A group's scale and bias are chosen when its first column is reached, from the group's
  weights as the earlier columns' errors have updated them, by :func:`rounding.fit_affine`
  (least squares with its clipping search, weighted by the channels' importance); the group's
  columns are then rounded one by one on that grid, each after the previous one's update.
* Columns in their stored order: no act-order (GPTQ's ``desc_act`` quantizes the columns in
  decreasing ``diag(H)``). MLX's format holds no permutation (``g_idx``), and undoing one after
  quantizing would put columns quantized on different grids into one group: not exact, so not
  done.
* ``H`` is dampened by ``DAMP`` times its mean diagonal (the paper's 1 %), which also makes a
  channel the calibration text never used (``H_jj = 0``) invertible; its weights are quantized
  like the others, not zeroed (GPTQ's reference code zeroes them), since evaluation text may use
  the channel.

Computed in numpy float64: conversion is offline, ``K`` is at most a few thousand, and the
Cholesky factorisations of a nearly singular ``H`` need the precision (MLX's
``mx.linalg.cholesky`` is float32 on the CPU stream). The group fits are mx float32, as for the
``mse`` rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .rounding import fit_affine, pack

DAMP = 0.01  # the fraction of H's mean diagonal added to its diagonal
BLOCK = 128  # columns per lazy update: a multiple of every group size, so groups never straddle


def inverse_hessian_factor(hessian: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1`` (float64, (K, K)).

    One factorisation and one triangular inverse, no explicit ``H^-1``: with ``J`` the
    reversal of the columns' order and ``J H J = M M^T`` (lower Cholesky),
    ``H^-1 = J M^-T M^-1 J = (J M^-1 J)^T (J M^-1 J)``, and ``J M^-1 J`` is upper triangular
    with a positive diagonal, so it is ``U``. A factorisation that fails (H not positive
    definite in float64 even when dampened) is retried with ten times the damping, up to three
    times."""
    h = np.array(hessian, dtype=np.float64)[::-1, ::-1]  # J H J
    k = h.shape[0]
    mean_diag = float(np.mean(np.diag(h)))
    if not np.isfinite(mean_diag) or mean_diag <= 0:  # no inputs seen: plain rounding
        return np.eye(k)
    for attempt in range(4):
        try:
            m = np.linalg.cholesky(h + (damp * 10**attempt) * mean_diag * np.eye(k))
        except np.linalg.LinAlgError:
            continue
        return np.ascontiguousarray(np.linalg.inv(m)[::-1, ::-1])
    raise np.linalg.LinAlgError("GPTQ: the input covariance is not positive definite")


def gptq_quantize(
    w: mx.array,
    hessian: np.ndarray,
    *,
    group_size: int = 64,
    bits: int = 4,
    weights: mx.array | None = None,
    scale_dtype: mx.Dtype | None = None,
    damp: float = DAMP,
    block: int = BLOCK,
    factor: np.ndarray | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize ``w`` (N, K) with GPTQ on the inputs' second moment ``hessian`` (K, K).

    ``weights`` (broadcastable to ``w``, :func:`rounding.channel_weights`) and ``scale_dtype``
    as for :func:`rounding.fit_affine`, which chooses each group's scale and bias. ``factor``:
    :func:`inverse_hessian_factor` of ``hessian`` computed already (layers sharing an input).

    Returns:
        ``(wq, scales, biases)`` laid out as ``mx.quantize(w, group_size, bits)`` returns them.
    """
    n, k = w.shape
    if k % group_size or block % group_size:
        raise ValueError(f"GPTQ: {k} inputs and block {block} must be multiples of {group_size}")
    dtype = scale_dtype or w.dtype
    n_max = 2**bits - 1
    u = inverse_hessian_factor(hessian, damp) if factor is None else factor
    wt = np.array(w.astype(mx.float32), dtype=np.float64).T.copy()  # (K, N): a column per row
    v = None if weights is None else mx.broadcast_to(weights, w.shape).astype(mx.float32)
    codes = np.zeros((k, n), np.float64)  # (K, N)
    scales = np.zeros((k // group_size, n), np.float64)  # (groups, N)
    biases = np.zeros_like(scales)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = wt[i1:i2].copy()  # (B, N) this block's columns, updated as it goes
        err = np.zeros_like(w1)  # (B, N) each column's scaled error, for the lazy update
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:  # the group's grid, from its weights as updated so far
                group = mx.array(w1[i : i + group_size].T.astype(np.float32))  # (N, g)
                gv = None if v is None else v[:, col : col + group_size]
                _, s, b = fit_affine(
                    group, group_size=group_size, bits=bits, weights=gv, scale_dtype=dtype
                )
                g = col // group_size
                scales[g] = np.array(s.astype(mx.float32))[:, 0]
                biases[g] = np.array(b.astype(mx.float32))[:, 0]
            s, b = scales[col // group_size], biases[col // group_size]
            q = np.clip(np.round((w1[i] - b) / np.where(s == 0, 1.0, s)), 0, n_max)  # (N,)
            codes[col] = q
            e = (w1[i] - (s * q + b)) / u[col, col]
            w1[i + 1 :] -= np.outer(u[col, col + 1 : i2], e)  # within the block: now
            err[i] = e
        wt[i2:] -= u[i1:i2, i2:].T @ err  # the later blocks: once per block
    wq = pack(mx.array(codes.T.astype(np.uint32)), bits)
    return (
        wq,
        mx.array(scales.T.astype(np.float32)).astype(dtype),
        mx.array(biases.T.astype(np.float32)).astype(dtype),
    )
