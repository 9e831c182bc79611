"""Micro-batched decode across pipeline ranks: every rank busy at every tick.

A plain pipeline step passes one batch through the ranks one after another: while rank 1 runs its
blocks, rank 0 waits for the next token. The batching engine can instead keep one *flight* (a
micro-batch of its decoding rows) at each stage: at a tick, rank r runs its blocks over the
flight at stage r, so with S ranks S flights advance at once. A flight formed at tick t is at
stage r at tick t + r; its logits reach every rank at the end of tick t + S - 1 (its *landing*),
when the engine samples its rows, which may then join the next flight. The engine's bookkeeping
for a flight is so one turn behind per stage (``batch/flights.py``).

What every rank agrees on by construction (the engine's state is the same on every rank): which
flight is at which stage, and each flight's rows, tokens and views of the pool (built once, at
its forming, on every rank: each rank writes its own layers' keys at its own tick, at the
positions fixed then). A tick on rank r, three evaluations under the watchdog:

1. its blocks over the flight at stage r (none: nothing to do), no collective;
2. the landing flight's logits: an exact all-sum from the last rank (every rank's sampler sees
   the same numbers, as in a plain step);
3. the activations one stage on: rank r receives the flight rank r - 1 just ran, then sends the
   one it ran to rank r + 1 (from rank 0 down the chain: no cycle, whatever the sockets buffer).

A flight's rows do not change while it flies: the engine cancels them only at the landing, and
their full blocks are hashed only then (``KVPool.hash_full``), once every rank wrote their keys,
so no prefix shares (and no disk tier saves) a block whose keys a later rank has yet to write.

This pays where a step's cost grows with its rows (many requests; a compute-bound step): S
flights of B/S rows each take about a stage's time for B/S rows per tick, against a plain step's
S stages of B rows one after another. Where a step costs its weights whatever the rows (few
rows, memory-bound), the two are even: each flight reads the rank's weights again.
"""

from __future__ import annotations

import mlx.core as mx


class Flight:
    """One micro-batch of decoding rows on its way through the ranks (``tokens``: (B, L), L > 1
    where rows verify drafts; the engine keeps what it needs at the landing beside them)."""

    def __init__(self, rows: list, tokens: mx.array, views: list) -> None:
        self.rows, self.tokens, self.views = rows, tokens, views
        self.incoming: mx.array | None = None  # this rank's input, from the rank before
        # The engine's, for the landing: the rows' drafts (None: no row drafts) and lengths.
        self.proposals: list | None = None
        self.starts: list[int] = []


class MicroPipeline:
    """The flights at each stage of one pipeline (``stages[r]``: rank r's at this tick)."""

    def __init__(self, model) -> None:  # a PipelineModel (pipeline.py)
        self.model, self.ranks = model, model.ranks
        self.stages: list[Flight | None] = [None] * model.ranks.size
        self.ticks = 0

    flight = Flight

    @property
    def size(self) -> int:
        return self.ranks.size

    def flying(self) -> list[Flight]:
        """The flights formed and not landed yet (each at stage 0..S-2 after a tick)."""
        return [f for f in self.stages[:-1] if f is not None]

    def tick(self, new: Flight | None) -> tuple[Flight, mx.array] | None:
        """Advance every flight one stage, ``new`` entering at stage 0; the flight that lands
        with its logits (B, L, V), the same on every rank, or None."""
        ranks, model = self.ranks, self.model
        r, last = ranks.rank, ranks.size - 1
        self.stages = [new, *self.stages[:-1]]
        self.ticks += 1
        ranks.steps += 1
        what = f"micro-batch tick {self.ticks}"
        if new is not None:
            model._check_tokens(new.tokens, what)
        mine, landing = self.stages[r], self.stages[last]
        out = None
        if mine is not None:
            out = self._run(mine, what)
        logits = None
        if landing is not None:
            shape = (*landing.tokens.shape, model.vocab_rows)
            logits = out if ranks.last else mx.zeros(shape, dtype=model.logits_dtype)
            logits = ranks.all_sum(logits.astype(model.logits_dtype))
            ranks.run(f"{what}: sharing logits", logits, peer=last)
        before = self.stages[r - 1] if r > 0 else None
        if before is not None:  # the flight rank r-1 ran: rank r's at the next tick
            shape = (*before.tokens.shape, model.activation_width)
            h = mx.distributed.recv(shape, model.activation_dtype, r - 1, group=ranks.group)
            ranks.run(f"{what}: receiving activations", h, peer=r - 1)
            before.incoming = h
        if mine is not None and r < last:
            sent = mx.distributed.send(out, r + 1, group=ranks.group)
            ranks.run(f"{what}: sending activations", sent, peer=r + 1)
        if mine is not None:
            mine.incoming = None
        return None if landing is None else (landing, logits)

    def _run(self, flight: Flight, what: str) -> mx.array:
        """This rank's blocks over ``flight``, evaluated with its keys' writes: the logits
        (B, L, V) on the last rank, else the activations for the next."""
        model, ranks = self.model, self.ranks
        if not ranks.first:
            model.entry.incoming = flight.incoming
        out = model.model(flight.tokens, flight.views)
        if not ranks.last:
            out = model.exit.outgoing.astype(model.activation_dtype)
            model.exit.outgoing = None
        states = [c.state for c in flight.views]
        ranks.run(f"{what}: its blocks", [out, *states], kind="computing")
        if not ranks.first:
            model.entry.incoming = None
        return out
