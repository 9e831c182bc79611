"""The scheduler's side of rows with recurrent layers (LFM2, Qwen3-Next, Qwen3.5): where their
states are snapshotted, how a request resumes from a snapshot, and how a drafting row's states go
back after a verification step. The snapshot store and its arithmetic are ``snapshots.py``'s.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.kv import StateCache
from . import snapshots as snap
from .pools import Pools
from .requests import _Request


def state_arrays(request: _Request) -> list[mx.array]:
    """The request's recurrent states, to evaluate with the step that wrote them."""
    return [a for c in request.states for a in c.arrays if a is not None]


class RecurrentRows:
    """The recurrent side of the rows of ``model``'s engine (its ``recurrent`` member, None for a
    model without recurrent layers): ``snapshots`` (None: no prefix sharing) taken every
    ``state_every`` blocks of prefill; ``turns``: the engine's (across ranks, which snapshots
    every rank holds)."""

    def __init__(self, model, pools: Pools, snapshots, state_every: int, turns) -> None:
        self.model, self.pools, self.snapshots = model, pools, snapshots
        self.state_every, self.turns = state_every, turns
        self.block_size = pools.pool.block_size

    def resume_point(self, request: _Request, full: int) -> int:
        """Of the ``full`` leading blocks the pools share with ``request``, how many it can
        resume after (the deepest with a snapshot); the end of the rest is its branch point."""
        bs = self.block_size
        # The deepest snapshot kept (across ranks, that every rank holds: batching.py).
        chain = snap.chain(request.ids, bs, full, request.salts)
        hits = self.turns.resume_point(self.snapshots, chain)
        # The shared blocks past the snapshot: their end gets one for the next request.
        request.branch = full * bs if full > hits else 0
        return hits

    def start_states(self, request: _Request) -> None:
        """Fresh states for an admitted request, or a copy of the snapshot after the blocks it
        shares."""
        request.states = [c for c in self.model.make_cache() if isinstance(c, StateCache)]
        if request.seq.length:
            arrays = self.snapshots.get(request.seq.hashes[-1])
            snap.restore(request.states, arrays, request.seq.length)

    def snapshot(self, r: _Request) -> None:
        """Keep ``r``'s states if its prefill stopped where a snapshot is wanted (a block
        boundary: every ``state_every``-th, the prompt's last full one, or its branch point),
        under the chain hash of the block ending there."""
        wanted = snap.wanted(r.seq.length, *self.points(r))
        arrays = snap.capture(r.states) if wanted else None
        if arrays is not None:
            self.snapshots.put(r.seq.hashes[-1], arrays)

    def points(self, r: _Request) -> tuple[int, int, int, int]:
        """Where ``r``'s snapshots go (``snapshots.chunk_end``'s and ``wanted``'s arguments)."""
        return self.block_size, self.state_every, r.branch, len(r.ids)

    def record(self, rows: list[_Request], on: bool) -> None:
        """The rows' state caches keep (or stop keeping) the next step's states by position."""
        for r in rows:
            for c in r.states:
                c.recording = on

    def mark_block(self, r: _Request) -> None:
        """A recurrent row that ends a full block of its output: its states there (references: a
        state is never written in place), kept when it retires, for the turn that extends it."""
        if self.snapshots is not None and r.seq.length % self.block_size == 0:
            r.last_block = (r.seq.hashes[-1], snap.capture(r.states))

    def refeed_states(self, rows, drafts, saved, starts, kept, L: int) -> None:
        """After a verification step of a recurrent model: a row that kept fewer than the ``L``
        tokens it fed (rejected drafts, padding) takes its states at the last token kept, which
        the step recorded (``StateCache.recording``: no other forward); where a layer could
        not, it gets its states back from before the step and the kept tokens fed again, the
        rows keeping as many in one forward (its keys, rewritten the same, stay)."""
        groups: dict[int, list[int]] = {}
        for b, a in enumerate(kept):
            if 1 + a < L:
                n = starts[b] + 1 + a
                if all(c.can_rewind_within(n) for c in rows[b].states):
                    for c in rows[b].states:  # the step kept its states by position
                        c.rewind_within(n)
                    continue
                groups.setdefault(1 + a, []).append(b)
        for group in groups.values():
            rs = [rows[b] for b in group]
            tokens = [[rows[b].pending] + drafts[b][: kept[b]] for b in group]
            for b in group:
                self.pools.rewind(rows[b], starts[b])
                for c, snapshot in zip(rows[b].states, saved[b]):
                    c.restore(snapshot)
            self.model(mx.array(tokens, dtype=mx.int32), self.pools.batch(rs, tokens).views())
            mx.eval(self.pools.stores(), [state_arrays(r) for r in rs])
