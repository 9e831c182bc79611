"""CPU-backend versions of MLX's fused ops, for when MLX runs without Metal.

On a Mac, ``mx.fast.rope`` and ``mx.fast.rms_norm`` are single Metal kernels.
MLX's CPU backend has no kernels for them: it runs each as its reference
graph, and every primitive in it is scheduled separately (~4 µs each on the
machines we measured). ``mx.fast.rope`` alone is 29 primitives per call,
including recomputing its frequency table, so RoPE was 42% of the ~4,100
primitives of one SmolLM2-135M decode step.

Here, instead:

- RoPE's cos/sin table for the positions being processed is built once per
  forward pass and shared by every layer (:func:`rope_table`), and applying it
  is one compiled elementwise kernel (:func:`apply_rope`);
- RMSNorm is compiled, so its elementwise ops fuse around the reduction;
- ``mx.exp`` is scalar code on the CPU (~13 ns per float32 on the machines we
  measured), and exponentials dominate prefill: the attention softmax and
  SiLU's sigmoid. :func:`exp` computes it in two compiled elementwise
  kernels (Cody–Waite range reduction and a degree-6 polynomial: relative
  error ≤ 1.5e-7, below MLX's own ~3e-6) in about a third of the time, with
  one buffer between them; :func:`attention` and :func:`swiglu` use it.

The backend's layers (``layers``) call these in place of ``mx.fast``; on Metal
(or any GPU backend) the models keep ``mx.fast``. Both paths are exercised by
the parity tests, which run on the CPU where ``mx.fast`` still works (through
the reference graph); ``MLXINFER_CPU_OPS=0`` loads models without this backend.
"""

from __future__ import annotations

import threading
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ...models.layers import masks

# Per thread, (key) -> (cos, sin): the tables of the forward pass in progress. One RoPE
# configuration asks for the same positions once per layer; the next forward pass moves
# the offset, so only the newest few entries are ever reused. Per thread because a table
# is built lazily (evaluating it would stall the graph being built for the next decode
# step behind the step in flight), and MLX ties a lazy array to the thread that built it.
_PER_THREAD = threading.local()
_MAX_TABLES = 8


def _thread_cache(name: str) -> dict:
    """This thread's dict ``name`` (rope tables, masks)."""
    cache = getattr(_PER_THREAD, name, None)
    if cache is None:
        cache = {}
        setattr(_PER_THREAD, name, cache)
    return cache


def rope_table(
    inv_freq: mx.array, key: tuple, offset: int, length: int, scale: float
) -> tuple[mx.array, mx.array]:
    """(cos, sin), each (length, dims/2) float32, for positions ``offset .. offset+length-1``.

    The angle of pair ``i`` at position ``p`` is ``p * scale * inv_freq[i]``,
    as in ``mx.fast.rope``. ``key`` identifies ``inv_freq`` (the frequencies
    are fixed per RoPE configuration).
    """
    full_key = (key, offset, length, scale)
    tables = _thread_cache("tables")
    table = tables.get(full_key)
    if table is None:
        positions = mx.arange(offset, offset + length, dtype=mx.float32) * scale
        angles = positions[:, None] * inv_freq[None, :]
        table = (mx.cos(angles), mx.sin(angles))
        if len(tables) >= _MAX_TABLES:
            tables.clear()
        tables[full_key] = table
    return table


def rope_rows_table(
    inv_freq: mx.array, key: tuple, offsets: mx.array, length: int, scale: float
) -> tuple[mx.array, mx.array]:
    """(cos, sin), each (B, 1, length, dims/2) float32, for row b's positions ``offsets[b] ..
    offsets[b]+length-1`` (a batch's rows, each at its own position): :func:`rope_table` per row.
    Made once per forward pass: the layers share the (B,) ``offsets`` array itself."""
    tables = _thread_cache("row_tables")
    cached = tables.get((key, id(offsets), length, scale))
    if cached is not None and cached[0] is offsets:  # it holds the array: its id is not reused
        return cached[1]
    steps = mx.arange(length, dtype=mx.float32)
    positions = (offsets.astype(mx.float32)[:, None] + steps[None]) * scale  # (B, length)
    angles = positions[..., None] * inv_freq  # (B, length, dims/2)
    table = (mx.cos(angles)[:, None], mx.sin(angles)[:, None])
    if len(tables) >= _MAX_TABLES:
        tables.clear()
    tables[(key, id(offsets), length, scale)] = (offsets, table)
    return table


@partial(mx.compile, shapeless=False)
def _rotate_halves(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # Pair i is (x[i], x[i + d/2]) — the transformers / mx.fast.rope(traditional=False) layout.
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@partial(mx.compile, shapeless=False)
def _rotate_pairs(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # Pair i is (x[2i], x[2i + 1]) — the traditional (GPT-J / Meta) layout.
    half = cos.shape[-1]
    pairs = x[..., : 2 * half].reshape(*x.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.reshape(*x.shape[:-1], 2 * half).astype(x.dtype)


def apply_rope(
    x: mx.array, cos: mx.array, sin: mx.array, *, dims: int, traditional: bool
) -> mx.array:
    """Rotate the first ``dims`` features of (..., L, head_dim) ``x`` by the (L, dims/2) table."""
    rotate = _rotate_pairs if traditional else _rotate_halves
    if dims == x.shape[-1]:
        return rotate(x, cos, sin)
    return mx.concatenate([rotate(x[..., :dims], cos, sin), x[..., dims:]], axis=-1)


@partial(mx.compile, shapeless=False)  # traced per shape: the mean divides by a constant
def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    xf = x.astype(mx.float32)
    normed = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    # Two different float dtypes promote to float32 (a float mode's bfloat16 embedding rows
    # before float32 norm weights), as in mx.fast.rms_norm: not rounded to x's dtype first.
    return weight * normed.astype(x.dtype if x.dtype == weight.dtype else mx.float32)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` semantics (float32 statistics, result in the promoted dtype of ``x`` and
    ``weight``, then × weight)."""
    return _rms_norm(x, weight, eps)


# exp(d) = 2^n · e^r with n = round(d / ln 2), r = d − n·ln 2 (ln 2 split in two so that n·LN2_HI is exact).
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
# e^r on |r| <= ln(2)/2: degree-6 minimax fit for relative error (1.9e-9 in exact arithmetic).
_P2, _P3, _P4, _P5, _P6 = (
    0.49999991059303284,
    0.16666419804096222,
    0.04166822507977486,
    0.008374815806746483,
    0.0013836845755577087,
)
_D_MIN = -88.0  # clamp before rounding, so that d = -inf gives a finite n (its 2^n is 0 anyway)
_INF_BITS = 0x7F800000


def _exponent_bits(d: mx.array) -> mx.array:
    """The float32 bit pattern of 2^n: 0 below the normal range (n < −126), +inf above it (n > 127)."""
    n = mx.round(mx.maximum(d, _D_MIN) * _LOG2E)
    return mx.where(n < -126, 0, mx.where(n > 127, _INF_BITS, (n.astype(mx.int32) + 127) << 23))


def _scaled_polynomial(d: mx.array, bits: mx.array, two_n: mx.array) -> mx.array:
    """e^r · 2^n, with n read back from ``bits`` (so both kernels agree on it)."""
    n = ((bits >> 23) - 127).astype(mx.float32)
    r = (mx.maximum(_D_MIN, d) - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln(2)/2
    r2 = r * r
    q = (_P6 * r2 + (_P5 * r + _P4)) * r2 + (_P3 * r + _P2)  # Estrin's scheme: a shallow graph
    return ((q * r2 + r) + 1.0) * two_n


# Two compiled kernels per exponential, with one int32 buffer between them that
# the second reuses for its result. MLX fuses an elementwise graph only up to
# depth 11 and splits it wherever a value feeds a bit view; written as one
# function (as it was first) the split left four live buffers the size of the
# input — 5× the output, the largest transient of a 512-token prefill. The
# second kernel reads n back from the bits instead of recomputing it, so no
# intermediate array crosses the split.
@mx.compile  # traced per shape: the bit view (View) has no shapeless form
def _bits_of(x: mx.array) -> mx.array:
    return _exponent_bits(x)


@mx.compile
def _exp_of(x: mx.array, bits: mx.array, two_n: mx.array) -> mx.array:
    return _scaled_polynomial(x, bits, two_n)


@mx.compile
def _bits_shifted(x: mx.array, shift: mx.array) -> mx.array:
    return _exponent_bits(x - shift)


@mx.compile
def _exp_shifted(x: mx.array, shift: mx.array, bits: mx.array, two_n: mx.array) -> mx.array:
    return _scaled_polynomial(x - shift, bits, two_n)


@mx.compile
def _bits_negated(x: mx.array) -> mx.array:
    return _exponent_bits(-x)


@mx.compile
def _exp_negated(x: mx.array, bits: mx.array, two_n: mx.array) -> mx.array:
    return _scaled_polynomial(-x, bits, two_n)


@mx.compile
def _swiglu_from(gate: mx.array, up: mx.array, e: mx.array) -> mx.array:
    return (gate.astype(mx.float32) * up / (1.0 + e)).astype(gate.dtype)


@mx.compile
def _silu_times(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up  # one compiled kernel: a decode step has one per block


def exp(x: mx.array) -> mx.array:
    """``mx.exp`` for float32 in vectorisable kernels: relative error ≤ 1.5e-7 for
    x in [−87.3, 88]; 0 below (``exp(-inf) == 0``, masked attention logits), +inf above."""
    bits = _bits_of(x)
    return _exp_of(x, bits, mx.view(bits, mx.float32))


def exp_and_sum(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(e, Σe)`` with ``e = exp(x − max x)`` over the last axis, in float32: the softmax
    before its division. One int32 buffer the size of ``x`` is alive until ``e`` takes it over."""
    x = x.astype(mx.float32)
    shift = mx.max(x, axis=-1, keepdims=True)
    bits = _bits_shifted(x, shift)
    e = _exp_shifted(x, shift, bits, mx.view(bits, mx.float32))
    return e, mx.sum(e, axis=-1, keepdims=True)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis, in float32."""
    e, total = exp_and_sum(x)
    return e / total


# Below this many elements MLX's own ops are cheaper than the exponent kernels (fewer kernels), unless
# ``plans`` measured another crossover on this machine (``small``, per model).
SMALL = 1 << 16


def swiglu(gate: mx.array, up: mx.array, small: int = SMALL) -> mx.array:
    """``silu(gate) * up`` = gate · up / (1 + e^(−gate)); below ``small`` elements MLX's own ops."""
    if gate.size < small:
        return _silu_times(gate, up)
    g = gate.astype(mx.float32)
    bits = _bits_negated(g)
    return _swiglu_from(gate, up, _exp_negated(g, bits, mx.view(bits, mx.float32)))


def _causal(n_queries: int, n_keys: int) -> mx.array:
    """Boolean (L, T) mask, query i seeing keys up to T − L + i (aligned lower-right, like sdpa)."""
    cached = _thread_cache("masks")
    mask = cached.get((n_queries, n_keys))
    if mask is None:
        if len(cached) >= _MAX_TABLES:
            cached.clear()
        mask = cached[(n_queries, n_keys)] = masks.causal(n_queries, n_keys)
    return mask


# Queries from which attention over a quantized KV cache dequantizes it first (MLX's CPU quantized
# matmul is a scalar loop), unless ``plans`` measured another crossover (dequantized_attention).
DEQUANTIZED_ATTENTION_ROWS = 16
QUERY_BLOCK = 128  # most queries per attention block in prefill (see attention)
# Decode attention over at least this many keys takes the long-context form (see _attend), unless
# ``plans`` measured another crossover on this machine. It has more ops, so it pays only past a
# length (docs/performance.md, "The figures behind the CPU backend's defaults").
DECODE_LONG_KEYS = 1536

# A float product of fewer than PAD_ROWS rows runs as PAD_ROWS rows (zeros added, then cut off)
# from ``pad_rows`` rows on: OpenBLAS's sgemm is not monotonic in the rows (docs/performance.md,
# "The figures behind the CPU backend's defaults"). ``plans`` measures ``pad_rows`` (kind
# ``pad_rows``); never by default.
PAD_ROWS = 16
NO_PADDING = 1 << 30


def padded_product(x: mx.array, product, pad_rows: int = NO_PADDING) -> mx.array:
    """``product(x)`` for (..., in) ``x``, run over PAD_ROWS rows if ``x`` has from ``pad_rows``
    up to PAD_ROWS - 1 rows; the same values."""
    rows = x.size // x.shape[-1]
    if rows < pad_rows or rows >= PAD_ROWS:
        return product(x)
    flat = x.reshape(rows, x.shape[-1])
    flat = mx.concatenate([flat, mx.zeros((PAD_ROWS - rows, x.shape[-1]), x.dtype)])
    y = product(flat)[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


SCORE_BUDGET = (
    1 << 19
)  # most attention scores per block; the softmax holds a few buffers of this size


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask,
    evaluate_blocks: bool = False,
    long_keys: int = DECODE_LONG_KEYS,
    small: int = SMALL,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` semantics for (B, heads, L, D) inputs.

    Query heads share a kv head through a reshape (no copies of K/V); the
    softmax uses :func:`exp`. ``mask``: None, "causal", a boolean array
    (True = attend) or an additive one, (..., L, T).

    Long query runs are cut into blocks (at most ``QUERY_BLOCK`` queries and
    ``SCORE_BUDGET`` scores), each against only the keys it can see: under a
    causal mask that skips the masked upper triangle (~40% of a 512-token
    prefill's scores), and the softmax's buffers stay one block in size
    however long the context. ``evaluate_blocks`` evaluates each block as it
    is built (a stepwise prefill, see ``quantized.stepwise_prefill``); otherwise
    MLX may allocate the next blocks' buffers before this one is done. A decode
    step over at least ``long_keys`` keys takes the long-context form (``plans``
    measures where that pays).
    """
    L, T = q.shape[2], k.shape[2]
    rows = max(16, min(QUERY_BLOCK, SCORE_BUDGET // (q.shape[1] * T)))
    if L <= rows:
        return _attend(q, k, v, scale, mask, long_keys, small)
    causal = isinstance(mask, str)
    blocks = []
    for start in range(0, L, rows):
        stop = min(start + rows, L)
        visible = T - L + stop if causal else T  # the block's last query sees keys up to here
        block_mask = mask if causal or mask is None else mask[..., start:stop, :visible]
        q_block = q[:, :, start:stop]
        if blocks:  # one block after the other, so that only one block's buffers are alive
            q_block = mx.depends(q_block, blocks[-1])
        blocks.append(
            _attend(
                q_block, k[:, :, :visible], v[:, :, :visible], scale, block_mask, long_keys, small
            )
        )
        if (
            evaluate_blocks
        ):  # stepwise prefill: this block's buffers are freed before the next one's exist
            mx.eval(blocks[-1])
    return mx.concatenate(blocks, axis=2)


def _attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask,
    long_keys: int = DECODE_LONG_KEYS,
    small: int = SMALL,
) -> mx.array:
    B, n_q, L, D = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    if L == 1 and mask is None:
        # Decode: the query heads sharing a kv head become the rows of one product
        # per kv head (half the time of one-row products per query head at 2k context).
        q = (q * scale).reshape(B, n_kv, n_q // n_kv, D)
        if T < long_keys:
            probs = mx.softmax(q @ k.swapaxes(-1, -2), axis=-1, precise=True).astype(v.dtype)
            return (probs @ v).reshape(B, n_q, 1, -1)
        # Many keys: K @ qᵀ (BLAS reads the cached keys as stored instead of packing their
        # transpose), the exponent kernels, and the division after the product with V.
        e, total = exp_and_sum((k @ q.swapaxes(-1, -2)).swapaxes(-1, -2))
        return ((e.astype(v.dtype) @ v) / total).astype(v.dtype).reshape(B, n_q, 1, -1)
    # The query heads sharing a kv head are rows of one product with it (no broadcast copies of K, V).
    reps = n_q // n_kv
    q = (q * scale).reshape(B, n_kv, reps * L, D)
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, n_kv, reps, L, T)
    if isinstance(mask, str):
        mask = _causal(L, T)
    else:
        mask = masks.for_groups(mask)  # a batch's per-row mask gains the reps axis
        if (
            mask is not None and mask.ndim >= 3 and mask.shape[-3] == n_q > 1
        ):  # per query head (ALiBi)
            mask = mask.reshape(*mask.shape[:-3], n_kv, reps, L, T)
    scores = masks.apply(scores, mask).reshape(B, n_kv, reps * L, T)
    if scores.size < small:
        out = mx.softmax(scores, axis=-1, precise=True).astype(v.dtype) @ v
    else:
        # Normalise after the product: (e @ v) / Σe divides L·D values instead of L·T.
        e, total = exp_and_sum(
            scores
        )  # total can pass float16's range at 64k keys: divide in float32
        out = ((e.astype(v.dtype) @ v) / total).astype(v.dtype)
    return out.reshape(B, n_q, L, -1)  # (B, n_heads, L, Dv)
