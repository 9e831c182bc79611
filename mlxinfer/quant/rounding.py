"""Least-squares rounding for MLX's affine format (issue 48, item 3).

MLX's affine quantization stores each group of ``group_size`` inputs as
``w ≈ scale * q + bias`` with ``q`` in ``0 .. 2**bits - 1``. ``mx.quantize`` takes
scale and bias from the group's min and max; ``fit_affine`` instead fits them to
minimise the group's squared error and stores the result in exactly the layout
``mx.quantize`` returns, so ``nn.QuantizedLinear``/``QuantizedEmbedding`` and every
other MLX app load it unchanged.

Per group, candidates are: min/max itself (``mx.quantize``'s own scale and bias),
and for each clipping factor ``f`` (the min/max range shrunk about its centre)
a few alternating steps of

    q = clip(round((w - bias) / scale), 0, 2**bits - 1)      # codes for this fit
    scale, bias = least squares of w on [q, 1]                # closed form

The candidate with the lowest squared error wins, group by group, so the fit is
never worse than min/max. Errors are measured with scale and bias already rounded
to the stored dtype, so the comparison is the one ``mx.dequantize`` sees.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

ROUNDINGS = ("minmax", "mse", "gptq")  # gptq: gptq.py, on these fits
CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7)
ITERATIONS = 4


def pack(q: mx.array, bits: int) -> mx.array:
    """Pack codes ``q`` (..., K) into MLX's uint32 layout (..., K * bits / 32).

    MLX writes the codes as one little-endian bit stream (code ``i`` at bit ``i * bits``),
    read as little-endian uint32 words; for 2/4/8 bits this is ``32 / bits`` codes per word,
    for 3/5/6 bits codes straddle words. Every 8 codes are ``bits`` whole bytes of the stream,
    so they are packed as one 64-bit integer and cut into bytes, a slice of rows at a time
    (:data:`PACK_CODES` codes: a bit per byte, as this once did, took 16 bytes a code at once:
    21 GB for Gemma-3-270M's 262k-row embedding).
    """
    *lead, k = q.shape
    codes = np.ascontiguousarray(np.asarray(q.astype(mx.uint32)).reshape(-1, k))
    out = np.empty((codes.shape[0], k * bits // 32), np.uint32)
    rows = max(1, PACK_CODES // max(k, 1))
    for r in range(0, codes.shape[0], rows):
        out[r : r + rows] = _pack_rows(codes[r : r + rows], bits)
    return mx.array(out.reshape(*lead, k * bits // 32))


PACK_CODES = 1 << 22  # codes packed at once (32 MB of 64-bit integers)
_SHIFTS = np.arange(8, dtype=np.uint64)


def _pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    n, k = codes.shape  # k * bits is a multiple of 32 (MLX's groups), so k of 8
    eights = codes.reshape(n, k // 8, 8).astype(np.uint64)
    stream = (eights << (_SHIFTS * np.uint64(bits))).sum(-1)  # (n, k/8): 8 * bits bits each
    stream = np.ascontiguousarray(stream, dtype="<u8")  # its bytes in little-endian order
    stream_bytes = stream.view(np.uint8).reshape(n, k // 8, 8)[..., :bits]
    return np.ascontiguousarray(stream_bytes).reshape(n, k * bits // 8).view("<u4")


def _codes(w, scale, bias, n_max):
    return mx.clip(mx.round((w - bias) / scale), 0, n_max)


def _sq_error(w, q, scale, bias, v):
    return mx.sum(v * mx.square(scale * q + bias - w), axis=-1, keepdims=True)


def _stored(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x.astype(dtype).astype(mx.float32)


def _least_squares(w, q, scale, bias, v):
    """Scale and bias minimising ``sum(v * (scale * q + bias - w)**2)`` per group, for fixed q
    (``v`` the channels' weights, ones when unweighted)."""
    g = v.sum(-1, keepdims=True)
    vq, vw = v * q, v * w
    sq, sw = vq.sum(-1, keepdims=True), vw.sum(-1, keepdims=True)
    sqq, sqw = (vq * q).sum(-1, keepdims=True), (vq * w).sum(-1, keepdims=True)
    det = g * sqq - sq * sq
    ok = det > 1e-12 * g * sqq  # all codes equal: keep the scale, refit only the bias
    new_scale = mx.where(ok, (g * sqw - sq * sw) / mx.where(ok, det, 1), scale)
    new_scale = mx.where(mx.abs(new_scale) > 1e-12, new_scale, scale)
    return new_scale, (sw - new_scale * sq) / g


def channel_weights(importance, shape: tuple[int, ...]) -> mx.array | None:
    """Per-input-channel weights for the fit from activation importance (mean ``x**2`` per
    channel, (K,) or (E, K) for stacked experts), normalised to mean 1 with a floor so a channel
    the calibration text never used still counts a little; None: unweighted."""
    if importance is None:
        return None
    v = mx.array(importance, mx.float32)
    v = v / mx.maximum(v.mean(axis=-1, keepdims=True), 1e-30)
    v = mx.maximum(v, 1e-2) if v.ndim == 1 else mx.maximum(v, 1e-2)[:, None, :]
    return mx.broadcast_to(v, shape)


# Elements fitted at a time: the fit's temporaries are about twelve times its input (SmolLM2's
# 49,152 x 576 float32 embedding: 1.4 GB), so a larger tensor is fitted a chunk of rows (or of
# experts) at a time. Each group is fitted on its own, so the chunks give the whole's values.
FIT_CHUNK = 1 << 20


def fit_affine(
    w: mx.array,
    *,
    group_size: int = 64,
    bits: int = 4,
    weights: mx.array | None = None,
    scale_dtype: mx.Dtype | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize ``w`` (..., K) as ``mx.quantize`` does, with least-squares scales and biases.

    ``weights`` (broadcastable to ``w``, from :func:`channel_weights`): each input channel's
    share of the squared error (activation importance); None: plain squared error.
    ``scale_dtype``: the dtype scales and biases are stored in (default ``w``'s).

    Returns:
        ``(wq, scales, biases)`` laid out as ``mx.quantize(w, group_size, bits)`` returns them
        (scales and biases in ``scale_dtype``), so ``mx.dequantize`` reads them as it reads its own.
    """
    if w.ndim < 2 or w.size <= FIT_CHUNK:
        return _fit_affine(w, group_size, bits, weights, scale_dtype)
    n = max(1, FIT_CHUNK // (w.size // w.shape[0]))
    full = None if weights is None else mx.broadcast_to(weights, w.shape)
    parts = []
    for i in range(0, w.shape[0], n):
        part = _fit_affine(
            w[i : i + n], group_size, bits, None if full is None else full[i : i + n], scale_dtype
        )
        mx.eval(part)
        parts.append(part)
    wq, scales, biases = (mx.concatenate([p[k] for p in parts], axis=0) for k in range(3))
    return wq, scales, biases


def _fit_affine(w, group_size, bits, weights, scale_dtype) -> tuple[mx.array, mx.array, mx.array]:
    n_max = 2**bits - 1
    shape, dtype = w.shape, scale_dtype or w.dtype
    _, scales0, biases0 = mx.quantize(w, group_size=group_size, bits=bits)
    x = w.astype(mx.float32).reshape(-1, group_size)  # (groups, group_size)
    if weights is None:
        v = mx.ones((1, group_size), mx.float32)
    else:
        v = mx.broadcast_to(weights.astype(mx.float32), shape).reshape(-1, group_size)

    best_s = _stored(scales0, dtype).reshape(-1, 1)
    best_b = _stored(biases0, dtype).reshape(-1, 1)
    best_q = _codes(x, best_s, best_b, n_max)
    best_err = _sq_error(x, best_q, best_s, best_b, v)

    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    centre, half = (lo + hi) / 2, mx.maximum((hi - lo) / 2, 1e-8)
    for f in CLIP_FACTORS:
        scale = _stored(2 * f * half / n_max, dtype)
        bias = _stored(centre - f * half, dtype)
        for _ in range(ITERATIONS):
            q = _codes(x, scale, bias, n_max)
            scale, bias = _least_squares(x, q, scale, bias, v)
            scale, bias = _stored(scale, dtype), _stored(bias, dtype)
        q = _codes(x, scale, bias, n_max)
        err = _sq_error(x, q, scale, bias, v)
        better = err < best_err
        best_s, best_b = mx.where(better, scale, best_s), mx.where(better, bias, best_b)
        best_q, best_err = mx.where(better, q, best_q), mx.minimum(err, best_err)
        mx.eval(best_s, best_b, best_q, best_err)  # bound the graph: one tensor, one factor

    group_shape = (*shape[:-1], shape[-1] // group_size)
    wq = pack(best_q.reshape(shape), bits)
    return wq, best_s.reshape(group_shape).astype(dtype), best_b.reshape(group_shape).astype(dtype)
