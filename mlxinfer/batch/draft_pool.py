"""A draft model's caches for every request that drafts with it: a paged pool of its own.

Each drafting request keeps its draft keys as a sequence of this pool (prefix blocks shared,
as in the target's pool), so a step's draft tokens come from one forward of all its rows per
draft position: k forwards of B rows instead of B × k forwards of one. A step proposes for each
row

1. from what the row's draft sequence lacks of its history (at least the token the target
   feeds next; two after a step that kept every draft), the rows padded to the longest and
   the padding rewound, then
2. one token a forward, each row fed the draft it drew last, until it has its own k.

Every row draws through its own sampler (its processors, its key: ``rows``), so a seeded
request proposes what the single loop's draft model proposes. After verification the draft
sequence keeps the longest prefix of what the target kept.

The pool holds as many blocks as the target's (each in the draft model's bytes; for a model named
at ``Engine(draft_models=...)`` both inside ``kv_budget``), and a request reserves its worst case
in both at admission. A draft model whose caches this pool cannot hold
(recurrent layers, frequencies that follow the length) drafts with a cache per request
(``DraftModel.drafter``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..generation.drafts import _fit_width
from ..models.layers.rope import prompt_reach
from .layout import STATE, UnbatchableError, check_batchable, layer_shapes
from .pool import KVPool
from .requests import _Request
from .store import block_bytes
from .views import StepBatch


def poolable(model) -> bool:
    """Whether ``model``'s caches fit a :class:`DraftPool` (rows decoding together)."""
    try:
        regime, windows = check_batchable(model)
    except UnbatchableError:
        return False
    return regime is None and STATE not in windows


class DraftPool:
    """The caches of one draft model, for every request of an engine that drafts with it."""

    def __init__(self, model, target_model, blocks: int, block_size: int) -> None:
        self.model, self.width = model, target_model.args.vocab_size
        self.windows = check_batchable(model)[1]
        shapes = layer_shapes(model)
        budget = blocks * block_bytes(shapes, block_size)
        self.pool = KVPool(shapes, block_size=block_size, kv_budget=budget)

    def admit(self, request: _Request, room: int) -> bool:
        """Give ``request`` a draft sequence with ``room`` tokens after its prompt (its prefix
        blocks shared); False if the pool has no room now."""
        seq = self.pool.admit(request.ids, room)
        if seq is None:
            return False
        request.draft_seq = seq
        return True

    def release(self, request: _Request) -> None:
        if request.draft_seq is not None:
            self.pool.release(request.draft_seq)
            request.draft_seq = None

    def feed(self, request: _Request, upto: int) -> None:
        """Read the request's prompt into its draft sequence up to ``upto`` tokens (what the
        target's pool holds of it), as the target reads it: chunks rotated as the whole prompt."""
        seq = request.draft_seq
        chunk = request.ids[seq.length : upto]
        if not chunk:
            return
        batch = StepBatch(self.pool, [seq], [chunk], self.windows)
        with prompt_reach(len(request.ids)):
            self.model(mx.array([chunk], dtype=mx.int32), batch.views())
        mx.eval(self.pool.keys, self.pool.values)

    def propose(
        self,
        rows: list[_Request],
        ks: list[int],
        samplers: list[Callable[[mx.array], tuple[mx.array, mx.array | None]]],
    ) -> list[tuple[mx.array, mx.array | None]]:
        """Row b's ``ks[b]`` drafts (m,) and the (m, V) log-probs they were drawn from (None
        for a greedy row), each drawn by ``samplers[b]`` from the draft's logits after the
        row's history (``request.tokens``) and its drafts before it."""
        seqs = [r.draft_seq for r in rows]
        fed = [r.tokens[s.length :] for r, s in zip(rows, seqs)]
        drawn: list[list[mx.array]] = [[] for _ in rows]
        dists: list[list[mx.array | None]] = [[] for _ in rows]
        active = list(range(len(rows)))
        for j in range(max(ks)):
            active = [b for b in active if ks[b] > j]
            if j == 0:
                tokens = [fed[b] for b in active]
            else:
                tokens = [[int(drawn[b][-1].item())] for b in active]
            L = max(len(t) for t in tokens)
            padded = [t + t[-1:] * (L - len(t)) for t in tokens]
            starts = [seqs[b].length for b in active]
            batch = StepBatch(self.pool, [seqs[b] for b in active], padded, self.windows, "pages")
            logits = self.model(mx.array(padded, dtype=mx.int32), batch.views())  # (n, L, V)
            for i, (b, t) in enumerate(zip(active, tokens)):
                last = logits[i, len(t) - 1 : len(t)]  # (1, V): after its last real token
                token, dist = samplers[b](_fit_width(last, self.width))
                drawn[b].append(token)
                dists[b].append(dist)
            mx.eval([drawn[b][-1] for b in active], self.pool.keys, self.pool.values)
            for start, b, t in zip(starts, active, tokens):
                if len(t) < L:  # its padding's keys go
                    self.pool.rewind(seqs[b], start + len(t))
        return [
            (mx.concatenate(d), mx.concatenate(q) if q[0] is not None else None)
            for d, q in zip(drawn, dists)
        ]

    def rewind(self, request: _Request, kept: list[int]) -> None:
        """The target's pool now holds ``kept`` for ``request``: its draft sequence keeps the
        longest prefix of it that it holds (the drafts the target rejected go)."""
        seq = request.draft_seq
        n = 0
        for a, b in zip(seq.tokens, kept):
            if a != b:
                break
            n += 1
        self.pool.rewind(seq, n)

    @property
    def bytes_in_use(self) -> int:
        return self.pool.stats().bytes_in_use
