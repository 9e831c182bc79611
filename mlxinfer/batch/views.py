"""One forward pass over the pool: the cache protocol for a batch of sequences.

The models call ``cache.update_and_fetch(k, v)``, read ``cache.offset`` for
positions and ask ``cache.make_mask(L)``; a :class:`LayerView` answers for one
layer of one step over B sequences of the pool:

- ``offset`` is each row's position (an int for one row, a (B,) array for several:
  ``mx.fast.rope`` rotates each row from its own offset);
- ``update_and_fetch`` writes the new keys into the rows' slots and returns each
  row's keys gathered, (B, kv_heads, T, head_dim), the shorter rows padded (lazy:
  computed only where attention reads them);
- ``make_mask`` hides each row's padding and the future: query i of row b sees
  key j when j ≤ offset[b] + i (and, in a sliding-window layer, offset[b] + i - j < window;
  the pool keeps every key, the mask slides);
- ``pages(mask)`` offers the layer's blocks themselves to a decode step's attention
  (``models.layers.attention.paged_attention``), which then never computes the gather.

Attention over the pages in place is 1.8x faster than over the gathered copy on the
CPU backend (docs/batching.md); prefill chunks, soft-capped and ALiBi layers read the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from ..cache.kv import Mask, Pages, StateCache
from .layout import STATE
from .pool import KVPool, Sequence
from .store import flat_rows


class StepBatch:
    """The slots, the block table and the mask of one forward: ``n_new`` tokens for each
    of ``seqs`` (their tokens are recorded in the pool by :meth:`KVPool.append_slots`; with
    ``hashed=False`` their full blocks are hashed later, by :meth:`KVPool.hash_full`).

    ``form`` is how a decode step's attention reads the pool: ``"pages"``, over the blocks
    where they lie (:meth:`LayerView.pages`), or ``"gather"``, over a contiguous copy of each
    row's keys (what prefill chunks and the layers that cannot read pages always use).

    ``window``: (a window pool, the rows' sequences in it) for a model whose sliding-window
    layers keep their keys there (``KVPool(window=)``). In a window pool each row first gives
    back the blocks its window no longer sees.

    ``blocks``: per row, None or (n_new,) ids >= 0 where new tokens of one image run see each
    other both ways (Gemma 3's image tokens, ``layers/masks.with_blocks``'s rule: a sliding
    layer still hides what is a window or more behind a query)."""

    def __init__(
        self,
        pool: KVPool,
        seqs: list[Sequence],
        tokens: list[list[int]],
        windows: list[int | str | None] | None = None,
        form: str = "gather",
        states: list[list[StateCache]] | None = None,
        window: tuple[KVPool, list[Sequence]] | None = None,
        hashed: bool = True,
        blocks: list[np.ndarray | None] | None = None,
    ) -> None:
        self.pool = pool
        self.blocks = blocks if blocks is not None and any(b is not None for b in blocks) else None
        # Per model layer: None (full attention), its sliding window (keys within the last
        # `window`), or STATE: a recurrent layer, whose state each row keeps in `states`.
        self.windows = windows or [None] * len(pool.layers)
        self.states = states
        self._masks: dict[tuple, Mask] = {}
        self._visible: dict[tuple, mx.array] = {}
        n_new = len(tokens[0])
        starts = [s.length for s in seqs]
        self.n_rows, self.n_new = len(seqs), n_new
        self.form = form if n_new == 1 else "gather"
        self._starts = starts
        self.main = _Slots(pool, seqs, tokens, self.form, hashed)
        self.windowed = None if window is None else _Slots(*window, tokens, self.form, hashed)
        self.offset: int | mx.array = (
            starts[0] if len(seqs) == 1 else mx.array(starts, dtype=mx.int32)
        )

    def mask_for(self, window: int | None, slots: _Slots | None = None) -> Mask:
        """The mask of layers with this sliding ``window`` (None: full attention) over the keys
        of ``slots`` (the pool's by default), made once."""
        slots = slots if slots is not None else self.main
        key = (window, id(slots))
        if key not in self._masks:
            self._masks[key] = self._mask(window, slots)
        return self._masks[key]

    def _mask(self, window: int | None, slots: _Slots) -> Mask:
        if self.n_rows == 1 and (window is None or slots.T <= window) and self.blocks is None:
            return None if self.n_new == 1 else "causal"
        return mx.array(self._visible_keys(window, slots)[:, None])  # (B, 1, L, T)

    def _visible_keys(self, window: int | None, slots: _Slots, T: int | None = None) -> np.ndarray:
        # Query i of row b (position start_b + i) sees key j (position base_b + j) when it is
        # not in the future and, in a sliding layer, within the window: the future, the padding
        # and the keys slid out are hidden. (B, L, T)
        position = np.asarray(self._starts)[:, None, None] + np.arange(self.n_new)[None, :, None]
        keys = slots.base[:, None, None] + np.arange(slots.T if T is None else T)[None, None]
        visible = keys <= position
        if self.blocks is not None:  # an image's new tokens see each other, later ones too
            for b, runs in enumerate(self.blocks):
                if runs is None:
                    continue
                runs = np.asarray(runs)
                new = keys[b, 0] - self._starts[b]  # (T,) each key's index among the new tokens
                inside = (new >= 0) & (new < self.n_new)
                run_of_key = np.where(inside, runs[np.clip(new, 0, self.n_new - 1)], -1)
                visible[b] |= (runs[:, None] >= 0) & (runs[:, None] == run_of_key[None, :])
        if window is not None:
            visible &= position - keys < window
        return visible

    def pages(self, slots: _Slots, window: int | None, kv_heads: int, layer: int) -> Pages:
        key = (window, id(slots))
        if key not in self._visible:
            n_blocks, bs = slots.table.shape[1], slots.pool.block_size
            visible = self._visible_keys(window, slots, n_blocks * bs)[:, 0]  # (B, T), one query
            self._visible[key] = mx.array(visible.reshape(self.n_rows, 1, n_blocks, 1, bs))
        keys, values = slots.pool.keys[layer], slots.pool.values[layer]
        shape = slots.pool.layers[layer]
        return Pages(
            keys, values, *slots.index[kv_heads], self._visible[key], shape.bits, shape.group_size
        )

    def views(self) -> list[LayerView | RowStates]:
        """One cache per model layer: a view of a pool for an attention layer (the pool holds
        those only, in order; a window pool the sliding ones), the rows' own states for a
        recurrent one."""
        views: list[LayerView | RowStates] = []
        n_kv = n_window = n_state = 0
        for w in self.windows:
            if w == STATE:
                views.append(RowStates([row[n_state] for row in self.states], self.offset))
                n_state += 1
            elif w is not None and self.windowed is not None:
                views.append(LayerView(self, n_window, w, self.windowed))
                n_window += 1
            else:
                views.append(LayerView(self, n_kv, w, self.main))
                n_kv += 1
        return views


class _Slots:
    """One pool's part of a step: where the new keys go, and each row's block table.

    In a window pool a row first gives back the blocks its window no longer sees, and its table
    starts at its first block still seen (``base``: that block's first position), so the
    sliding layers' attention reads about a window of keys per row, not the whole sequence."""

    def __init__(
        self, pool: KVPool, seqs: list[Sequence], tokens: list[list[int]], form: str, hashed: bool
    ):
        bs = pool.block_size
        first = [0] * len(seqs)
        if pool.window is not None:
            for b, s in enumerate(seqs):
                pool.drop_before(s, s.length)
                first[b] = pool.first_seen(s.length)
        write = np.concatenate([pool.append_slots(s, t, hashed) for s, t in zip(seqs, tokens)])
        self.pool = pool
        # where the new keys go: rows of each layer's array, per kv-head count (store.flat_rows)
        self.write_rows = {h: flat_rows(write, h, bs) for h in {s.kv_heads for s in pool.layers}}
        tables = [pool.block_table(s, s.length)[f:] for s, f in zip(seqs, first)]
        n_blocks = max(len(t) for t in tables)
        table = np.zeros((len(seqs), n_blocks), np.int32)  # padding: block 0, masked
        for b, blocks in enumerate(tables):
            table[b, : len(blocks)] = blocks
        self.table = mx.array(table)
        self.base = np.asarray(first) * bs  # (B,) the position of each row's first key here
        # Keys per row as gathered: one row's exactly, several rows' padded to whole blocks.
        self.T = seqs[0].length - self.base[0] if len(seqs) == 1 else n_blocks * bs
        if form == "pages":
            self.index = {h: _page_index(table, h) for h in {s.kv_heads for s in pool.layers}}


class RowStates:
    """The :class:`~mlxinfer.cache.kv.StateCache` protocol for one recurrent layer of a step
    over B rows, each with its own state: the layer reads the rows' arrays stacked, (B, ...),
    and :meth:`update` hands each row its own slice back. A row with no state yet (nothing
    fed) reads zeros, which is what a fresh state is."""

    quantized = False

    def __init__(self, rows: list[StateCache], offset: int | mx.array) -> None:
        self.rows, self.offset = rows, offset

    @property
    def arrays(self) -> list[mx.array | None]:
        out: list[mx.array | None] = []
        for k in range(len(self.rows[0].arrays)):
            parts = [r.arrays[k] for r in self.rows]
            like = next((a for a in parts if a is not None), None)
            if like is None:
                out.append(None)
                continue
            parts = [mx.zeros_like(like) if a is None else a for a in parts]
            out.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0))
        return out

    @property
    def recording(self) -> bool:
        """Whether the rows keep their states by position (a verification step)."""
        return any(r.recording for r in self.rows)

    def update(self, arrays: list[mx.array], n_tokens: int, positions=None) -> None:
        for b, row in enumerate(self.rows):
            at = None
            if positions is not None:  # row b's slice of the batch's states at position i

                def at(i: int, b: int = b) -> list[mx.array]:
                    return [a[b : b + 1] for a in positions(i)]

            row.update([a[b : b + 1] for a in arrays], n_tokens, at)

    def make_mask(self, n_queries: int) -> Mask:
        return None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.arrays if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)


class LayerView:
    """The :class:`~mlxinfer.cache.kv.Cache` protocol for one layer of a :class:`StepBatch`; in a
    quantized pool it answers as a quantized cache (packed triples, ``group_size``, ``bits``)."""

    def __init__(
        self, batch: StepBatch, layer: int, window: int | None, slots: _Slots | None = None
    ) -> None:
        self.batch, self.layer, self.window = batch, layer, window
        self.slots = slots if slots is not None else batch.main
        shape = self.slots.pool.layers[layer]
        self.quantized = shape.bits is not None
        self.group_size, self.bits = shape.group_size, shape.bits

    @property
    def offset(self) -> int | mx.array:
        return self.batch.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store (B, kv_heads, L, dim) keys and values; every row's cached ones, padded (a
        lazy gather: not computed where attention reads the pages instead)."""
        B, H, L, _ = keys.shape
        slots = self.slots
        flat_k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, -1)
        flat_v = values.transpose(0, 2, 1, 3).reshape(B * L, H, -1)
        self.write_rows(flat_k, flat_v)
        k, v = slots.pool.gather(self.layer, slots.table)
        T = slots.T
        if self.quantized:
            return [a[:, :, :T] for a in k], [a[:, :, :T] for a in v]
        return (k, v) if k.shape[2] == T else (k[:, :, :T], v[:, :, :T])

    def write_rows(self, keys: mx.array, values: mx.array) -> None:
        """Store the step's (N, kv_heads, dim) keys and values, token-major (N = B · L), at the
        places the step gave each row (the CPU backend's decode step writes its RoPE'd keys
        here directly, then reads the pages)."""
        slots = self.slots
        heads = slots.pool.layers[self.layer].kv_heads
        slots.pool.write(self.layer, slots.write_rows[heads], keys, values)

    def write_rows_with(self, write: Callable[[Any, Any, mx.array], tuple[Any, Any]]) -> None:
        """Store the step's keys and values as ``write(keys, values, rows)`` gives them: this
        layer's pool arrays (each a float array, or a quantized pool's [codes, scales,
        biases]) with them written at ``rows``, the places :meth:`write_rows` writes (the CPU
        backend's fused block writes both from its q | k | v row, keys rotated, in one kernel
        call)."""
        slots = self.slots
        store, layer = slots.pool, self.layer
        rows = slots.write_rows[store.layers[layer].kv_heads]
        store.keys[layer], store.values[layer] = write(store.keys[layer], store.values[layer], rows)

    def make_mask(self, n_queries: int) -> Mask:
        return self.batch.mask_for(self.window, self.slots)

    def pages(self, mask: Mask) -> Pages | None:
        """This layer's blocks for attention over them in place, after ``update_and_fetch``:
        in a decode step of the ``"pages"`` form whose ``mask`` is this cache's own (a layer
        that made its own, ALiBi's say, reads the gathered keys)."""
        if not self.reads_pages(mask):
            return None
        kv_heads = self.slots.pool.layers[self.layer].kv_heads
        return self.batch.pages(self.slots, self.window, kv_heads, self.layer)

    def reads_pages(self, mask: Mask) -> bool:
        """Whether attention under ``mask`` reads this layer's pages (:meth:`pages`)."""
        batch = self.batch
        return batch.form == "pages" and mask is batch.mask_for(self.window, self.slots)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def snapshot(self) -> Any:
        raise NotImplementedError("a pool's layer view: the engine rewinds in the pool")

    def restore(self, snapshot: Any) -> None:
        raise NotImplementedError("a pool's layer view: the engine rewinds in the pool")

    @property
    def state(self) -> list[mx.array]:
        pool = self.slots.pool
        stores = [pool.keys[self.layer], pool.values[self.layer]]
        return [a for s in stores for a in (s if isinstance(s, list) else [s])]

    @property
    def nbytes(self) -> int:
        return self.slots.pool.nbytes // max(1, len(self.slots.pool.layers))


def _page_index(table: np.ndarray, kv_heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """``Pages``' (blocks, queries, order) for a (B, n) block table, (B, kv_heads, n) each."""
    B, n = table.shape
    heads = np.arange(kv_heads, dtype=np.uint32)[None, :, None]
    blocks = table.astype(np.uint32)[:, None, :] * kv_heads + heads
    queries = np.broadcast_to(
        np.arange(B, dtype=np.uint32)[:, None, None] * kv_heads + heads, blocks.shape
    )
    order = np.arange(blocks.size, dtype=np.uint32).reshape(blocks.shape)
    return mx.array(blocks), mx.array(np.ascontiguousarray(queries)), mx.array(order)
