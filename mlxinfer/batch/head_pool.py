"""MTP heads' caches for every row that drafts with the model's own head: a paged pool of the
head's one layer, inside ``kv_budget``.

An MTP row (``submit(draft=MTP())``) keeps one pair a kept position, (its final hidden state,
the token after it), in its head's cache (``generation.mtp_drafts._MTPDrafter``). Here that cache is
a sequence of this pool (:class:`PooledCache`, the cache protocol over it): the pool has as many
blocks as the target's (``make_parts``: the budget buys that many blocks of the trunk's layers
and the head's together), and a row reserves its worst case in both at admission (its prompt,
``max_tokens`` and ``max_draft``: a head never holds more pairs than the target holds
positions; chained drafts' pairs are given back after each proposal), so a full budget makes
rows wait, never allocates past it. The head's pairs are never shared between rows (no hashes:
a row may start its pairs after a shared prefix, at its own offset 0).

A head whose cache this pool cannot hold (neither a ``KVCache`` nor MLA's ``LatentKVCache``)
keeps a cache per row, outside the budget, as before (``head_shape`` is None; no family has
one now). The head's keys are stored as the head computes them (``kv_bits`` quantizes the
target's pool only).
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.kv import KVCache, LatentKVCache, Mask
from .pool import KVPool, LayerShape, Sequence
from .requests import _Request
from .store import block_bytes, flat_rows


def mtp_head(model):
    """The head MTP rows of ``model`` draft with (``MTP.drafter``: the first), or None."""
    heads = getattr(model, "mtp_heads", None)
    return heads[0] if heads else None


def head_shape(head) -> LayerShape | None:
    """The head's cached keys and values per token, read from a one-pair forward of a fresh
    cache of its own; None for a cache the pool cannot hold."""
    cache = head.make_cache()
    if type(cache) not in (KVCache, LatentKVCache):
        return None
    token = mx.array([[0]], dtype=mx.int32)
    head(token, head.embed(token), cache)
    k, v = cache.state[:2]
    mx.eval(k, v)
    return LayerShape(k.shape[1], k.shape[-1], v.shape[-1], k.dtype)


class HeadPool:
    """The caches of ``head`` (an ``MTPHead``) for every row of an engine that drafts with it:
    ``blocks`` blocks of ``block_size`` pairs of its one layer (``shape``)."""

    def __init__(self, head, shape: LayerShape, blocks: int, block_size: int) -> None:
        self.block = head.block  # (``mtp_heads`` makes new MTPHead objects: its block is one)
        budget = blocks * block_bytes([shape], block_size)
        self.pool = KVPool([shape], block_size=block_size, kv_budget=budget)

    def holds(self, request: _Request) -> bool:
        """Whether ``request`` drafts with this pool's head (an MTP row whose head is another,
        attached after the engine was made, keeps a cache of its own)."""
        head = getattr(request.drafter, "head", None)
        return getattr(head, "block", None) is self.block

    def admit(self, request: _Request, room: int) -> bool:
        """Reserve the head's worst case for ``request`` (its prompt and ``room`` more pairs)
        and make its drafter's cache a sequence of the pool; False if the pool has no room now."""
        if not self.holds(request):
            return True
        seq = self.pool.admit(request.ids, room, share=False)
        if seq is None:
            return False
        request.drafter.cache = PooledCache(self.pool, seq)
        return True

    def release(self, request: _Request) -> None:
        cache = getattr(request.drafter, "cache", None)
        if isinstance(cache, PooledCache) and cache.pool is self.pool:
            self.pool.release(cache.seq)

    @property
    def bytes_in_use(self) -> int:
        return self.pool.stats().bytes_in_use

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes


class PooledCache:
    """The cache protocol over one row's sequence of a :class:`HeadPool`: a head's ``KVCache``
    (one row, its pairs from offset 0), its keys and values in the pool's blocks."""

    quantized = False

    def __init__(self, pool: KVPool, seq: Sequence) -> None:
        self.pool, self.seq = pool, seq

    @property
    def offset(self) -> int:
        return self.seq.length

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store (1, kv_heads, L, dim) keys and values after the row's pairs; all of its pairs'
        (1, kv_heads, T, dim), gathered from its blocks."""
        L, bs = keys.shape[2], self.pool.block_size
        slots = self.pool.append_slots(self.seq, [0] * L, hashed=False)  # never shared
        rows = flat_rows(slots, self.pool.layers[0].kv_heads, bs)
        self.pool.write(0, rows, keys[0].swapaxes(0, 1), values[0].swapaxes(0, 1))
        T = self.seq.length
        table = mx.array(self.pool.block_table(self.seq, T)[None])
        k, v = self.pool.gather(0, table)
        return k[:, :, :T], v[:, :, :T]

    def make_mask(self, n_queries: int) -> Mask:
        return None if n_queries == 1 else "causal"  # one row: as KVCache

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` pairs (their blocks go back to the row's reservation)."""
        n = min(self.offset, n)
        self.pool.rewind(self.seq, self.offset - n)
        return n

    def snapshot(self) -> int:
        return self.offset

    def restore(self, snapshot: int) -> None:
        self.trim(self.offset - snapshot)

    @property
    def state(self) -> list[mx.array]:
        return [self.pool.keys[0], self.pool.values[0]]

    @property
    def nbytes(self) -> int:
        return len(self.seq.blocks) * self.pool.bytes_per_block
