"""The engine's thread: it owns the model and the pools, and runs the requests.

One thread owns the model and the pools. Each turn of its loop it

1. admits waiting requests while the pool can reserve their worst case
   (prompt + ``max_tokens``) and the batch has room, sharing prefix blocks;
2. prefills at most ``prefill_step`` prompt tokens (chunks of the admitted
   requests, in order; short ones share a forward), so prompts never stall the
   running streams for longer;
3. runs one decode step over every request whose prompt is in: one forward of
   B rows, each with its own position, then each row's own processors and
   sampler (its own seeded key), so a request draws the same tokens alone or
   in a batch;
4. retires requests on EOS, ``max_tokens`` or cancellation, returning their
   blocks to the pool.

Prefill leaves the prompt's last token out; that token is the request's first
decode row, whose logits give the first generated token.

A request's tokens reach its consumer through a queue (``Handle.steps``);
every wait on it is bounded and ends with an error if the engine thread died.
Stop strings and detokenizing are the consumer's (``Engine.stream``), which
cancels the request when it stops early.

A model with recurrent layers (LFM2, Qwen3-Next, Qwen3.5) batches too: each request keeps its
own fixed-size state for those layers beside its blocks, and the step stacks the rows' states.
A state holds the whole prefix it has read, so a request shares a prefix only where a snapshot
of the states after it is kept (``snapshots``: taken at block boundaries during prefill, its
chunks cut there); it resumes from the deepest prefix with both its blocks and a snapshot.
A drafting row's states go back to before a verification step that fed more than it kept
(``RecurrentRows.refeed_states``), and the kept tokens are fed again.

A request may draft (speculative decoding): by prompt lookup, or with a draft model, whose keys
the request keeps in that model's own pool (``draft_pool``: the rows drafting with it share each
draft forward), or with the model's MTP head, whose pairs it keeps in the head's pool
(``head_pool``, inside ``kv_budget``: admission reserves its worst case there too); its step
verifies the drafts in the batch's one forward and rewinds the rejected ones, in both pools.

The rows' parts are the scheduler's members, each given what it needs when the engine is made:
``pools`` (a forward's views, a row's blocks in every pool), ``recurrent`` (the states of a
model with recurrent layers, or None), ``verification`` (drafting rows' steps), ``flights``
(micro-batched decode across pipeline ranks), ``ahead`` (in one process, a step of plain rows
queued before the last one's tokens are read), ``turns`` (one process's, or the ranks').
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import mlx.core as mx

from ..generation.results import Step
from ..platform.threads import release_at_thread_exit
from . import ahead as ahead_mod
from . import rows as rows_mod
from .config import EngineConfig
from .draft_pool import DraftPool
from .flights import Flights
from .images import EncoderCache
from .metrics import Counters
from .parts import Parts
from .prefill import Prefill
from .recurrent import RecurrentRows, state_arrays
from .requests import POLL_S, EngineError, _Request
from .verification import Verification


class Scheduler:
    """The loop of :class:`~.engine.Engine`'s thread: admit, prefill in chunks, decode B rows,
    retire; the pools' bookkeeping for a request. ``parts``: what ``config`` makes of
    ``model`` (``parts.py``); ``turns``: one process's (``turns.py``) or the ranks'."""

    def __init__(self, model, config: EngineConfig, turns, parts: Parts) -> None:
        self.model, self.config, self.turns = model, config, turns
        self.pools = pools = parts.pools
        self.pool, self.window_pool = pools.pool, pools.window_pool
        self.snapshots, self.regime = parts.snapshots, parts.regime
        self.max_batch, self.prefill_step = config.max_batch, config.prefill_step
        # Every request reserves room for max_draft more tokens: a step that verifies drafts
        # writes up to that many past a row's last token before rejected ones are rewound.
        self.max_draft, self.attention = config.max_draft, config.attention
        self.shrink_every, self._looked_at = parts.shrink_every, time.monotonic()
        self._draft_pools = parts.draft_pools  # each draft model's (by id; made on first use)
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes)  # image features (images.py)
        # Whether the forward takes positions (Qwen-VL's M-RoPE): image rows decode at their own.
        self.takes_positions = "positions" in _keywords(model)
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None
        self.counters = Counters()
        self.recurrent = None  # a model with recurrent layers: their states, their snapshots
        if parts.recurrent:
            self.recurrent = RecurrentRows(model, pools, parts.snapshots, config.state_every, turns)
        self.verification = Verification(
            model,
            pools,
            turns,
            self.recurrent,
            self.counters,
            max_draft=config.max_draft,
            attention=config.attention,
            retire=self._retire,
        )
        self.prefill = Prefill(self)  # after the parts it uses (prefill.py)
        self.flights = Flights(
            parts.micro,
            pools,
            self.verification,
            self.counters,
            attention=config.attention,
            emit=self._emit_rows,
            retire=self._retire,
        )
        # Plain steps queued ahead of their tokens' landing (ahead.py): in one process, for a
        # model without recurrent layers or length regimes.
        self.ahead = None
        alone = getattr(turns, "alone", False)  # no peer (LocalTurns), as verification reads it
        if ahead_mod.ON and alone and not parts.recurrent and self.regime is None:
            self.ahead = ahead_mod.Ahead(
                model, pools, self.counters, attention=config.attention, retire=self._retire
            )

    def _shrink(self) -> None:
        """Every ``shrink_every`` seconds: give back the store's tail that the busiest moment
        since the last look did not need (``KVPool.shrink``), out of MLX's buffer cache too."""
        now = time.monotonic()
        if now - self._looked_at < self.shrink_every:
            return
        self._looked_at = now
        heads = self.pools.head_pool
        if self.pool.shrink() + (heads.pool.shrink() if heads is not None else 0):
            mx.clear_cache()

    def _loop(self) -> None:
        release_at_thread_exit()
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._waiting and not self._running:
                        if self.turns.due():  # across ranks, rank 0's heartbeat (batching.py)
                            break
                        self._cond.wait(POLL_S)
                        self._shrink()
                    waiting, self._waiting = self._waiting, []
                # What the turn takes (across ranks rank 0 decides: batching.py); None: closed.
                waiting = self.turns.agree(self, waiting)
                if waiting is None:
                    break
                self._admit(waiting)
                self.turns.admitted(self, waiting)  # cancellations retire (or ranks compare)
                self._prefill()
                self._decode()
                if self.pool.disk is not None:  # the turn's new full blocks, to the writer
                    self.pool.disk.save_fresh()
                self._shrink()
                self.counters.draft_kv_bytes = sum(
                    rows_mod.draft_nbytes(r) for r in self._running
                ) + sum(p.bytes_in_use for p in self._draft_pools.values())
                if self.pools.head_pool is not None:  # MTP rows' heads
                    self.counters.draft_kv_bytes += self.pools.head_pool.bytes_in_use
        except BaseException as e:  # the thread must not die silently: tell every request
            self.failure = e
            raise
        finally:
            self._closed = True
            error = EngineError(f"engine stopped: {self.failure or 'closed'}")
            with self._cond:
                left, self._waiting = self._running + self._waiting, []
                self._running = []
            for request in left:
                self.pools.release(request)
                request.out.put(error)

    def _admit(self, waiting: list[_Request]) -> None:
        held = []
        for request in waiting:
            if request.cancelled.is_set() and self.turns.cancels_here:
                request.out.put(None)
                continue
            if len(self._running) >= self.max_batch:
                held.append(request)
                continue
            if not self._admit_one(request):  # no room now: wait for a running request to leave
                held.append(request)
                continue
            seq = request.seq
            request.cached_tokens = seq.length
            if request.processors:
                request.history = mx.array(request.ids, dtype=mx.int32)
            self._running.append(request)
        if held:
            with self._cond:
                self._waiting[:0] = held

    def _admit_one(self, request: _Request) -> bool:
        """Sequences for ``request`` in every pool (the same prefix shared in each: as much of
        it as the window pool has the windows of), or False, holding nothing, if one lacks room."""
        room = request.max_tokens + self.max_draft
        salts = request.salts  # a request with images: its blocks are named by them too
        if self.pool.disk is not None:  # the prefix's blocks on disk join the pools' cached ones
            # Across ranks, the blocks every rank's files hold (batching.py's fewest).
            self.pool.disk.promote(request.ids, self.turns.fewest, salts)
        # A recurrent model shares what a snapshot of its states can resume (snapshots.py).
        share = self.recurrent is None or self.snapshots is not None
        hits = None
        if share and (self.window_pool is not None or self.recurrent is not None or request.images):
            hits = self._shared_blocks(request)
            if self.recurrent is not None:  # as far as a snapshot of its states lets it resume
                hits = self.recurrent.resume_point(request, hits)
        request.seq = self.pool.admit(request.ids, room, share, hits=hits, salts=salts)
        ok = request.seq is not None
        if ok and self.window_pool is not None:
            request.wseq = self.window_pool.admit(request.ids, room, share, hits, salts)
            ok = request.wseq is not None
        if ok and isinstance(request.drafter, DraftPool):
            ok = request.drafter.admit(request, room)
        heads = self.pools.head_pool
        if ok and heads is not None and rows_mod.observer(request) is not None:
            ok = heads.admit(request, room)  # an MTP row: its head's pairs, in the budget too
        if not ok:
            self.pools.release(request)
            request.seq = request.wseq = None
        elif self.recurrent is not None:
            self.recurrent.start_states(request)
        return ok

    def _shared_blocks(self, request: _Request) -> int:
        """How many leading blocks ``request`` shares in every pool: as far as the pool holds
        them, the window pool their windows, and never to the inside of an image."""
        ids, salts, bs = request.ids, request.salts, self.pool.block_size
        found = self.pool.lookup(ids, salts)
        window = self.window_pool.lookup(ids, salts) if self.window_pool is not None else None
        limit = len(found)
        while True:
            hits = self.pool.shareable(found[:limit])
            if window is not None:
                hits = self.window_pool.shareable(window[:hits])
            cut = request.images.cut(hits, bs) if request.images is not None else hits
            if cut == hits:
                return hits
            limit = cut

    def _retire(self, request: _Request) -> None:
        self.counters.requests_done += 1
        self._running.remove(request)
        if request.last_block is not None and request.last_block[1] is not None:
            self.snapshots.put(*request.last_block)
        self.pools.release(request)
        if request.draft_model is not None:  # its draft keys go with it
            request.drafter = request.draft_model = None
        request.out.put(None)

    def _retire_cancelled(self) -> None:
        for request in [r for r in self._running if r.cancelled.is_set() and not r.dropped]:
            self._cancel(request)

    def _cancel(self, request: _Request) -> None:
        """Retire ``request`` (rank 0's cancellation), or at its flight's landing if it flies
        (``flights.py``)."""
        if request.flying:
            request.dropped = True
        else:
            self._retire(request)

    def _prefill(self) -> None:
        """At most ``prefill_step`` prompt tokens between two decode steps (``prefill.py``);
        a request whose images fail to encode is retired with its error."""
        for request, error in self.prefill.turn(self._running):
            self._running.remove(request)
            self.pools.release(request)
            request.out.put(error)

    def _decode(self) -> None:
        t0 = time.perf_counter()
        if self.ahead is not None and self.flights.micro is None:  # (ahead.py)
            rows = self.ahead.decode(self._running)  # the rows it leaves to the plain step
        else:
            rows = [r for r in self._running if r.pending is not None]
        micro = self.flights.micro
        if micro is not None and (rows or micro.flying()):  # (flights.py)
            rows = self.flights.decode(rows)
        if not rows:
            self.counters.decode_s += time.perf_counter() - t0
            return
        for group in self._groups(rows):
            if any(r.drafter is not None for r in group):
                self.verification.verify_rows(group)
            else:
                self._decode_rows(group)
        self.counters.decode_s += time.perf_counter() - t0

    def _groups(self, rows: list[_Request]) -> list[list[_Request]]:
        """The step's forwards: all rows in one, or for a model whose frequencies follow the
        length (dynamic NTK, LongRoPE) the rows of each regime together. A drafting row of such
        a model verifies alone: its forward's length, which the regime reads, is its own."""
        if self.regime is None:
            return [rows]
        groups: dict[Any, list[_Request]] = {}
        alone = []
        for r in rows:
            if r.drafter is not None:
                alone.append([r])
            else:
                groups.setdefault(self.regime(r.seq.length + 1), []).append(r)
        return [*groups.values(), *alone]

    def _decode_rows(self, rows: list[_Request]) -> None:
        tokens = [[r.pending] for r in rows]
        extra = _row_positions(rows)  # before the batch records the tokens
        batch = self.pools.batch(rows, tokens, self.attention)
        logits = self.model(mx.array(tokens, dtype=mx.int32), batch.views(), **extra)[:, -1, :]
        self.counters.steps_run += 1
        self._emit_rows(rows, logits)

    def _emit_rows(self, rows: list[_Request], logits: mx.array) -> None:
        """Each row's token sampled from its logits (B, V), handed to its consumer."""
        self.counters.decode_tokens += len(rows)
        picked, logprobs = rows_mod.sample_rows(rows, logits)
        picked = self.turns.adopt(picked)  # across ranks rank 0's, where it alone samples
        # Everything handed to the consumers is evaluated here: their threads cannot run
        # this thread's streams.
        mx.eval(picked, logprobs, self.pools.stores(), [state_arrays(r) for r in rows])
        for request, t, lp in zip(rows, picked.tolist(), logprobs):
            request.generated += 1
            if self.recurrent is not None:
                self.recurrent.mark_block(request)
            if request.history is not None:
                request.history = mx.concatenate([request.history, mx.array([t], mx.int32)])
            request.out.put(Step(t, lp))
            if t in request.eos or request.generated >= request.max_tokens:
                self._retire(request)
            else:
                request.pending = t


def _keywords(model) -> set[str]:
    """The names ``model``'s forward takes (its ``*args``/``**kwargs`` aside)."""
    named = inspect.signature(model.__call__).parameters.values()
    return {p.name for p in named if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _row_positions(rows: list[_Request]) -> dict[str, mx.array]:
    """``positions`` (B, 1, 3) for a decode step where a row's M-RoPE delta is not 0 (a
    Qwen-VL row with images: its token at index + delta; every other row at its index, which
    multimodal RoPE with three equal positions rotates as plain RoPE), else nothing."""
    deltas = [r.images.delta if r.images is not None else 0 for r in rows]
    if not any(deltas):
        return {}
    at = [[[r.seq.length + d] * 3] for r, d in zip(rows, deltas)]
    return {"positions": mx.array(at, dtype=mx.int32)}
