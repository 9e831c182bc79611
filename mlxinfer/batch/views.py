"""One forward pass over the pool: the cache protocol for a batch of sequences.

The models call ``cache.update_and_fetch(k, v)``, read ``cache.offset`` for
positions and ask ``cache.make_mask(L)``; a :class:`LayerView` answers for one
layer of one step over B sequences of the pool:

- ``offset`` is each row's position (an int for one row, a (B,) array for several:
  ``mx.fast.rope`` rotates each row from its own offset);
- ``update_and_fetch`` writes the new keys into the rows' slots and gathers each
  row's keys back, (B, kv_heads, T, head_dim) for T the longest row, the shorter
  rows padded;
- ``make_mask`` hides each row's padding and the future: query i of row b sees
  key j when j ≤ offset[b] + i (and, in a sliding-window layer, offset[b] + i - j < window;
  the pool keeps every key, the mask slides).

The gather is one per-step contiguous view of the pages (docs/batching.md says
what it costs against attention over the blocks themselves).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cache import Mask
from .pool import KVPool, Sequence


class StepBatch:
    """The slots, the gather table and the mask of one forward: ``n_new`` tokens for each
    of ``seqs`` (their tokens are recorded in the pool by :meth:`KVPool.append_slots`)."""

    def __init__(
        self,
        pool: KVPool,
        seqs: list[Sequence],
        tokens: list[list[int]],
        windows: list[int | None] | None = None,
    ) -> None:
        self.pool = pool
        # Per layer: None (full attention) or its sliding window (keys within the last `window`).
        self.windows = windows or [None] * len(pool.layers)
        self._masks: dict[int | None, Mask] = {}
        n_new = len(tokens[0])
        starts = [s.length for s in seqs]
        write = [pool.append_slots(s, t) for s, t in zip(seqs, tokens)]
        totals = [start + n_new for start in starts]
        T = max(totals)
        table = np.zeros((len(seqs), T), np.int32)
        for b, (s, total) in enumerate(zip(seqs, totals)):
            table[b, :total] = pool.slot_table(s, total)
        self.write_slots = mx.array(np.concatenate(write))
        self.table = mx.array(table)
        self.n_rows, self.n_new = len(seqs), n_new
        self._starts, self._T = starts, T
        self.offset: int | mx.array = (
            starts[0] if len(seqs) == 1 else mx.array(starts, dtype=mx.int32)
        )

    def mask_for(self, window: int | None) -> Mask:
        """The mask of layers with this sliding ``window`` (None: full attention), made once."""
        if window not in self._masks:
            self._masks[window] = self._mask(window)
        return self._masks[window]

    def _mask(self, window: int | None) -> Mask:
        starts, T, n_new = self._starts, self._T, self.n_new
        if len(starts) == 1 and (window is None or T <= window):
            return None if n_new == 1 else "causal"
        # Query i of row b (position start_b + i) sees key j when j <= start_b + i, and within
        # the window: the future, the padding and the keys slid out are hidden.
        position = np.asarray(starts)[:, None, None] + np.arange(n_new)[None, :, None]  # (B, L, 1)
        keys = np.arange(T)[None, None]  # (1, 1, T)
        visible = keys <= position
        if window is not None:
            visible &= position - keys < window
        return mx.array(visible[:, None])  # (B, 1, L, T)

    def views(self) -> list[LayerView]:
        return [LayerView(self, i, w) for i, w in enumerate(self.windows)]


class LayerView:
    """The :class:`~mlxinfer.cache.Cache` protocol for one layer of a :class:`StepBatch`."""

    quantized = False

    def __init__(self, batch: StepBatch, layer: int, window: int | None = None) -> None:
        self.batch, self.layer, self.window = batch, layer, window

    @property
    def offset(self) -> int | mx.array:
        return self.batch.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store (B, kv_heads, L, dim) keys and values; every row's cached ones, padded."""
        B, H, L, _ = keys.shape
        pool, batch = self.batch.pool, self.batch
        flat_k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, -1)
        flat_v = values.transpose(0, 2, 1, 3).reshape(B * L, H, -1)
        pool.write(self.layer, batch.write_slots, flat_k, flat_v)
        return pool.gather(self.layer, batch.table)

    def make_mask(self, n_queries: int) -> Mask:
        return self.batch.mask_for(self.window)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def state(self) -> list[mx.array]:
        return [self.batch.pool.keys[self.layer], self.batch.pool.values[self.layer]]

    @property
    def nbytes(self) -> int:
        return self.batch.pool.nbytes // max(1, len(self.batch.pool.layers))
