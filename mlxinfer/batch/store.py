"""The arrays of a paged KV pool: every layer's keys and values as blocks of one store.

Per layer the store holds two arrays of blocks, ``(n_blocks, kv_heads, block_size,
head_dim)``: a block's keys are one (block_size, head_dim) matrix per kv head, what
attention over the blocks multiplies in place (``views``). Slot ``b * block_size + i``
is position ``i`` of block ``b``. In a quantized pool each is three arrays, as
``mx.quantize`` makes them. Which sequence holds which block is the pool's
(:class:`~.pool.KVPool`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class LayerShape:
    """One layer's cached tensors: ``kv_heads`` × ``key_dim`` keys and × ``value_dim`` values,
    stored as ``dtype``, or with ``bits`` as affine groups of ``group_size`` (``mx.quantize``:
    packed words, a scale and a bias per group, as ``QuantizedKVCache`` keeps them)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype
    bits: int | None = None
    group_size: int = 64

    @property
    def bytes_per_token(self) -> int:
        return self.kv_heads * sum(self._bytes(d) for d in (self.key_dim, self.value_dim))

    def _bytes(self, dim: int) -> int:
        if self.bits is None:
            return dim * self.dtype.size
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * self.dtype.size

    def zeros(self, blocks: int, block_size: int, dim: int) -> mx.array | list[mx.array]:
        """``blocks`` empty blocks of ``dim``-wide vectors: one array, or [packed, scales, biases]."""
        shape = (blocks, self.kv_heads, block_size)
        if self.bits is None:
            return mx.zeros((*shape, dim), self.dtype)
        groups = dim // self.group_size
        return [
            mx.zeros((*shape, dim * self.bits // 32), mx.uint32),
            mx.zeros((*shape, groups), self.dtype),
            mx.zeros((*shape, groups), self.dtype),
        ]


def block_bytes(layers: list[LayerShape], block_size: int) -> int:
    """The bytes of one block of ``block_size`` tokens over every one of ``layers``."""
    return block_size * sum(s.bytes_per_token for s in layers)


def _joined(store: mx.array | list[mx.array], fresh: mx.array | list[mx.array]):
    if isinstance(store, list):
        return [mx.concatenate([a, b]) for a, b in zip(store, fresh)]
    return mx.concatenate([store, fresh])


def _head(store: mx.array | list[mx.array], n: int):
    """The first ``n`` blocks as new arrays (a slice alone would keep the whole buffer)."""
    if isinstance(store, list):
        return [a[:n] * 1 for a in store]
    return store[:n] * 1


class BlockStore:
    """``n_blocks`` blocks of keys and values for each of ``layers``, ``block_size`` tokens
    each: written in place, read as each row's blocks gathered, grown by copying."""

    def __init__(self, layers: list[LayerShape], block_size: int) -> None:
        self.layers = layers
        self.block_size = block_size
        self.bytes_per_block = block_bytes(layers, block_size)
        # Per layer: one array of blocks, or [packed, scales, biases] in a quantized pool.
        self.keys: list[Any] = [None] * len(layers)
        self.values: list[Any] = [None] * len(layers)
        self.n_blocks = 0  # blocks the arrays have room for

    def grow(self, add: int) -> None:
        """``add`` more blocks at the end: a copy of every layer's arrays, so rare."""
        bs = self.block_size
        for i, s in enumerate(self.layers):
            fresh_k, fresh_v = s.zeros(add, bs, s.key_dim), s.zeros(add, bs, s.value_dim)
            if self.keys[i] is None:
                self.keys[i], self.values[i] = fresh_k, fresh_v
            else:
                self.keys[i], self.values[i] = (
                    _joined(self.keys[i], fresh_k),
                    _joined(self.values[i], fresh_v),
                )
            mx.eval(self.keys[i], self.values[i])  # layer by layer: one layer's copy at a time
        self.n_blocks += add

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` blocks, as copies, so the rest of the memory goes back."""
        for i in range(len(self.layers)):
            self.keys[i], self.values[i] = _head(self.keys[i], n), _head(self.values[i], n)
            mx.eval(self.keys[i], self.values[i])  # layer by layer, as grow does
        self.n_blocks = n

    def copy_block(self, src: int, dst: int) -> None:
        for store in self.keys + self.values:
            for a in store if isinstance(store, list) else [store]:
                a[dst] = a[src]

    def write(self, layer: int, rows: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store (N, kv_heads, dim) keys and values, token-major, of ``layer`` at ``rows``:
        their places as :func:`flat_rows` gives them (one scatter over each array's rows, in
        place: the time does not grow with the store; an indexed assignment over
        (blocks, :, within) built 9 primitives a write where this builds 5); quantized first
        in a quantized pool."""
        shape = self.layers[layer]
        for side, new in ((self.keys, keys), (self.values, values)):
            new = new.astype(shape.dtype)
            if shape.bits is None:
                side[layer] = _scatter_rows(side[layer], rows, new)
                continue
            parts = mx.quantize(new, group_size=shape.group_size, bits=shape.bits)
            side[layer] = [_scatter_rows(a, rows, part) for a, part in zip(side[layer], parts)]

    def gather(self, layer: int, table: mx.array) -> tuple[Any, Any]:
        """(B, kv_heads, n · block_size, dim) keys and values of the blocks ``table`` (B, n)
        of ``layer``, each row's blocks in order: a contiguous copy ([packed, scales, biases]
        each in a quantized pool)."""
        B, n = table.shape

        def rows(a: mx.array) -> mx.array:  # (B, n, kv_heads, bs, d) -> (B, kv_heads, n·bs, d)
            t = a[table]
            return t.transpose(0, 2, 1, 3, 4).reshape(B, t.shape[2], n * self.block_size, -1)

        return tuple(
            [rows(a) for a in store] if isinstance(store, list) else rows(store)
            for store in (self.keys[layer], self.values[layer])
        )

    def _arrays(self) -> list[mx.array]:
        """Every array of the store in file order: per layer its keys, then its values (each
        one array, or packed, scales, biases)."""
        out = []
        for pair in zip(self.keys, self.values):
            for store in pair:
                out.extend(store if isinstance(store, list) else [store])
        return out

    def export_blocks(self, blocks: list[int]) -> list[list[np.ndarray]]:
        """Copies of ``blocks`` on the host: per block, each of :meth:`_arrays` at it, a
        (kv_heads, block_size, width) array (bfloat16 as its uint16 bits: numpy has none)."""
        index = mx.array(blocks, dtype=mx.int32)
        parts = [a[index] for a in self._arrays()]
        parts = [p.view(mx.uint16) if p.dtype == mx.bfloat16 else p for p in parts]
        mx.eval(parts)  # on the engine thread, whose stream wrote the blocks
        host = [np.array(p, copy=True) for p in parts]  # (n, kv_heads, block_size, width) each
        return [[h[j] for h in host] for j in range(len(blocks))]

    def import_blocks(self, blocks: list[int], contents: list[list[np.ndarray]]) -> None:
        """Write :meth:`export_blocks`' ``contents`` into ``blocks`` (one update per array)."""
        if not blocks:
            return
        index = mx.array(blocks, dtype=mx.int32)
        slots = self._arrays()
        fresh = []
        for t, a in enumerate(slots):
            part = mx.array(np.stack([c[t] for c in contents]))
            fresh.append(part.view(mx.bfloat16) if a.dtype == mx.bfloat16 else part)
        t = 0
        for i in range(len(self.layers)):
            for side in (self.keys, self.values):
                store = side[i]
                for a in store if isinstance(store, list) else [store]:
                    a[index] = fresh[t]  # in place, as write() does
                    t += 1
        mx.eval(self._arrays())

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.bytes_per_block


def flat_rows(slots: np.ndarray, kv_heads: int, block_size: int) -> mx.array:
    """Where the tokens at pool ``slots`` (N,) go in one layer's array seen as
    (n_blocks · kv_heads · block_size, dim) rows: token t's head h at
    (block · kv_heads + h) · block_size + within, t-major as (N, kv_heads, dim) keys flatten."""
    blocks, within = slots // block_size, slots % block_size
    heads = np.arange(kv_heads)
    rows = (blocks[:, None] * kv_heads + heads[None, :]) * block_size + within[:, None]
    return mx.array(rows.reshape(-1).astype(np.uint32))


def _scatter_rows(a: mx.array, rows: mx.array, new: mx.array) -> mx.array:
    """``a`` (n_blocks, kv_heads, block_size, width) with ``new``'s rows of ``width`` at
    ``rows`` of its flat (n_blocks · kv_heads · block_size, width) view."""
    flat = a.reshape(-1, a.shape[-1])
    flat[rows] = new.reshape(-1, new.shape[-1])
    return flat.reshape(a.shape)
