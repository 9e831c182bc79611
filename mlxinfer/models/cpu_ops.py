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
- RMSNorm is compiled, so its elementwise ops fuse around the reduction.

The models call :func:`use_cpu_ops` to choose; on Metal (or any GPU backend)
they keep ``mx.fast``. Both paths are exercised by the parity tests, which
run on the CPU where ``mx.fast`` still works (through the reference graph);
``MLXINFER_CPU_OPS=0`` or ``=1`` overrides the choice.
"""

from __future__ import annotations

import os
from functools import partial

import mlx.core as mx

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
    stay in cache while packed.
    """
    n = weight.shape[0]
    if n <= 2 * HEAD_CHUNK or x.size // x.shape[-1] > 16:
        return x @ weight.T
    return mx.concatenate([x @ weight[i : i + HEAD_CHUNK].T for i in range(0, n, HEAD_CHUNK)], axis=-1)
