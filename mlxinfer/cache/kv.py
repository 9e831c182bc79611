"""KV caches: one object per layer, all behind the :class:`Cache` protocol.

The arrays live in unified memory, so on a Mac the GPU writes them in place
and the CPU can read them without a copy. Kinds:

- :class:`KVCache` — the standard cache, preallocated in steps of ``step``
  tokens and written in place.
- :class:`~mlxinfer.cache.rotating.RotatingKVCache` (its own module) — keeps at most
  ``max_size`` tokens (sliding-window attention, or ``--max-kv-size`` with ``keep`` leading
  "sink" tokens).
- :class:`~mlxinfer.cache.quantized.QuantizedKVCache` (its own module) — keys and
  values stored 8- or 4-bit (``--kv-bits``); attention over it goes through
  ``mx.quantized_matmul``.
- :class:`~mlxinfer.cache.state.StateCache` (its own module, named here too) — a
  recurrent layer's fixed-size state (LFM2's short convolution): no entry per token,
  so it cannot be trimmed; ``snapshot`` and ``restore`` take it back instead
  (speculative rewinds, prompt-cache reuse).

Each cache also builds the attention mask for the queries about to be added
(``make_mask``), because only the cache knows which positions it holds. A batched
or paged cache will add its own kinds behind the same protocol.

A :class:`StateCache` serves a recurrent layer, not attention (``state.py``): it has the
protocol's bookkeeping but neither ``update_and_fetch`` nor ``make_mask``, so a model's list
of caches is a list of :data:`LayerCache` (a :class:`Cache` or a :class:`StateCache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import mlx.core as mx

from .state import StateCache  # noqa: F401 (named with the KV caches: imported from here)

Mask = None | str | mx.array


@runtime_checkable
class Cache(Protocol):
    offset: int  # tokens seen so far == position of the next token
    quantized: bool  # True: update_and_fetch returns (packed, scales, biases) triples

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]: ...
    def make_mask(self, n_queries: int) -> Mask: ...
    def is_trimmable(self) -> bool: ...
    def trim(self, n: int) -> int: ...
    # What restore() needs to come back to this point; cheap (an offset, or references to
    # arrays that are replaced, never written in place). Every kind has both, trimmable or not.
    def snapshot(self) -> Any: ...
    def restore(self, snapshot: Any) -> None: ...
    @property
    def state(self) -> list[mx.array]: ...
    @property
    def meta_state(self) -> dict[str, str]: ...  # settings a cache file keeps (prompt.py)
    @property
    def nbytes(self) -> int: ...


class QuantizedCache(Cache, Protocol):
    """A cache whose ``quantized`` is True: its keys and values are (packed, scales, biases)
    triples of ``bits``-bit affine groups of ``group_size`` (``QuantizedKVCache``)."""

    group_size: int
    bits: int


# Any layer's cache: an attention layer's (the protocol above) or a recurrent layer's state. Both
# have the bookkeeping (offset, trim, snapshot/restore, state, nbytes) the cache helpers use.
LayerCache = Cache | StateCache


class Pages(NamedTuple):
    """A paged cache's keys and values as its blocks, for attention over them in place
    (``models.layers.attention.paged_attention``); a paged cache offers them through
    ``cache.pages(mask)`` (None where it does not). In a quantized pool (``bits`` set) keys
    and values are each [packed, scales, biases] as ``mx.quantize`` makes them."""

    keys: Any  # (n_blocks, kv_heads, block_size, key_dim): the whole store (or its triple)
    values: Any  # (n_blocks, kv_heads, block_size, value_dim)
    blocks: mx.array  # (B, kv_heads, n) uint32: block * kv_heads + head, each row's blocks in order
    queries: mx.array  # (B, kv_heads, n) uint32: row * kv_heads + head
    order: mx.array  # (B, kv_heads, n) uint32: 0, 1, 2, ... (the probabilities' own matrices)
    visible: mx.array  # (B, 1, n, 1, block_size) bool: the row's keys, not padding or slid out
    bits: int | None = None  # a quantized pool's bits and groups
    group_size: int = 64


def _grow(buf: mx.array | None, used: int, needed: int, step: int, like: mx.array) -> mx.array:
    """Return ``buf`` with room for ``needed`` tokens along axis 2, in ``step`` chunks
    (``step=1``: exactly)."""
    if buf is not None and needed <= buf.shape[2]:
        return buf
    B, H, _, D = like.shape
    extra = ((needed - used + step - 1) // step) * step
    fresh = mx.zeros((B, H, extra, D), like.dtype)
    if buf is None:
        return fresh
    return mx.concatenate([buf[..., :used, :], fresh], axis=2)


def _write(buf: mx.array, start: int, new: mx.array) -> mx.array:
    """``buf`` with ``new`` written at ``start`` along axis 2.

    A write that covers all of ``buf`` yields ``new`` itself in MLX, which may be a
    view into a larger array (a slice of a stacked q/k/v product): the cache would
    then keep that whole array alive, so such a write is stored as a compact copy.
    """
    if start == 0 and new.shape[2] == buf.shape[2]:
        return mx.contiguous(new)
    buf[..., start : start + new.shape[2], :] = new
    return buf


class Reserving:
    """Growth of preallocated buffers, shared by :class:`KVCache` and ``QuantizedKVCache``: in
    ``step``-token chunks, or at once to what :meth:`reserve` asked for."""

    step = 256  # tokens added per growth; large enough that growth is rare
    reserved: int  # capacity to allocate at the next growth (see reserve)

    def reserve(self, n_tokens: int) -> None:
        """Make the next growth room for ``n_tokens`` at once (a prompt about to be prefilled).

        Growing chunk by chunk copies the whole cache at every chunk and
        briefly holds two copies of it.
        """
        self.reserved = max(self.reserved, n_tokens)

    def _growth(self, needed: int, buf: mx.array | None) -> tuple[int, int]:
        """``(capacity, step)`` for holding ``needed`` tokens: the reservation exactly
        while it covers them, else growth in ``step`` chunks."""
        if buf is not None and needed <= buf.shape[2]:
            return needed, self.step
        if needed <= self.reserved:
            return self.reserved, 1
        return needed, self.step


class KVCache(Reserving):
    """Standard cache: (B, n_kv_heads, capacity, head_dim) buffers written in place."""

    quantized = False
    step = 256  # tokens added per growth; large enough that growth is rare

    def __init__(self) -> None:
        # Both None before the first tokens, both arrays after.
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.reserved = 0  # capacity to allocate at the next growth (see reserve)

    def grow(self, n_tokens: int) -> None:
        """Give the buffers room for ``n_tokens`` now, copying what is cached.

        Prefill reserves room for the prompt only; decode's room is added here,
        after prefill's transients are gone, so the two never peak together.
        """
        self.reserve(n_tokens)
        if self.keys is None or n_tokens <= self.keys.shape[2]:
            return
        assert self.values is not None  # set with the keys
        self.keys = _grow(self.keys, self.offset, n_tokens, 1, self.keys)
        self.values = _grow(self.values, self.offset, n_tokens, 1, self.values)
        mx.eval(self.keys, self.values)

    def make_room(self, keys: mx.array, values: mx.array) -> None:
        """Grow the buffers (made like ``keys``/``values`` if there are none yet) to hold these
        (B, n_kv_heads, L, head_dim) new tokens after the cached ones."""
        prev, L = self.offset, keys.shape[2]
        needed, step = self._growth(prev + L, self.keys)
        self.keys = _grow(self.keys, prev, needed, step, keys)
        self.values = _grow(self.values, prev, needed, step, values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, L = self.offset, keys.shape[2]
        self.make_room(keys, values)
        assert self.keys is not None and self.values is not None  # made by make_room
        self.offset = prev + L
        self.keys = _write(self.keys, prev, keys)
        self.values = _write(self.values, prev, values)
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def make_mask(self, n_queries: int) -> Mask:
        # One query sees every cached key; several need the causal mask, which
        # sdpa aligns lower-right (last query ↔ last key), i.e. after `offset`.
        return None if n_queries == 1 else "causal"

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (the buffer is kept and overwritten later)."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def snapshot(self) -> int:
        # Entries below the offset are only rewritten after a trim below them.
        return self.offset

    def restore(self, snapshot: int) -> None:
        held, drop = self.offset, self.offset - snapshot
        if drop < 0 or self.trim(drop) != drop:
            raise ValueError(
                f"cannot restore a {type(self).__name__} holding {held} tokens to {snapshot}"
            )

    @property
    def state(self) -> list[mx.array]:
        if self.keys is None or self.values is None:  # both or neither
            return []
        return [self.keys[..., : self.offset, :], self.values[..., : self.offset, :]]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = arrays
        self.offset = self.keys.shape[2]

    @property
    def meta_state(self) -> dict[str, str]:
        return {}

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        pass

    @property
    def nbytes(self) -> int:
        """Bytes of the cached tokens: 2 × kv_heads × head_dim × tokens × itemsize (× batch)."""
        if self.keys is None or self.values is None:  # both or neither
            return 0
        B, H, _, Dk = self.keys.shape
        Dv = self.values.shape[-1]
        return B * H * self.offset * (Dk + Dv) * self.keys.itemsize


class LatentKVCache(KVCache):
    """Multi-head latent attention's cache (DeepSeek-V2/V3): per token and layer, the
    compressed latent (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the one RoPE
    key shared by all heads (``qk_rope_head_dim``) — not per-head keys and values.

    It stores them as a single-"head" key/value pair, (B, 1, T, kv_lora_rank) and
    (B, 1, T, qk_rope_head_dim), so ``nbytes`` is
    (kv_lora_rank + qk_rope_head_dim) × tokens × itemsize (× batch); models/layers/mla.py says
    how attention reads it.
    """


def cache_nbytes(cache: Sequence[LayerCache]) -> int:
    return sum(c.nbytes for c in cache)


def trim_cache(cache: Sequence[LayerCache], n: int) -> int:
    """Drop the last ``n`` tokens from every layer (speculative rewind, chat edits)."""
    return min((c.trim(n) for c in cache), default=0)


def is_trimmable(cache: Sequence[LayerCache]) -> bool:
    """Whether every layer can drop tokens; else (a state cache among them) going back
    takes a snapshot restored and the kept tokens fed again."""
    return all(c.is_trimmable() for c in cache)


def snapshot_cache(cache: Sequence[LayerCache]) -> list[Any]:
    return [c.snapshot() for c in cache]


def restore_cache(cache: Sequence[LayerCache], snapshot: list[Any]) -> None:
    for c, s in zip(cache, snapshot, strict=True):
        c.restore(s)
