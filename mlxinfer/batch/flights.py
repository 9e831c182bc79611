"""The scheduler's side of micro-batched decode across pipeline ranks (``distributed/micro.py``):
which decoding rows form the next flight, and what happens when a flight lands.

Each turn is one tick of the pipeline: the rows ready to decode (their last token sampled) form a
flight of about 1/S of the decoding rows, which enters rank 0's stage while the flights formed at
the previous S - 1 turns move one stage on; the flight that leaves the last rank lands, and its
rows are sampled as a plain step's are. A flight with drafting rows (prompt lookup, a draft
model) verifies their drafts: their proposals are made at its forming (a draft model's forwards,
rank 0's drafts shared), their acceptance and the rewind of the rejected drafts at its landing.
A row is *flying* from its flight's forming to its landing: its prompt is not prefilled further,
its cancellation waits for the landing (its blocks stay its own while a rank has still to write
their keys), and its full blocks are hashed at the landing only (``KVPool.hash_full``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from .metrics import Counters
from .pools import Pools
from .requests import _Request
from .verification import Verification


class Flights:
    """The flights of an engine's rows (its ``flights`` member): ``micro``, the model's
    ``MicroPipeline``, or None where the engine does not micro-batch; over ``pools``, read with
    ``attention``; a flight with drafting rows verified by ``verification``; a landed flight's
    plain rows sampled by ``emit`` (the scheduler's), a row dropped in flight handed to
    ``retire``."""

    def __init__(
        self,
        micro,
        pools: Pools,
        verification: Verification,
        counters: Counters,
        *,
        attention: str,
        emit: Callable[[list[_Request], mx.array], None],
        retire: Callable[[_Request], None],
    ) -> None:
        self.micro, self.pools, self.verification = micro, pools, verification
        self.counters, self.attention, self.emit, self.retire = counters, attention, emit, retire

    def decode(self, rows: list[_Request]) -> list[_Request]:
        """One tick over the rows ready to decode; the rows left to the plain step (every
        ready row while fewer than one per rank decode and nothing flies; else none)."""
        micro = self.micro
        flying = sum(len(f.rows) for f in micro.flying())
        if not flying and len(rows) < micro.size:
            return rows
        take = rows[: -(-(len(rows) + flying) // micro.size)]  # about 1/S of the rows
        new = None
        if take:
            new = self.form(take)
        landed = micro.tick(new)
        self.counters.steps_run += 1
        if landed is not None:
            self.land(*landed)
        return []

    def form(self, rows: list[_Request]):
        """A flight of ``rows``: their tokens (and drafts, if any row drafts) fed, their views
        of the pools made now, at the positions they have now."""
        proposals = None
        if any(r.drafter is not None for r in rows):
            proposals, tokens = self.verification.drafts_for(rows)
        else:
            tokens = [[r.pending] for r in rows]
        starts = [r.seq.length for r in rows]
        batch = self.pools.batch(rows, tokens, self.attention, hashed=False)
        flight = self.micro.flight(rows, mx.array(tokens, dtype=mx.int32), batch.views())
        flight.proposals, flight.starts = proposals, starts
        for r in rows:
            r.pending, r.flying = None, True
        return flight

    def land(self, flight, logits: mx.array) -> None:
        """A flight's rows sampled from its logits (B, L, V), as a plain or a verification
        step's; a row cancelled while it flew retires now, sampling nothing."""
        live = []
        for b, r in enumerate(flight.rows):
            r.flying = False
            if r.dropped:
                self.pools.rewind(r, flight.starts[b])  # what it fed in flight is not its own
                self.pools.hash_full(r)
                self.retire(r)
            else:
                live.append(b)
        if not live:
            return
        rows = [flight.rows[b] for b in live]
        if len(live) < len(flight.rows):
            logits = logits[mx.array(live)]
        if flight.proposals is not None:
            proposals = [flight.proposals[b] for b in live]
            starts = [flight.starts[b] for b in live]
            self.verification.verified(rows, logits, proposals, starts, None, flown=True)
            return
        for r in rows:
            self.pools.hash_full(r)  # every rank has written its keys now
        self.emit(rows, logits[:, -1, :])
