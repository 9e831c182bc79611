"""The rotating KV cache: at most ``max_size`` tokens of a layer, the oldest overwritten.

Sliding-window attention (``keep=0``: the query at position i sees keys j with
``i - j < max_size``), or ``--max-kv-size`` with ``keep`` leading "sink" tokens. It grows its
buffer as :class:`~mlxinfer.cache.kv.KVCache` does (``kv._grow``) and builds its own mask, since
only it knows which positions it still holds.
"""

from __future__ import annotations

import mlx.core as mx

from .kv import KVCache, Mask, _grow


class RotatingKVCache:
    """Keeps the first ``keep`` tokens and the last ``max_size - keep`` tokens.

    With ``keep=0`` this is exactly sliding-window attention over ``max_size``
    tokens: the query at position i sees keys j with ``i - j < max_size``.
    """

    quantized = False
    step = 256

    SINKS = 4  # the leading tokens ``--max-kv-size`` keeps (:meth:`bounded`)

    @classmethod
    def bounded(cls, max_kv_size: int) -> RotatingKVCache:
        """The cache ``max_kv_size`` (``--max-kv-size``) asks for: the first :data:`SINKS`
        tokens and the latest; a ValueError naming it where it cannot hold one more."""
        if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int):
            raise ValueError(f"max_kv_size: expected an integer, found {max_kv_size!r}")
        if max_kv_size <= cls.SINKS:
            raise ValueError(
                f"max_kv_size: expected at least {cls.SINKS + 1} (the first {cls.SINKS} tokens "
                f"are always kept, then the latest), found {max_kv_size}"
            )
        return cls(max_kv_size, keep=cls.SINKS)

    def __init__(self, max_size: int, keep: int = 0) -> None:
        if max_size <= keep:
            raise ValueError(f"max_size ({max_size}) must exceed keep ({keep})")
        self.max_size, self.keep = max_size, keep
        # Both None before the first tokens, both arrays after.
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._size = 0  # valid entries in the buffers
        self._idx = 0  # next ring write position once the buffer is full

    def _in_order(self, buf: mx.array) -> mx.array:
        """Entries sorted by position: the ring's oldest entry sits at ``_idx``."""
        buf = buf[..., : self._size, :]
        if self._size < self.max_size or self._idx in (self.keep, self.max_size):
            return buf
        k, i = self.keep, self._idx
        return mx.concatenate([buf[..., :k, :], buf[..., i:, :], buf[..., k:i, :]], axis=2)

    def _positions(self) -> list[int]:
        """Positions of the cached entries, in temporal order."""
        if self.offset == self._size:
            return list(range(self.offset))
        tail = self._size - self.keep
        return list(range(self.keep)) + list(range(self.offset - tail, self.offset))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        L = keys.shape[2]
        if L == 1 and self.keys is not None:
            return self._update_one(keys, values)
        # Several tokens: attend over everything cached plus the new tokens (the
        # mask limits the window), then store only what the next step needs.
        if self.keys is None or self.values is None:  # both or neither
            full_k, full_v = keys, values
        else:
            full_k = mx.concatenate([self._in_order(self.keys), keys], axis=2)
            full_v = mx.concatenate([self._in_order(self.values), values], axis=2)
        n = full_k.shape[2]
        if n > self.max_size:
            tail = self.max_size - self.keep
            store_k = mx.concatenate(
                [full_k[..., : self.keep, :], full_k[..., n - tail :, :]], axis=2
            )
            store_v = mx.concatenate(
                [full_v[..., : self.keep, :], full_v[..., n - tail :, :]], axis=2
            )
        else:
            store_k, store_v = full_k, full_v
        # Compact copies: the first prompt's keys may be views into a larger array (see _write).
        self.keys, self.values = mx.contiguous(store_k), mx.contiguous(store_v)
        self._size = self._idx = store_k.shape[2]
        self.offset += L
        return full_k, full_v

    def _update_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        slot, n = self.decode_slot(keys, values)
        assert self.keys is not None and self.values is not None  # update_and_fetch checked
        self.keys[..., slot : slot + 1, :] = keys
        self.values[..., slot : slot + 1, :] = values
        # A single query may see every stored entry, so their order is irrelevant.
        return self.keys[..., :n, :], self.values[..., :n, :]

    def decode_slot(self, keys: mx.array, values: mx.array) -> tuple[int, int]:
        """One more token (its ``keys``/``values`` (B, H, 1, D), or arrays of their shape):
        the buffers grown where they are full, the ring advanced, the offset counted; returns
        the slot the caller writes the token to and how many entries its query sees (every
        stored one). ``_update_one`` writes it here; the CPU backend's decode kernels write
        it themselves (``backends/cpu/compiled.py``)."""
        assert self.keys is not None and self.values is not None  # an empty cache prefills
        if self._size < self.max_size:
            cap = min(self.max_size, self._size + self.step)
            if self.keys.shape[2] < self._size + 1:
                self.keys = _grow(self.keys, self._size, cap, cap - self._size, keys)
                self.values = _grow(self.values, self._size, cap, cap - self._size, values)
            slot = self._size
            self._size += 1
            self._idx = self._size
        else:
            if self._idx >= self.max_size:
                self._idx = self.keep  # wrap around, never overwriting the kept tokens
            slot = self._idx
            self._idx += 1
        self.offset += 1
        return slot, self._size

    def make_mask(self, n_queries: int) -> Mask:
        if n_queries == 1:
            return None
        window = self.max_size - self.keep
        if self.offset == self._size and self.offset + n_queries <= window:
            # Nothing evicted (the keys are positions 0.. in order) and every query within the
            # window of every earlier key: exactly causal (sdpa's and the CPU kernels' fast form).
            return "causal"
        k_pos = mx.array(self._positions() + list(range(self.offset, self.offset + n_queries)))
        q_pos = mx.arange(self.offset, self.offset + n_queries)[:, None]
        visible = (k_pos[None] <= q_pos) & (
            (q_pos - k_pos[None] < window) | (k_pos[None] < self.keep)
        )
        return visible  # (n_queries, cached + n_queries) boolean

    def is_trimmable(self) -> bool:
        return self.offset == self._size  # nothing evicted yet

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self.offset, n)
        self.offset -= n
        self._size = self._idx = self.offset
        return n

    snapshot = KVCache.snapshot
    restore = KVCache.restore  # fails once entries were evicted, as trim does

    @property
    def state(self) -> list[mx.array]:
        if self.keys is None or self.values is None:  # both or neither
            return []
        return [self._in_order(self.keys), self._in_order(self.values)]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = arrays
        self._size = self._idx = self.keys.shape[2]

    @property
    def meta_state(self) -> dict[str, str]:
        return {"max_size": str(self.max_size), "keep": str(self.keep), "offset": str(self.offset)}

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        self.max_size, self.keep, self.offset = (
            int(meta["max_size"]),
            int(meta["keep"]),
            int(meta["offset"]),
        )

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:  # both or neither
            return 0
        B, H, _, Dk = self.keys.shape
        return B * H * self._size * (Dk + self.values.shape[-1]) * self.keys.itemsize
