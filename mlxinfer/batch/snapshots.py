"""Recurrent states at block boundaries: how a model with recurrent layers shares prefixes.

A recurrent layer (LFM2's convolutions, Qwen3-Next's and Qwen3.5's Gated DeltaNet) keeps a
fixed-size state per sequence, not keys per token, so the pool's shared blocks alone cannot
resume a request: its states must be those after the shared prefix. The scheduler takes a
*snapshot* of a row's states when its prefill reaches a block boundary, keyed by the chain hash
of the full block ending there (``pool.block_hash``: the name the pool gives that block), and a
new request resumes from the deepest prefix whose blocks the pool still holds *and* whose
snapshot is here: the snapshot is restored into its states (a copy) and only the rest is fed.

Where snapshots are taken (``points``): at every ``every``-th block boundary (by default the
prefill chunk's length, so the chunks are unchanged), at the prompt's last full block (its
chunk is split there: one more forward per prompt, for the turn that extends this prompt), at
the end of the shared blocks a request found but could not resume from (the branch point: the
next request diverging there resumes from it), and, when a request retires, at the last block
its decoding filled (for the next turn: this prompt, the reply, a new message).

The store (:class:`Snapshots`) is an LRU of at most ``max_bytes``: the engine gives it a part
of ``kv_budget`` (``state_budget``, a quarter by default) and the pool the rest, so the two
never hold more than the budget. A snapshot whose blocks the pool no longer holds (``alive``)
is evicted before others (among the oldest 64); one larger than the whole store is not kept.

Its interface is small, for a tier that would keep snapshots elsewhere (on disk):
``get(chain_hash) -> list[mx.array] | None`` (copies), ``put(chain_hash, arrays)`` (copied in),
``chain_hash in snapshots`` (a tier elsewhere reads it back), ``held(chain_hash)`` (where, read
nothing: across ranks the ranks agree on the deepest snapshot every rank holds).

Across ranks (``distributed/batching.py``) each rank's store holds its own layers' states, so
its budget is a number of snapshots, the fewest any rank's bytes buy (``max_count``, agreed at
engine start): the stores keep and evict the same snapshots. A pipeline rank without a
recurrent layer keeps none and resumes anywhere (:class:`Stateless`). A snapshot is the flat list of every recurrent layer's arrays, in
layer order (``capture``), each ``(1, ...)``, in the dtype the layer keeps: the recurrent state
in float32, as the layer computes it, the convolution's last inputs in the model's dtype.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Callable

import mlx.core as mx

from .pool import chain_hashes

DEFAULT_STATE_SHARE = 4  # a recurrent model's snapshots get kv_budget // 4 unless told
MEMORY, ELSEWHERE = 2, 1  # ``Snapshots.held``: in memory, or read back from elsewhere (disk)
_DEAD_SCAN = 64  # the oldest snapshots looked at for dead ones before evicting (bounded work)


class Snapshots:
    """Recurrent states by the chain hash of the block they end, least recently used first
    out, at most ``max_bytes`` in all. ``alive(chain_hash)``: whether the pool still holds
    that block (a snapshot without it cannot serve; such snapshots go first)."""

    def __init__(
        self,
        max_bytes: int,
        alive: Callable[[bytes], bool] = lambda h: True,
        max_count: int | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"state_budget must be >= 0, got {max_bytes}")
        self.max_bytes, self.alive, self.max_count = max_bytes, alive, max_count
        self._items: OrderedDict[bytes, list[mx.array]] = OrderedDict()
        self.nbytes = 0
        self.puts = self.hits = self.evictions = 0

    def __contains__(self, chain_hash: bytes) -> bool:
        return chain_hash in self._items

    def __len__(self) -> int:
        return len(self._items)

    def held(self, chain_hash: bytes) -> int:
        """Where the snapshot of ``chain_hash`` is, read nothing: ``MEMORY``, ``ELSEWHERE``
        (``in`` reads it back) or 0."""
        return MEMORY if chain_hash in self._items else 0

    def get(self, chain_hash: bytes) -> list[mx.array] | None:
        """Copies of the arrays kept for ``chain_hash`` (now the most recently used), or None."""
        arrays = self._items.get(chain_hash)
        if arrays is None:
            return None
        self._items.move_to_end(chain_hash)
        self.hits += 1
        return [mx.array(a) for a in arrays]

    def put(self, chain_hash: bytes, arrays: list[mx.array]) -> bool:
        """Keep copies of ``arrays`` for ``chain_hash`` (evicting as needed); False if they
        cannot fit at all. One already kept is only marked as recently used."""
        if chain_hash in self._items:
            self._items.move_to_end(chain_hash)
            return True
        size = sum(a.nbytes for a in arrays)
        if size > self.max_bytes or self.max_count == 0:
            return False
        if self._full(size):  # the oldest whose blocks are gone go first
            for h in [h for h in islice(self._items, _DEAD_SCAN) if not self.alive(h)]:
                self._drop(h)
        while self._full(size):
            self._drop(next(iter(self._items)))
        copies = [mx.array(a) for a in arrays]
        mx.eval(copies)
        self._items[chain_hash] = copies
        self.nbytes += size
        self.puts += 1
        return True

    def _full(self, size: int) -> bool:
        """Whether one more snapshot of ``size`` bytes needs room."""
        count = self.max_count is not None and len(self._items) >= self.max_count
        return count or self.nbytes + size > self.max_bytes

    def _drop(self, chain_hash: bytes) -> None:
        arrays = self._items.pop(chain_hash)
        self.nbytes -= sum(a.nbytes for a in arrays)
        self.evictions += 1


class Stateless(Snapshots):
    """The store of a pipeline rank without a recurrent layer, across ranks: it has no state
    to keep, so it resumes wherever the pool's blocks go (the others' snapshots decide)."""

    def __contains__(self, chain_hash: bytes) -> bool:
        return True

    def held(self, chain_hash: bytes) -> int:
        return MEMORY

    def get(self, chain_hash: bytes) -> list[mx.array]:
        return []

    def put(self, chain_hash: bytes, arrays: list[mx.array]) -> bool:
        return True


def make_store(state_bytes: int, template: list[mx.array], alive, turns=None) -> Snapshots:
    """The snapshot store of ``state_bytes`` for states like ``template`` (one row's arrays).
    Across ranks (``turns``), as many snapshots as the fewest any rank's bytes buy."""
    size = sum(a.nbytes for a in template)
    count = None
    if turns is not None:  # every rank asks, a rank without states too
        count = turns.fewest_snapshots(state_bytes // size if size else None)
        if not template:
            return Stateless(state_bytes, alive)
    return Snapshots(state_bytes, alive, count)


def chain(
    ids: list[int], block_size: int, n: int, salts: dict[int, bytes] | None = None
) -> list[bytes]:
    """The chain hashes of the first ``n`` full blocks of ``ids`` (the pool's names for them;
    ``salts``: the images of its blocks, ``images.py``)."""
    return chain_hashes(ids, block_size, n, salts)


def resume_point(snapshots: Snapshots, ids: list[int], block_size: int, full: int) -> int:
    """The most blocks of ``ids`` (of the ``full`` leading ones the pools hold) after which a
    snapshot is kept: where a request can resume (0: from the start)."""
    hashes = chain(ids, block_size, full)
    return next((n for n in range(full, 0, -1) if hashes[n - 1] in snapshots), 0)


def capture(states: list) -> list[mx.array] | None:
    """A row's states (its ``StateCache`` per recurrent layer) as one flat list, or None
    before every layer has read a token."""
    arrays = [a for c in states for a in c.arrays]
    return None if any(a is None for a in arrays) else arrays


def restore(states: list, arrays: list[mx.array], offset: int) -> None:
    """Put a snapshot (``capture``'s order) into a row's fresh states, at ``offset`` tokens."""
    i = 0
    for c in states:
        k = len(c.arrays)
        c.arrays, c.offset = list(arrays[i : i + k]), offset
        i += k
    if i != len(arrays):
        raise ValueError(f"snapshot: {len(arrays)} arrays for states holding {i}")


def chunk_end(start: int, end: int, block_size: int, every: int, branch: int, n_ids: int) -> int:
    """Where a recurrent row's prefill chunk from ``start`` (up to ``end``) stops: at the first
    point after ``start`` where a snapshot is wanted, if that comes first. The points: every
    ``every``-th block boundary, the end of the prompt's last full block (of the ``n_ids - 1``
    tokens prefill feeds) and ``branch`` (the end of shared blocks not resumed from; 0: none)."""
    period = every * block_size
    points = [(start // period + 1) * period, (n_ids - 1) // block_size * block_size, branch]
    return min([end] + [p for p in points if start < p < end])


def wanted(length: int, block_size: int, every: int, branch: int, n_ids: int) -> bool:
    """Whether a row whose prefill stopped at ``length`` is at a point ``chunk_end`` aims for."""
    if length == 0 or length % block_size:
        return False
    last = (n_ids - 1) // block_size * block_size
    return length % (every * block_size) == 0 or length in (branch, last)


def split_budget(kv_budget: int, state_budget: int | None) -> tuple[int, int]:
    """(the pool's part, the snapshots' part) of ``kv_budget`` for a recurrent model: the
    snapshots get ``state_budget`` (default a quarter), the pool what is left."""
    share = kv_budget // DEFAULT_STATE_SHARE if state_budget is None else state_budget
    if not 0 <= share <= kv_budget:
        raise ValueError(f"state_budget must be in 0..kv_budget ({kv_budget}), got {share}")
    return kv_budget - share, share
