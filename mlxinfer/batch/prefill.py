"""The scheduler's prefill: a turn's prompt chunks, in forwards (``scheduler.py``).

Each turn :meth:`Prefill.turn` feeds at most ``prefill_step`` prompt tokens: chunks of the
admitted requests whose prompt (but its last token) is not in yet, in order. Short chunks share
a forward, each row padded to the longest with its last token and the padding's keys rewound
after. A request with images runs its vision tower first (a unit of the turn's budget) and
prefills alone, on its embeddings; a model with recurrent layers cuts its chunks where a
snapshot of the states is wanted (``snapshots.py``); an MTP row's chunk primes its head with
the trunk's final hidden states. When a row's whole prompt but its last token is in, that token
becomes its first decode row (``pending``).
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..backends import prefill_schedule
from ..errors import MlxInferError
from ..models.layers.rope import prompt_reach
from . import rows as rows_mod
from . import snapshots as snap
from .recurrent import state_arrays
from .requests import _Request


class Prefill:
    """The prefill of :class:`~.scheduler.Scheduler`'s rows. ``scheduler``: whose model,
    pools, recurrent states, snapshots, regime, budgets, encoder cache, verification and
    counters it uses (all made before it)."""

    def __init__(self, scheduler) -> None:
        self.s = scheduler

    def turn(self, running: list[_Request]) -> list[tuple[_Request, Exception]]:
        """At most ``prefill_step`` prompt tokens of ``running``'s rows, in forwards
        (``_groups``); returns the requests whose images failed to encode, with their errors
        (the scheduler's to retire: the request's fault, not the engine's)."""
        s = self.s
        budget, visited, chunks, failed = s.prefill_step, [], [], []
        for request in running:
            if budget <= 0:
                break
            if request.pending is not None or request.flying:
                continue
            visited.append(request)
            left = len(request.ids) - 1 - request.seq.length
            images = request.images
            # The tower, once per request: a unit of this turn's budget (its image tokens'
            # worth), the row's first chunk at the next turn. A row whose whole prompt is
            # shared needs it only for its M-RoPE delta (Qwen-VL: a forward that takes
            # positions).
            if images is not None and not images.encoded and (left > 0 or s.takes_positions):
                try:
                    images.encode(s.model, request.ids, s.encoder_cache)
                except (ValueError, MlxInferError) as e:  # this request's, not the engine's
                    failed.append((request, e))
                    visited.pop()
                    continue
                budget -= sum(images.images.processed.tokens_per_image)
                continue
            if left > 0:
                start = request.seq.length
                end = start + min(left, budget)
                if s.snapshots is not None:  # a chunk ends where a snapshot is wanted
                    end = snap.chunk_end(start, end, *s.recurrent.points(request))
                if images is not None:  # a chunk never cuts an image in two
                    end = request.images.chunk_end(end)
                chunks.append((request, request.ids[start:end]))
                budget -= len(chunks[-1][1])
        for group in self._groups(chunks):
            self._rows(group)
        for request in visited:
            if request.draft_model is not None:  # its draft model reads what the pool holds
                s.verification.feed_draft(request)
            if request.seq.length == len(request.ids) - 1:
                request.pending = request.ids[-1]
                if request.images is not None:
                    request.images.done()
        return failed

    def _groups(self, chunks: list[tuple[_Request, list[int]]]) -> list[list]:
        """The turn's chunks, in forwards: consecutive chunks together while their rows, each
        padded to the longest, make no more than ``prefill_step`` tokens and each row's padding
        stays within the room it reserved (the padding is rewound after). A model with recurrent
        layers (a state would read the padding) or with frequencies that follow the length
        (one prompt's reach per forward) prefills one chunk a forward, and so does a quantized
        pool (several rows' quantized attention there was 4e-4 off the single loop's log-probs)."""
        s = self.s
        recurrent = s.recurrent is not None
        if recurrent or s.regime is not None or s.pool.layers[0].bits is not None:
            return [[c] for c in chunks]
        groups: list[list] = []
        for request, chunk in chunks:
            if request.images is not None:  # its embeddings: a forward of its own
                groups.append([(request, chunk)])
                continue
            if groups and groups[-1][0][0].images is None:
                group = groups[-1] + [(request, chunk)]
                L = max(len(c) for _, c in group)
                if len(group) * L <= s.prefill_step and all(
                    r.seq.length + L <= self._room_end(r) for r, _ in group
                ):
                    groups[-1] = group
                    continue
            groups.append([(request, chunk)])
        return groups

    def _room_end(self, request: _Request) -> int:
        """The positions ``request``'s reserved blocks reach (its prompt, ``max_tokens`` and
        ``max_draft``, in whole blocks)."""
        room = len(request.ids) + request.max_tokens + self.s.max_draft
        return self.s.pool.blocks_for(room) * self.s.pool.block_size

    def _rows(self, group: list[tuple[_Request, list[int]]]) -> None:
        """One prefill forward over the group's chunks, each row padded to the longest with its
        last token; the padding's keys are rewound."""
        s, t0 = self.s, time.perf_counter()
        rows = [r for r, _ in group]
        L = max(len(c) for _, c in group)
        padded = [c + c[-1:] * (L - len(c)) for _, c in group]
        ends = [r.seq.length + len(c) for r, c in group]
        images = rows[0].images  # a row with images prefills alone, on its embeddings
        extra: dict[str, mx.array] = {}
        blocks = None
        if images is not None:
            start = rows[0].seq.length
            extra, runs = images.chunk(start, start + L)
            blocks = None if runs is None else [runs]
        batch = s.pools.batch(rows, padded, blocks=blocks)
        # Every chunk rotates as the whole prompt would (dynamic NTK, LongRoPE: one row then).
        x = mx.array(padded, dtype=mx.int32)
        heads = [(b, r, c) for b, (r, c) in enumerate(group) if rows_mod.observer(r) is not None]
        with prefill_schedule(s.model), prompt_reach(len(rows[0].ids)):
            written: list = []
            if heads:  # MTP rows: the chunk's final hidden states prime their heads
                hidden, _ = s.model.trunk(x, batch.views())
                for b, r, c in heads:
                    start = ends[b] - len(c)
                    following = r.ids[start + 1 : start + 1 + len(c)]
                    written += r.drafter.observe(hidden[b, : len(c)], following)
            else:
                s.model(x, batch.views(), **extra)
            mx.eval(s.pools.stores(), [state_arrays(r) for r in rows], written)
        for r, end in zip(rows, ends):
            s.pools.rewind(r, end)
            if s.snapshots is not None:
                s.recurrent.snapshot(r)
        s.counters.prefill_s += time.perf_counter() - t0
        s.counters.prefill_tokens += sum(len(c) for _, c in group)
        s.counters.prefill_steps += 1
