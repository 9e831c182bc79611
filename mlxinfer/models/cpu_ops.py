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
  SiLU's sigmoid. :func:`exp` computes it in one compiled elementwise kernel
  (Cody–Waite range reduction and a degree-7 polynomial: relative error
  ≤ 1.2e-7, below MLX's own ~4e-6) in about half the time, and
  :func:`attention` and :func:`swiglu` use it.

The models call :func:`use_cpu_ops` to choose; on Metal (or any GPU backend)
they keep ``mx.fast``. Both paths are exercised by the parity tests, which
run on the CPU where ``mx.fast`` still works (through the reference graph);
``MLXINFER_CPU_OPS=0`` or ``=1`` overrides the choice.
"""

from __future__ import annotations

import os
from functools import partial

import mlx.core as mx
import mlx.nn as nn

# MLXINFER_CPU_OPS=0 keeps mx.fast everywhere (to compare the two paths); =1 forces these ops.
OVERRIDE: bool | None = {"0": False, "1": True}.get(os.environ.get("MLXINFER_CPU_OPS", ""))

# (key) -> (cos, sin): the tables of the forward pass in progress. One RoPE
# configuration asks for the same positions once per layer; the next forward
# pass moves the offset, so only the newest few entries are ever reused.
_TABLES: dict[tuple, tuple[mx.array, mx.array]] = {}
_MAX_TABLES = 8


def use_cpu_ops() -> bool:
    """True when MLX computes on its CPU backend (no fused kernels for rope and rms_norm)."""
    return mx.default_device() == mx.cpu if OVERRIDE is None else OVERRIDE


def rope_table(inv_freq: mx.array, key: tuple, offset: int, length: int, scale: float) -> tuple[mx.array, mx.array]:
    """(cos, sin), each (length, dims/2) float32, for positions ``offset .. offset+length-1``.

    The angle of pair ``i`` at position ``p`` is ``p * scale * inv_freq[i]``,
    as in ``mx.fast.rope``. ``key`` identifies ``inv_freq`` (the frequencies
    are fixed per RoPE configuration).
    """
    full_key = (key, offset, length, scale)
    table = _TABLES.get(full_key)
    if table is None:
        positions = mx.arange(offset, offset + length, dtype=mx.float32) * scale
        angles = positions[:, None] * inv_freq[None, :]
        table = (mx.cos(angles), mx.sin(angles))
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[full_key] = table
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


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array, *, dims: int, traditional: bool) -> mx.array:
    """Rotate the first ``dims`` features of (..., L, head_dim) ``x`` by the (L, dims/2) table."""
    rotate = _rotate_pairs if traditional else _rotate_halves
    if dims == x.shape[-1]:
        return rotate(x, cos, sin)
    return mx.concatenate([rotate(x[..., :dims], cos, sin), x[..., dims:]], axis=-1)


@partial(mx.compile, shapeless=False)  # traced per shape: the mean divides by a constant
def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    xf = x.astype(mx.float32)
    normed = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` semantics (float32 statistics, result in ``x``'s dtype, then × weight)."""
    return _rms_norm(x, weight, eps)


HEAD_CHUNK = 1024  # rows of the output projection per matmul (see project)


def project(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for a few rows of ``x`` against a tall ``weight`` (the LM head).

    OpenBLAS's sgemm packs its whole right-hand operand on every call, which
    for a one-row product costs more than the product: SmolLM2's 49,152 × 576
    head ran at ~8 GB/s in one call and ~13 GB/s in blocks of 1,024 rows that
    stay in cache while packed; alternating the blocks over two CPU streams
    (two threads) took it from 9.4 to 6.0 ms.
    """
    n = weight.shape[0]
    if n <= 2 * HEAD_CHUNK or x.size // x.shape[-1] > 16:
        return x @ weight.T
    streams = _worker_streams()
    blocks = [mx.matmul(x, weight[i : i + HEAD_CHUNK].T, stream=streams[(i // HEAD_CHUNK) % 2])
              for i in range(0, n, HEAD_CHUNK)]
    return mx.concatenate(blocks, axis=-1)


# exp(x) = 2^n · e^r with n = round(x / ln 2), r = x − n·ln 2 (ln 2 split in two so that n·LN2_HI is exact).
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
_EXP_MIN, _EXP_MAX = -87.0, 88.0  # e^x stays a normal float32; below the range the result is 0


@mx.compile  # traced per shape: the bit view (View) has no shapeless form
def exp(x: mx.array) -> mx.array:
    """``mx.exp`` for float32 in one vectorisable kernel; ``exp(-inf) == 0`` (masked attention logits)."""
    xc = mx.clip(x, _EXP_MIN, _EXP_MAX)
    n = mx.round(xc * _LOG2E)
    r = xc - n * _LN2_HI - n * _LN2_LO  # |r| <= ln(2) / 2
    p = 1.0 + r * (1.0 + r * (1 / 2 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720 + r / 5040))))))
    two_n = mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)  # 2^n from its exponent bits
    return mx.where(x < _EXP_MIN, 0.0, p * two_n)


@mx.compile
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis, in float32."""
    x = x.astype(mx.float32)
    e = exp(x - mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


SMALL = 1 << 16  # below this many elements (decode steps) MLX's own ops are cheaper: fewer kernels


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` = gate · up / (1 + e^(−gate))."""
    if gate.size < SMALL:
        return nn.silu(gate) * up
    return _swiglu(gate, up)


@mx.compile
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    g = gate.astype(mx.float32)
    return (g * up / (1.0 + exp(-g))).astype(gate.dtype)


_MASKS: dict[tuple[int, int], mx.array] = {}


def _causal(n_queries: int, n_keys: int) -> mx.array:
    """Boolean (L, T) mask, query i seeing keys up to T − L + i (aligned lower-right, like sdpa)."""
    mask = _MASKS.get((n_queries, n_keys))
    if mask is None:
        if len(_MASKS) >= _MAX_TABLES:
            _MASKS.clear()
        mask = _MASKS[(n_queries, n_keys)] = (
            mx.arange(n_keys)[None] <= mx.arange(n_keys - n_queries, n_keys)[:, None])
    return mask


DEQUANTIZED_ATTENTION_ROWS = 16  # queries from which a quantized KV cache is dequantized for attention
QUERY_BLOCK = 128  # most queries per attention block in prefill (see attention)
SCORE_BUDGET = 1 << 19  # most attention scores per block; the softmax holds a few buffers of this size


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` semantics for (B, heads, L, D) inputs.

    Query heads share a kv head through a reshape (no copies of K/V); the
    softmax uses :func:`exp`. ``mask``: None, "causal", a boolean array
    (True = attend) or an additive one, (..., L, T).

    Long query runs are cut into blocks (at most ``QUERY_BLOCK`` queries and
    ``SCORE_BUDGET`` scores), each against only the keys it can see: under a
    causal mask that skips the masked upper triangle (~40% of a 512-token
    prefill's scores), and the softmax's buffers stay one block in size
    however long the context.
    """
    L, T = q.shape[2], k.shape[2]
    rows = max(16, min(QUERY_BLOCK, SCORE_BUDGET // (q.shape[1] * T)))
    if L <= rows:
        return _attend(q, k, v, scale, mask)
    causal = isinstance(mask, str)
    blocks = []
    for start in range(0, L, rows):
        stop = min(start + rows, L)
        visible = T - L + stop if causal else T  # the block's last query sees keys up to here
        block_mask = mask if causal or mask is None else mask[..., start:stop, :visible]
        q_block = q[:, :, start:stop]
        if blocks:  # one block after the other, so that only one block's buffers are alive
            q_block = mx.depends(q_block, blocks[-1])
        blocks.append(_attend(q_block, k[:, :, :visible], v[:, :, :visible], scale, block_mask))
    return mx.concatenate(blocks, axis=2)


def _attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    B, n_q, L, D = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    if L == 1 and mask is None:
        # Decode: the query heads sharing a kv head become the rows of one product
        # per kv head (half the time of one-row products per query head at 2k context).
        scores = (q * scale).reshape(B, n_kv, n_q // n_kv, D) @ k.swapaxes(-1, -2)
        probs = mx.softmax(scores, axis=-1, precise=True).astype(v.dtype)
        return (probs @ v).reshape(B, n_q, 1, -1)
    q = (q * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    scores = q @ k[:, :, None].swapaxes(-1, -2)  # (B, n_kv, reps, L, T)
    if isinstance(mask, str):
        mask = _causal(L, T)
    elif mask is not None and mask.ndim >= 3 and mask.shape[-3] == n_q > 1:  # per query head (ALiBi)
        mask = mask.reshape(*mask.shape[:-3], n_kv, n_q // n_kv, L, T)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -mx.inf)
        else:
            scores = scores + mask
    probs = (softmax(scores) if scores.size >= SMALL else mx.softmax(scores, axis=-1, precise=True)).astype(v.dtype)
    return (probs @ v[:, :, None]).reshape(B, n_q, L, -1)


_STREAMS: list[mx.Stream] = []


def _worker_streams() -> list[mx.Stream]:
    """Two CPU streams; MLX runs each on its own thread."""
    if not _STREAMS:
        _STREAMS.extend(mx.new_stream(mx.cpu) for _ in range(2))
    return _STREAMS


def row_halves(layer: nn.Module) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
    """A layer's ``(weight[, scales, biases])`` cut into first and second half of rows.

    The halves are views (no copy), kept on the layer until its weights are replaced.
    """
    parts = tuple(layer[k] for k in ("weight", "scales", "biases") if layer.get(k) is not None)
    key = [id(p) for p in parts]
    cached = layer.__dict__.get("_row_halves")
    if cached is None or cached[0] != key:
        half = parts[0].shape[0] // 2
        cached = layer.__dict__["_row_halves"] = (key, (tuple(a[:half] for a in parts), tuple(a[half:] for a in parts)))
    return cached[1]


def parallel_quantized_matmul(x: mx.array, halves, *, group_size: int, bits: int, mode: str = "affine") -> mx.array:
    """``x @ W.T`` for a quantized ``W`` given as its two row halves ``(weight, scales[, biases])``.

    MLX's CPU quantized matmul runs on one thread; the two halves run on two
    streams, so on two threads (measured 1.9× on SmolLM2's 4-bit layers). Used
    for few-row inputs (decode); prefill dequantizes instead (``quant``).
    """
    outs = [mx.quantized_matmul(x, *part, transpose=True, group_size=group_size, bits=bits, mode=mode, stream=s)
            for part, s in zip(halves, _worker_streams())]
    return mx.concatenate(outs, axis=-1)


class CPULinear(nn.Linear):
    """``nn.Linear`` whose few-row products (decode) are split by output rows over two CPU streams.

    For one row OpenBLAS threads a large sgemm poorly: SmolLM2's 1,536 × 576
    gate projection took 318 µs in one call and 126 µs as two half calls on two
    streams. Small matrices lose to the extra kernel (576 × 576: 0.82×), so
    only layers of at least ``MIN_SIZE`` weights switch (see ``use_cpu_layers``).
    """

    MIN_SIZE = 1 << 19
    MAX_ROWS = 16

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] > self.MAX_ROWS:
            return super().__call__(x)
        outs = [mx.matmul(x, w.T, stream=s) for (w,), s in zip(row_halves(self), _worker_streams())]
        y = mx.concatenate(outs, axis=-1)
        return y + self["bias"] if "bias" in self else y
