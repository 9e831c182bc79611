"""A recurrent layer's cache: a fixed-size state per sequence, not an entry per token.

It keeps the :class:`~mlxinfer.cache.kv.Cache` protocol's bookkeeping (``offset``,
``is_trimmable``/``trim``, ``snapshot``/``restore``, ``state``, ``nbytes``) and, in place of
``update_and_fetch`` and ``make_mask``, its ``arrays`` and ``update``. ``mlxinfer.cache.kv``
names it with the KV caches (the cache helpers), and ``prompt_cache``'s table of cache kinds
(prompt-cache files) lists it with them.
"""

from __future__ import annotations

from typing import Callable, cast

import mlx.core as mx

# i -> the state arrays after the (i+1)-th token of the last update (lazy: computed when asked)
Positions = Callable[[int], list[mx.array]]


class StateCache:
    """A recurrent layer's cache: ``size`` arrays of a fixed shape per sequence, replaced at
    every update, instead of one entry per token.

    LFM2's short convolution of width K keeps its last K - 1 inputs, one (B, K - 1, hidden)
    array: that is all the layer needs to continue, however long the context. So ``nbytes``
    is B × (K - 1) × hidden × itemsize from the first token on, and the cache cannot drop
    tokens (``is_trimmable`` is False, ``trim`` drops none): a caller that must go back
    takes a :meth:`snapshot` first and restores it, then feeds the tokens to keep
    again (``generation.speculative``, ``PromptCache.reuse``). Snapshots are cheap: the
    arrays are never written in place, so a snapshot is references to them.

    The layer reads ``arrays`` (None before the first token) and stores the new state with
    :meth:`update`; ``offset`` counts the tokens seen, as a KV cache's does.

    While ``recording`` (a speculative verification pass: ``generation.speculative``, the batch
    engine's verification) a layer that can also hands :meth:`update` the state after each
    token of the pass (``positions``, lazy), so that a rejected draft goes back with
    :meth:`rewind_within` instead of a restore and a second forward of the kept tokens.
    """

    quantized = False

    def __init__(self, size: int = 1) -> None:
        self.arrays: list[mx.array | None] = [None] * size
        self.offset = 0
        self.recording = False
        self._positions: Positions | None = None  # the last update's, while recording
        self._updated = 0  # tokens in the last update

    def update(
        self, arrays: list[mx.array], n_tokens: int, positions: Positions | None = None
    ) -> None:
        """Store the state after ``n_tokens`` more tokens (compact copies: a slice of a
        prefill chunk would keep the whole chunk alive); ``positions``: the state after each
        of them (kept only while ``recording``)."""
        if len(arrays) != len(self.arrays):
            raise ValueError(f"StateCache: expected {len(self.arrays)} arrays, found {len(arrays)}")
        self.arrays = [mx.contiguous(a) for a in arrays]
        self.offset += n_tokens
        self._positions = positions if self.recording else None
        self._updated = n_tokens

    def can_rewind_within(self, n: int) -> bool:
        """Whether :meth:`rewind_within` can go back to ``n`` tokens (within the last update,
        whose states by position were recorded)."""
        if n == self.offset:
            return True
        return self._positions is not None and self.offset - self._updated < n < self.offset

    def rewind_within(self, n: int) -> None:
        """Back to the state after ``n`` tokens, one of the last update's (``can_rewind_within``)."""
        if n == self.offset:
            return
        if not self.can_rewind_within(n):
            raise ValueError(f"StateCache: no recorded state at {n} (offset {self.offset})")
        assert self._positions is not None
        i = n - (self.offset - self._updated) - 1  # the (i+1)-th token of the update
        self.arrays = [mx.contiguous(a) for a in self._positions(i)]
        self.offset, self._positions, self._updated = n, None, 0

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def snapshot(self) -> tuple[int, list[mx.array | None]]:
        return self.offset, list(self.arrays)

    def restore(self, snapshot: tuple[int, list[mx.array | None]]) -> None:
        self.offset, arrays = snapshot
        self.arrays = list(arrays)
        self._positions, self._updated = None, 0

    @property
    def state(self) -> list[mx.array]:
        # All None before the first update, all arrays after it.
        return [] if self.arrays[0] is None else cast("list[mx.array]", list(self.arrays))

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.arrays = list(arrays)  # the offset comes with meta_state

    @property
    def meta_state(self) -> dict[str, str]:
        return {"size": str(len(self.arrays)), "offset": str(self.offset)}

    @meta_state.setter
    def meta_state(self, meta: dict[str, str]) -> None:
        self.arrays = [None] * int(meta["size"])
        self.offset = int(meta["offset"])

    @property
    def nbytes(self) -> int:
        """Bytes of the state arrays: fixed once the first token is in."""
        return sum(a.nbytes for a in self.arrays if a is not None)
