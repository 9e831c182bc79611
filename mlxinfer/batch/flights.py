"""The scheduler's side of micro-batched decode across pipeline ranks (``distributed/micro.py``):
which decoding rows form the next flight, and what happens when a flight lands.

Each turn is one tick of the pipeline: the rows ready to decode (their last token sampled) form a
flight of about 1/S of the decoding rows, which enters rank 0's stage while the flights formed at
the previous S - 1 ticks move one stage on; the flight that leaves the last rank lands, and its
rows are sampled as a plain step's are. A row is *flying* from its flight's forming to its
landing: its prompt is not prefilled further, its cancellation waits for the landing (its blocks
stay its own while a rank has still to write their keys), and its full blocks are hashed at the
landing only (``KVPool.hash_full``). Rows that draft take the plain step beside the flights.
"""

from __future__ import annotations

import mlx.core as mx

from .requests import _Request


class FlyingRows:
    """Mixed into :class:`~.scheduler.Scheduler` (``micro``: the model's ``MicroPipeline``,
    or None where the engine does not micro-batch)."""

    def _decode_micro(self, rows: list[_Request]) -> list[_Request]:
        """One tick over the rows ready to decode; the rows left to the plain step (drafting
        rows; every ready row while fewer than one per rank decode and nothing flies)."""
        micro = self.micro
        plain = [r for r in rows if r.drafter is None]
        flying = sum(len(f.rows) for f in micro.flying())
        if not flying and len(plain) < micro.size:
            return rows
        take = plain[: -(-(len(plain) + flying) // micro.size)]  # about 1/S of the rows
        new = None
        if take:
            tokens = [[r.pending] for r in take]
            batch = self._batch(take, tokens, self.attention, hashed=False)
            new = micro.flight(take, mx.array(tokens, dtype=mx.int32), batch.views())
            for r in take:
                r.pending, r.flying = None, True
        landed = micro.tick(new)
        self.steps_run += 1
        if landed is not None:
            self._land(*landed)
        return [r for r in rows if r.drafter is not None]

    def _land(self, flight, logits: mx.array) -> None:
        """A flight's rows sampled from its logits (B, V), as a plain step's; a row cancelled
        while it flew retires now, sampling nothing."""
        live = []
        for b, r in enumerate(flight.rows):
            r.flying = False
            self.pool.hash_full(r.seq)  # every rank has written its keys now
            if r.wseq is not None:
                self.window_pool.hash_full(r.wseq)
            if r.dropped:
                self._retire(r)
            else:
                live.append(b)
        if live:
            rows = [flight.rows[b] for b in live]
            if len(live) < len(flight.rows):
                logits = logits[mx.array(live)]
            self._emit_rows(rows, logits)

    def _cancel(self, request: _Request) -> None:
        """Retire ``request`` (rank 0's cancellation), or at its flight's landing if it flies."""
        if request.flying:
            request.dropped = True
        else:
            self._retire(request)
