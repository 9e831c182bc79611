"""The engine: requests join and leave a running batch at token granularity.

One thread owns the model and the pool. Each turn of its loop it

1. admits waiting requests while the pool can reserve their worst case
   (prompt + ``max_tokens``) and the batch has room, sharing prefix blocks;
2. prefills at most ``prefill_step`` prompt tokens (chunks of the admitted
   requests, in order), so prompts never stall the running streams for longer;
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

A model with recurrent layers (LFM2, Qwen3-Next) batches too: each request keeps its own
fixed-size state for those layers beside its blocks, and the step stacks the rows' states.
A state holds the whole prefix it has read and cannot be rewound per row, so such a model
shares no prefix blocks and drafts nothing (``max_draft`` is 0).

A request may draft (speculative decoding): by prompt lookup, or with a draft model, whose keys
the request keeps in that model's own pool (``draft_pool``: the rows drafting with it share each
draft forward); its step verifies the drafts in the batch's one forward and rewinds the rejected
ones, in both pools.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..backends import prefill_schedule
from ..cache import StateCache
from ..generation.drafts import Draft
from ..generation.results import Step
from ..generation.sampling import LogitsProcessor, SamplingParams
from ..models.layers.rope import prompt_reach
from ..threads import release_at_thread_exit
from . import pool as pool_mod
from . import rows as rows_mod
from .draft_pool import DraftPool, poolable
from .frontend import TextRequests
from .layout import STATE, check_batchable, layer_shapes, make_pools
from .pool import KVPool, PoolStats
from .requests import POLL_S, EngineError, Handle, _Request
from .views import StepBatch

DEFAULT_MAX_BATCH = 16  # sequences decoded together at most
DEFAULT_PREFILL_STEP = 256  # prompt tokens per prefill chunk between decode steps
DEFAULT_MAX_DRAFT = 8  # tokens a drafting request may propose per step


class Engine(TextRequests):
    """Continuous batching over one model: ``submit`` from any thread, read each
    request's steps as they come.

    Args:
        kv_budget: bytes the KV pool may hold (keys and values of every layer).
        block_size: tokens per KV block.
        max_batch: most sequences decoded in one step.
        kv_bits: store keys and values with 8 or 4 bits (groups of ``kv_group_size``), as
            ``--kv-bits`` does for one request (float32 keys in 64-wide heads: 3.6x / 6.4x the
            tokens for the same ``kv_budget``).
        max_draft: most tokens a drafting request (``submit(draft=...)``: prompt lookup or a
            draft model) may propose per step; 0 turns drafting off. Each request reserves
            this many more tokens of KV room.
        prefill_step: most prompt tokens prefilled between two decode steps (one or more
            requests' chunks).
        attention: how decode steps read the pool: ``"pages"``, over its blocks in place
            (the faster measured on the CPU backend, docs/batching.md), or ``"gather"``, over a
            contiguous copy of each row's keys. Both give the same logits (1e-4).
        hold_windows: sliding-window layers keep only the blocks their window still sees (in a
            pool of their own, as many blocks as the pool: ``kv_budget`` holds both), not every
            key of the sequence.
    """

    def __init__(
        self,
        model,
        *,
        kv_budget: int = pool_mod.DEFAULT_KV_BUDGET,
        block_size: int = pool_mod.DEFAULT_BLOCK_SIZE,
        max_batch: int = DEFAULT_MAX_BATCH,
        prefill_step: int = DEFAULT_PREFILL_STEP,
        attention: str = "pages",
        max_draft: int = DEFAULT_MAX_DRAFT,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        hold_windows: bool = True,
    ) -> None:
        if max_batch < 1 or prefill_step < 1:
            raise ValueError(
                f"max_batch and prefill_step must be >= 1, got {max_batch}, {prefill_step}"
            )
        if attention not in ("pages", "gather"):
            raise ValueError(f"attention: expected 'pages' or 'gather', found {attention!r}")
        if max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {max_draft}")
        self.model = model
        # Rows of one regime share a forward (None: all rows; see check_batchable).
        self.regime, self.windows = check_batchable(model)
        # Recurrent layers' states live with each request: no prefix sharing, no drafts.
        self.recurrent = STATE in self.windows
        if self.recurrent:
            max_draft = 0
        shapes = layer_shapes(model, kv_bits, kv_group_size)
        # Sliding-window layers hold only their windows, in a pool of their own (make_pools).
        self.pool, self.window_pool = make_pools(
            shapes,
            self.windows,
            block_size=block_size,
            kv_budget=kv_budget,
            hold_windows=hold_windows,
        )
        self.max_batch, self.prefill_step = max_batch, prefill_step
        self.attention = attention
        # Every request reserves room for max_draft more tokens: a step that verifies drafts
        # writes up to that many past a row's last token before rejected ones are rewound.
        self.max_draft = max_draft
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None
        self._ids = itertools.count()
        self.steps_run = 0  # decode forwards so far
        self.prefill_steps = 0  # prefill forwards so far (short chunks share one)
        # Time spent in each kind of forward, and the tokens it fed (the bench's rates).
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_tokens = 0
        self.requests_done = 0  # requests retired (finished or cancelled)
        self.draft_tokens = self.accepted_tokens = 0  # drafts proposed, kept
        # Draft models: their forwards (a token each for each row in it, prefill chunks aside),
        # the time spent in them, the bytes of the draft keys held for the running requests,
        # each model's weights, and each model's pool (by id; made on first use).
        self.draft_steps, self.draft_s, self.draft_kv_bytes = 0, 0.0, 0
        self._draft_weights: dict[int, int] = {}
        self._draft_pools: dict[int, DraftPool] = {}
        self._thread = threading.Thread(target=self._loop, name="mlxinfer-engine", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- the caller's side -----------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(
        self,
        ids: Sequence[int],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        eos: frozenset[int] = frozenset(),
        draft: Draft | None = None,
        num_draft: int | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
    ) -> Handle:
        """Queue a request for ``ids`` (token ids); raises PoolFullError at once if it could
        never fit the budget.

        ``draft``: speculative decoding by :class:`~mlxinfer.generation.drafts.PromptLookup`
        or with a :class:`~mlxinfer.generation.drafts.DraftModel` (same vocabulary; the rows
        drafting with one draft model share its forwards, over a pool of its own as large in
        blocks as the target's; drafts verified in the batch's forward, rejected
        ones rewound): the same tokens as without it when greedy, the same distribution when
        sampling. ``num_draft``: tokens drafted per step (at most ``max_draft``); None adapts
        to the acceptance rate.
        ``logits_processors``: more processors for this request, after its sampling's (a
        constraint's, for one: each request gets its own)."""
        if isinstance(ids, str):
            raise TypeError("submit: expected token ids, found a str (text goes to Engine.stream)")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt: empty (expected at least one token)")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        sampling = sampling or SamplingParams()
        sampling.check()
        self.pool.check_fits(len(ids) + max_tokens, self.max_draft)
        processors = sampling.processors() + list(logits_processors)
        request = _Request(ids, max_tokens, sampling.sampler(), processors, frozenset(eos))
        if (draft is not None or num_draft is not None) and self.max_draft > 0:
            rows_mod.start_drafting(
                request,
                self.model,
                draft,
                num_draft,
                sampling.seed,
                self.max_draft,
                self._draft_pool,
            )
            if request.draft_model is not None and id(draft.model) not in self._draft_weights:
                # Weights still lazy are evaluated on this thread, whose streams they are on:
                # the engine's thread could not run them.
                mx.eval(draft.model.parameters())
                self._draft_weights[id(draft.model)] = _weight_bytes(draft.model)
        if max_tokens == 0:
            request.out.put(None)
            return Handle(self, request, next(self._ids))
        with self._cond:
            if not self.alive:
                raise EngineError(f"engine stopped: {self.failure or 'closed'}")
            self._waiting.append(request)
            self._cond.notify()
        return Handle(self, request, next(self._ids))

    def _draft_pool(self, draft) -> DraftPool | None:
        """The pool of ``draft``'s model (made on its first request), or None for a model
        whose caches a pool cannot hold: then each request keeps a cache of its own."""
        key = id(draft.model)
        with self._cond:
            if key not in self._draft_pools:
                if not poolable(draft.model):
                    return None
                self._draft_pools[key] = DraftPool(
                    draft.model, self.model, self.pool.max_blocks, self.pool.block_size
                )
            return self._draft_pools[key]

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def window_stats(self) -> PoolStats | None:
        """The window pool's statistics (sliding-window layers), or None without one."""
        return self.window_pool.stats() if self.window_pool is not None else None

    def _window(self, rows: list[_Request]) -> tuple[KVPool, list] | None:
        """The window pool and the rows' sequences there, for a StepBatch (None without one)."""
        if self.window_pool is None:
            return None
        return self.window_pool, [r.wseq for r in rows]

    def _stores(self) -> list:
        """Every pool's arrays, to evaluate with the step that wrote them."""
        pools = [self.pool] + ([self.window_pool] if self.window_pool is not None else [])
        return [p.keys + p.values for p in pools]

    def _release(self, request: _Request) -> None:
        """Give back the request's blocks in every pool."""
        if request.seq is not None:
            self.pool.release(request.seq)
        if request.wseq is not None:
            self.window_pool.release(request.wseq)
        if isinstance(request.drafter, DraftPool):
            request.drafter.release(request)

    def metrics(self) -> dict[str, float]:
        """A snapshot of the engine's counters (for ``/metrics``; read without a lock, so
        each value is current but they may be a step apart)."""
        pool = self.pool.stats()
        return {
            "requests_running": len(self._running),
            "requests_waiting": len(self._waiting),
            "requests_done": self.requests_done,
            "prompt_tokens": self.prefill_tokens,
            "generated_tokens": self.decode_tokens,
            "prefill_tokens_per_second": self.prefill_tokens / self.prefill_s
            if self.prefill_s
            else 0.0,
            "decode_tokens_per_second": self.decode_tokens / self.decode_s
            if self.decode_s
            else 0.0,
            "decode_steps": self.steps_run,
            "prefill_steps": self.prefill_steps,
            "kv_blocks_in_use": pool.blocks_in_use,
            "kv_blocks_cached": pool.blocks_cached,
            "kv_blocks_free": pool.blocks_free,
            "kv_window_blocks_in_use": self.window_pool.stats().blocks_in_use
            if self.window_pool is not None
            else 0,
            "kv_bytes": pool.nbytes + (self.window_pool.nbytes if self.window_pool else 0),
            "prefix_hit_ratio": pool.prefix_hits / pool.prefix_queries
            if pool.prefix_queries
            else 0.0,
            "draft_tokens": self.draft_tokens,
            "draft_accepted_tokens": self.accepted_tokens,
            "draft_steps": self.draft_steps,
            "draft_seconds": self.draft_s,
            "draft_kv_bytes": self.draft_kv_bytes,
            "draft_model_bytes": sum(self._draft_weights.values()),
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine: requests still running end with EngineError. Engines still open
        when the interpreter exits are closed then: a thread killed inside an MLX call aborts
        the process ("terminate called without an active exception")."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        release_at_thread_exit()
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._waiting and not self._running:
                        self._cond.wait(POLL_S)
                    if self._closed:
                        break
                    waiting, self._waiting = self._waiting, []
                self._admit(waiting)
                self._retire_cancelled()
                self._prefill()
                self._decode()
                self.draft_kv_bytes = sum(rows_mod.draft_nbytes(r) for r in self._running) + sum(
                    p.bytes_in_use for p in self._draft_pools.values()
                )
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
                self._release(request)
                request.out.put(error)

    def _admit(self, waiting: list[_Request]) -> None:
        held = []
        for request in waiting:
            if request.cancelled.is_set():
                request.out.put(None)
                continue
            if len(self._running) >= self.max_batch:
                held.append(request)
                continue
            if not self._admit_one(request):  # no room now: wait for a running request to leave
                held.append(request)
                continue
            seq = request.seq
            if self.recurrent:
                request.states = [c for c in self.model.make_cache() if isinstance(c, StateCache)]
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
        room, share = request.max_tokens + self.max_draft, not self.recurrent
        hits = None
        if self.window_pool is not None and share:
            full = self.pool.shareable(self.pool.lookup(request.ids))
            hits = self.window_pool.shareable(self.window_pool.lookup(request.ids)[:full])
        request.seq = self.pool.admit(request.ids, room, share, hits=hits)
        ok = request.seq is not None
        if ok and self.window_pool is not None:
            request.wseq = self.window_pool.admit(request.ids, room, share, hits=hits)
            ok = request.wseq is not None
        if ok and isinstance(request.drafter, DraftPool):
            ok = request.drafter.admit(request, room)
        if not ok:
            self._release(request)
            request.seq = request.wseq = None
        return ok

    def _retire(self, request: _Request) -> None:
        self.requests_done += 1
        self._running.remove(request)
        self._release(request)
        if request.draft_model is not None:  # its draft keys go with it
            request.drafter = request.draft_model = None
        request.out.put(None)

    def _retire_cancelled(self) -> None:
        for request in [r for r in self._running if r.cancelled.is_set()]:
            self._retire(request)

    def _prefill(self) -> None:
        """At most ``prefill_step`` prompt tokens between two decode steps: chunks of the
        admitted requests whose prompt (but its last token) is not in yet, in order; short
        chunks share a forward (``_prefill_groups``)."""
        budget, visited, chunks = self.prefill_step, [], []
        for request in self._running:
            if budget <= 0:
                break
            if request.pending is not None:
                continue
            visited.append(request)
            left = len(request.ids) - 1 - request.seq.length
            if left > 0:
                start = request.seq.length
                chunks.append((request, request.ids[start : start + min(left, budget)]))
                budget -= len(chunks[-1][1])
        for group in self._prefill_groups(chunks):
            self._prefill_rows(group)
        for request in visited:
            if request.draft_model is not None:  # its draft model reads what the pool holds
                self._feed_draft(request)
            if request.seq.length == len(request.ids) - 1:
                request.pending = request.ids[-1]

    def _prefill_groups(self, chunks: list[tuple[_Request, list[int]]]) -> list[list]:
        """The turn's chunks, in forwards: consecutive chunks together while their rows, each
        padded to the longest, make no more than ``prefill_step`` tokens and each row's padding
        stays within the room it reserved (the padding is rewound after). A model with recurrent
        layers (a state would read the padding) or with frequencies that follow the length
        (one prompt's reach per forward) prefills one chunk a forward, and so does a quantized
        pool (several rows' quantized attention there was 4e-4 off the single loop's log-probs)."""
        if self.recurrent or self.regime is not None or self.pool.layers[0].bits is not None:
            return [[c] for c in chunks]
        groups: list[list] = []
        for request, chunk in chunks:
            if groups:
                group = groups[-1] + [(request, chunk)]
                L = max(len(c) for _, c in group)
                if len(group) * L <= self.prefill_step and all(
                    r.seq.length + L <= self._room_end(r) for r, _ in group
                ):
                    groups[-1] = group
                    continue
            groups.append([(request, chunk)])
        return groups

    def _room_end(self, request: _Request) -> int:
        """The positions ``request``'s reserved blocks reach (its prompt, ``max_tokens`` and
        ``max_draft``, in whole blocks)."""
        room = len(request.ids) + request.max_tokens + self.max_draft
        return self.pool.blocks_for(room) * self.pool.block_size

    def _prefill_rows(self, group: list[tuple[_Request, list[int]]]) -> None:
        """One prefill forward over the group's chunks, each row padded to the longest with its
        last token; the padding's keys are rewound."""
        t0 = time.perf_counter()
        rows = [r for r, _ in group]
        L = max(len(c) for _, c in group)
        padded = [c + c[-1:] * (L - len(c)) for _, c in group]
        ends = [r.seq.length + len(c) for r, c in group]
        batch = StepBatch(
            self.pool,
            [r.seq for r in rows],
            padded,
            self.windows,
            states=[r.states for r in rows],
            window=self._window(rows),
        )
        # Every chunk rotates as the whole prompt would (dynamic NTK, LongRoPE: one row then).
        with prefill_schedule(self.model), prompt_reach(len(rows[0].ids)):
            self.model(mx.array(padded, dtype=mx.int32), batch.views())
            mx.eval(self._stores(), [_arrays(r) for r in rows])
        for r, end in zip(rows, ends):
            self.pool.rewind(r.seq, end)
            if r.wseq is not None:
                self.window_pool.rewind(r.wseq, end)
        self.prefill_s += time.perf_counter() - t0
        self.prefill_tokens += sum(len(c) for _, c in group)
        self.prefill_steps += 1

    def _feed_draft(self, request: _Request) -> None:
        t0 = time.perf_counter()
        rows_mod.feed_draft(request)
        self.draft_s += time.perf_counter() - t0

    def _decode(self) -> None:
        rows = [r for r in self._running if r.pending is not None]
        if not rows:
            return
        t0 = time.perf_counter()
        for group in self._groups(rows):
            if any(r.drafter is not None for r in group):
                self._verify_rows(group)
            else:
                self._decode_rows(group)
        self.decode_s += time.perf_counter() - t0

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
        self.decode_tokens += len(rows)
        tokens = [[r.pending] for r in rows]
        batch = StepBatch(
            self.pool,
            [r.seq for r in rows],
            tokens,
            self.windows,
            self.attention,
            states=[r.states for r in rows],
            window=self._window(rows),
        )
        logits = self.model(mx.array(tokens, dtype=mx.int32), batch.views())[:, -1, :]
        picked, logprobs = rows_mod.sample_rows(rows, logits)
        # Everything handed to the consumers is evaluated here: their threads cannot run
        # this thread's streams.
        mx.eval(picked, logprobs, self._stores(), [_arrays(r) for r in rows])
        self.steps_run += 1
        for request, t, lp in zip(rows, picked.tolist(), logprobs):
            request.generated += 1
            if request.history is not None:
                request.history = mx.concatenate([request.history, mx.array([t], mx.int32)])
            request.out.put(Step(t, lp))
            if t in request.eos or request.generated >= request.max_tokens:
                self._retire(request)
            else:
                request.pending = t

    def _verify_rows(self, rows: list[_Request]) -> None:
        """One decode step in which drafting rows verify their drafts: every row feeds its
        token, its drafts and padding up to the longest (one forward), keeps the drafts its
        acceptance keeps plus one token of the target's, and the rest is rewound from the pool.
        Each row's acceptance reads only its own logits and its own key."""
        t0 = time.perf_counter()
        # The rows of one draft pool propose together (k forwards of all of them).
        proposals, forwards = rows_mod.propose(rows, self.max_draft)
        if forwards:
            self.draft_steps += forwards
            self.draft_s += time.perf_counter() - t0
        drafts = [p.tokens for p in proposals]
        L = 1 + max(len(d) for d in drafts)
        tokens = [[r.pending] + d + [r.pending] * (L - 1 - len(d)) for r, d in zip(rows, drafts)]
        starts = [r.seq.length for r in rows]
        batch = StepBatch(
            self.pool,
            [r.seq for r in rows],
            tokens,
            self.windows,
            self.attention,
            window=self._window(rows),
        )
        logits = self.model(mx.array(tokens, dtype=mx.int32), batch.views())  # (B, L, V)
        picks = [rows_mod.verify(r, logits[b], p) for b, (r, p) in enumerate(zip(rows, proposals))]
        mx.eval(picks, self._stores(), [rows_mod.draft_state(r) for r in rows])
        self.steps_run += 1
        for r, d, start, (a, t, logprobs) in zip(rows, drafts, starts, picks):
            a = int(a.item())
            emitted = d[:a] + [int(t.item())]
            self.pool.rewind(r.seq, start + 1 + a)  # the fed token and the accepted drafts
            if r.wseq is not None:
                self.window_pool.rewind(r.wseq, start + 1 + a)
            if r.draft_length is not None:
                r.draft_length.update(a, len(d))
                rows_mod.rewind_draft(r, r.tokens + emitted[:-1])  # what the pool now holds
            self._emit(r, emitted, logprobs, a, len(d))

    def _emit(self, r: _Request, emitted: list[int], logprobs, a: int, m: int) -> None:
        """Hand the step's tokens to the consumer, up to EOS or max_tokens; retire if done."""
        self.draft_tokens += m
        self.accepted_tokens += a
        for j, t in enumerate(emitted):
            first = j == 0
            r.generated += 1
            self.decode_tokens += 1
            r.tokens.append(t)
            if r.history is not None:
                r.history = mx.concatenate([r.history, mx.array([t], mx.int32)])
            r.out.put(Step(t, logprobs[j], j < a, int(first), m if first else 0, a if first else 0))
            if t in r.eos or r.generated >= r.max_tokens:
                self._retire(r)
                return
        r.pending = emitted[-1]


def _weight_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def _arrays(request: _Request) -> list[mx.array]:
    """The request's recurrent states, to evaluate with the step that wrote them."""
    return [a for c in request.states for a in c.arrays if a is not None]


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for engine in list(_LIVE):
        engine.close(timeout=5.0)
