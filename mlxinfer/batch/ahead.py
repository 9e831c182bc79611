"""A plain decode step built while the one before it evaluates.

A decode step is a forward the device evaluates and a few milliseconds of Python around it:
building the next forward's graph (the model's modules, the pools' slots and block tables),
sampling, handing tokens to the consumers, retiring. Done in turn, the device idles while
Python works (on the CPU backend a 135M model's 8-row step was 20.1 ms of evaluation and
2.5 ms of Python). Here the scheduler builds step n + 1 from step n's sampled tokens *as
device arrays*, queues it (``mx.async_eval``), and only then waits for step n's tokens on the
host and hands them out, so that Python's work on step n overlaps the device's on step n + 1,
as ``generate`` overlaps its own.

A row's token from step n is fed to step n + 1 before anyone has read it, so the pool records
a placeholder for it (``PLACEHOLDER``) and its blocks are hashed only once it is known
(``KVPool.hash_full``). A row whose step n token ends it (EOS) was fed one step too many: that
token is taken back out of the pools (``Pools.rewind``) as it retires, and its step n + 1
output is never read. A row at ``max_tokens`` is not fed again. A row cancelled while it flies
retires at its landing (``flying``/``dropped``, as the pipeline ranks' flights).

Only plain rows go ahead: no drafting, no logits processors (structured output reads each
token on the host before the next step's mask), no per-row positions, in one process, on a
model without recurrent layers or length regimes. A step with any other row lands what flies
and runs as before. Tokens are the same either way: the same forward, the same per-row
sampling and keys, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..generation.results import Step
from .metrics import Counters
from .pools import Pools
from .requests import _Request
from .rows import sample_rows

PLACEHOLDER = -1  # a fed token not read yet, in a sequence's record
ON = True  # off: every step in turn (benchmarks compare the two; read when an engine is made)


@dataclass
class _Queued:
    rows: list[_Request]
    picked: mx.array  # (B,) int32, lazy until it lands
    logprobs: list[mx.array]
    # id(row) -> (the position of its placeholder, its index) for the rows fed a token not read
    fed_at: dict[int, tuple[int, int]] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)  # indices of rows retired before it landed


class Ahead:
    """The scheduler's step queued ahead (its ``ahead`` member): ``model`` over ``pools`` read
    with ``attention``; ``retire`` the scheduler's."""

    def __init__(
        self,
        model,
        pools: Pools,
        counters: Counters,
        *,
        attention: str,
        retire: Callable[[_Request], None],
    ) -> None:
        self.model, self.pools, self.counters = model, pools, counters
        self.attention, self.retire = attention, retire
        self.queued: _Queued | None = None

    def decode(self, running: list[_Request]) -> list[_Request]:
        """This turn's decode step: queued ahead where every row is plain (the rows left to
        the plain step: none), else what flies lands first and every ready row is left to it."""
        before = self.queued
        ready = [r for r in running if r.pending is not None]
        go_on = []
        if before is not None:  # its rows not retired, cancelled, nor at max_tokens with it
            go_on = [
                r
                for b, r in enumerate(before.rows)
                if b not in before.gone and not r.dropped and r.generated + 1 < r.max_tokens
            ]
        rows = go_on + ready
        if rows and all(_plain(r) for r in rows):
            queued = self.queued = self._queue(go_on, ready, before)
            if before is not None:
                self._land(before, queued)
            if len(queued.gone) == len(queued.rows):  # every row it fed has ended
                # Wait for it rather than leave it running: a process that exits while MLX
                # runs a step can hang in OpenBLAS's shutdown (docs/blas.md).
                mx.eval(queued.picked)
                self.queued = None
            return []
        self.land()
        return [r for r in running if r.pending is not None]

    def land(self) -> None:
        """Hand out what flies (before a step that cannot go ahead, or at close)."""
        if self.queued is not None:
            queued, self.queued = self.queued, None
            self._land(queued, None)

    def _queue(self, go_on: list[_Request], ready: list[_Request], before) -> _Queued:
        rows = go_on + ready
        parts = []
        if go_on:
            at = {id(r): b for b, r in enumerate(before.rows)}
            index = [at[id(r)] for r in go_on]
            whole = index == list(range(len(before.rows)))
            parts.append(before.picked if whole else before.picked[mx.array(index)])
        if ready:
            parts.append(mx.array([r.pending for r in ready], dtype=mx.int32))
        fed = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        host = [[PLACEHOLDER]] * len(go_on) + [[r.pending] for r in ready]
        batch = self.pools.batch(rows, host, self.attention, hashed=False)
        fed_at = {id(r): (r.seq.length - 1, b) for b, r in enumerate(go_on)}
        for r in rows:
            r.pending, r.flying = None, True
        logits = self.model(fed[:, None], batch.views())[:, -1, :]
        picked, logprobs = sample_rows(rows, logits)
        mx.async_eval(picked, logprobs, self.pools.stores())
        self.counters.steps_run += 1
        return _Queued(rows, picked, logprobs, fed_at)

    def _land(self, queued: _Queued, after: _Queued | None) -> None:
        """``queued``'s tokens to its rows' consumers; ``after``: the step queued since, which
        fed some of them (their placeholders filled here, or, where the token ends the row,
        taken back out)."""
        tokens = queued.picked.tolist()
        mx.eval(queued.logprobs)
        fed_at = after.fed_at if after is not None else {}
        for b, (r, t, lp) in enumerate(zip(queued.rows, tokens, queued.logprobs)):
            if b in queued.gone:
                continue
            fed = fed_at.get(id(r))
            ends = r.dropped
            if not r.dropped:
                self.counters.decode_tokens += 1
                r.generated += 1
                r.out.put(Step(t, lp))
                ends = t in r.eos or r.generated >= r.max_tokens
            if fed is not None:
                at, index = fed
                if ends:  # fed one step too many
                    self.pools.rewind(r, at)
                    after.gone.add(index)  # type: ignore[union-attr]
                else:
                    r.seq.tokens[at] = t
                    if r.wseq is not None:
                        r.wseq.tokens[at] = t
            self.pools.hash_full(r)
            if fed is not None and not ends:
                continue  # it flies on, in ``after``
            r.flying = False
            if ends:
                self.retire(r)
            else:
                r.pending = t


def _plain(r: _Request) -> bool:
    """Whether ``r`` may go ahead: no drafting, no processors, no M-RoPE delta."""
    return r.drafter is None and not r.processors and (r.images is None or not r.images.delta)
