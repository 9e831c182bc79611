"""The quantized KV cache (``--kv-bits``): keys and values stored as 8- or 4-bit affine groups,
for attention through ``mx.quantized_matmul``; the other cache kinds are :mod:`mlxinfer.cache.kv`'s."""

from __future__ import annotations

import mlx.core as mx

from .kv import KVCache, Reserving, _grow, _write


class QuantizedKVCache(Reserving):
    """Keys and values stored as affine ``bits``-bit groups of ``group_size``."""

    quantized = True
    step = 256

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        if bits not in (4, 8):
            raise ValueError(f"kv bits must be 4 or 8, got {bits}")
        self.group_size, self.bits = group_size, bits
        # [packed, scales, biases] each: both None before the first tokens, both lists after.
        self.keys: list[mx.array] | None = None
        self.values: list[mx.array] | None = None
        self.offset = 0
        self.reserved = 0

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[list[mx.array], list[mx.array]]:
        prev, L = self.offset, keys.shape[2]
        new_k = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_v = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        needed, step = self._growth(prev + L, None if self.keys is None else self.keys[0])
        if self.keys is None or self.values is None:  # both or neither: the first tokens
            self.keys = [_write(_grow(None, prev, needed, step, a), prev, a) for a in new_k]
            self.values = [_write(_grow(None, prev, needed, step, a), prev, a) for a in new_v]
        else:
            for bufs, new in ((self.keys, new_k), (self.values, new_v)):
                for i in range(3):
                    bufs[i] = _write(_grow(bufs[i], prev, needed, step, new[i]), prev, new[i])
        self.offset = prev + L
        return (
            [a[..., : self.offset, :] for a in self.keys],
            [a[..., : self.offset, :] for a in self.values],
        )

    make_mask = KVCache.make_mask
    is_trimmable = KVCache.is_trimmable
    trim = KVCache.trim
    snapshot = KVCache.snapshot
    restore = KVCache.restore

    def make_room(self) -> None:
        """Room in the buffers for one more token (a decode step's writer fills it in place:
        the CPU backend's fused blocks), grown as :meth:`update_and_fetch` grows them."""
        assert self.keys is not None and self.values is not None  # after the first tokens
        if self.offset < self.keys[0].shape[2]:
            return
        needed, step = self._growth(self.offset + 1, self.keys[0])
        for bufs in (self.keys, self.values):
            bufs[:] = [_grow(a, self.offset, needed, step, a) for a in bufs]

    def grow(self, n_tokens: int) -> None:
        """As :meth:`KVCache.grow`, for each of the packed, scales and biases buffers."""
        self.reserve(n_tokens)
        if self.keys is None or n_tokens <= self.keys[0].shape[2]:
            return
        assert self.values is not None  # set with the keys
        for bufs in (self.keys, self.values):
            bufs[:] = [_grow(a, self.offset, n_tokens, 1, a) for a in bufs]
        mx.eval(self.keys, self.values)

    @property
    def state(self) -> list[mx.array]:
        if self.keys is None or self.values is None:  # both or neither
            return []
        return [a[..., : self.offset, :] for a in self.keys + self.values]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = list(arrays[:3]), list(arrays[3:])
        self.offset = self.keys[0].shape[2]

    @property
    def meta_state(self) -> dict[str, str]:
        return {"group_size": str(self.group_size), "bits": str(self.bits)}

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        self.group_size, self.bits = int(meta["group_size"]), int(meta["bits"])

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:  # both or neither
            return 0
        per_token = sum(a.nbytes // a.shape[2] for a in self.keys + self.values)
        return per_token * self.offset
