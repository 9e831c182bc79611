"""The engine: requests join and leave a running batch at token granularity.

:class:`Engine` is the caller's side: ``submit`` from any thread (``start`` and ``stream``, the
text side, are :mod:`.frontend`'s), the pools' statistics and ``metrics``, ``close``. Its thread
runs :class:`~.scheduler.Scheduler`'s loop over the requests, which owns the model and the pools.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..generation.drafts import Draft
from ..generation.prefill import check_token_ids, token_ids
from ..generation.sampling import LogitsProcessor, SamplingParams
from . import disk as disk_mod
from . import disk_states
from . import pool as pool_mod
from . import rows as rows_mod
from .config import EngineConfig
from .draft_pool import DraftPool, poolable
from .frontend import TextRequests
from .layout import STATE, check_batchable, layer_shapes, make_pools, shapes_and_states
from .metrics import engine_metrics
from .pool import PoolStats
from .requests import EngineError, Handle, _Request
from .scheduler import Scheduler
from .snapshots import make_store, split_budget
from .store import block_bytes
from .turns import LocalTurns


class Engine(TextRequests, Scheduler):
    """Continuous batching over one model: ``submit`` from any thread, read each
    request's steps as they come.

    Args:
        config: the engine's settings (:class:`~.config.EngineConfig`; its defaults without).
        options: settings by keyword, over ``config``'s: ``EngineConfig``'s fields (``kv_budget``,
            ``max_batch``, ``kv_bits``, ...), or their old names (``reserve``, ``state_budget``,
            ``state_every``).
    """

    def __init__(self, model, *, config: EngineConfig | None = None, **options) -> None:
        self.config = c = (config or EngineConfig()).with_options(**options)
        kv_budget, block_size, prefill_step = c.kv_budget, c.block_size, c.prefill_step
        shrink_every = c.shrink_every
        self.model = model
        # Across ranks (load(distributed=...)): every rank's engine takes the same turns.
        turns = None
        if hasattr(model, "engine_turns"):
            turns = model.engine_turns(rank0_requests=c.rank0_requests)
        elif c.rank0_requests:
            raise ValueError("rank0_requests: the model does not run across ranks")
        # Rows of one regime share a forward (None: all rows; see check_batchable).
        self.regime, self.windows = check_batchable(model)
        # Recurrent layers' states live with each request; prefixes are shared from snapshots
        # of the states at block boundaries (snapshots.py), inside kv_budget, and a drafting
        # row's states go back to before a step whose drafts were rejected (the scheduler's).
        self.recurrent = STATE in self.windows
        if turns is not None:  # a rank without recurrent layers takes the others' turns
            self.recurrent = turns.any_recurrent(self.recurrent)
        shapes, template = shapes_and_states(model, c.kv_bits, c.kv_group_size)
        # A draft model's pool inside kv_budget; across ranks none: rank 0 alone drafts
        # (distributed/copies.py), its pool made on the first request outside the budget, so
        # that every rank's pool keeps the same blocks.
        drafts = [m for m in c.draft_models if poolable(m)] if c.max_draft > 0 else []
        if turns is not None:
            drafts = []
        target_budget = _target_budget(shapes, drafts, kv_budget, block_size)
        state_bytes = 0
        if self.recurrent:
            target_budget, state_bytes = split_budget(target_budget, c.prefix_state_bytes)
        blocks = None
        if turns is not None:  # as many blocks on every rank (of no bytes without attention)
            per_block = block_bytes(shapes, block_size)
            blocks = turns.equal_blocks(per_block, target_budget)
            target_budget, shrink_every = blocks * per_block, turns.shrink_every
        # Sliding-window layers hold only their windows, in a pool of their own (make_pools).
        self.pool, self.window_pool = make_pools(
            shapes,
            self.windows,
            block_size=block_size,
            kv_budget=target_budget,
            hold_windows=c.hold_windows,
            blocks=blocks,
        )
        self.snapshots = None
        if state_bytes:  # across ranks as many snapshots on every rank (snapshots.py)
            self.snapshots = make_store(state_bytes, template, self.pool.holds, turns)
        self.state_every = c.state_every
        if c.prefix_cache_dir is not None:
            self.pool.disk = disk_mod.attach(
                model,
                [p for p in (self.pool, self.window_pool) if p is not None],
                directory=c.prefix_cache_dir,
                budget=c.prefix_cache_disk_bytes,
                refusal=_disk_refusal(self),
            )
            if self.pool.disk is not None and self.snapshots is not None and template:
                # states on disk too (a pipeline rank without recurrent layers has none)
                self.snapshots = disk_states.DiskSnapshots(self.snapshots, self.pool.disk, template)
        if c.kv_reserve:
            for pool in (self.pool, self.window_pool):
                if pool is not None:
                    pool.reserve()
        self.max_batch, self.prefill_step = c.max_batch, prefill_step
        self.shrink_every, self._looked_at = shrink_every, time.monotonic()
        self.attention = c.attention
        self.turns = LocalTurns() if turns is None else turns  # the scheduler asks them always
        # Across pipeline ranks: one flight of rows at each rank's stage (flights.py).
        self.micro = None
        if hasattr(model, "micro_pipeline") and not self.recurrent and self.regime is None:
            self.micro = model.micro_pipeline(c.micro_batches)  # None: off, or one rank
        # Every request reserves room for max_draft more tokens: a step that verifies drafts
        # writes up to that many past a row's last token before rejected ones are rewound.
        self.max_draft = c.max_draft
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
        self._draft_pools: dict[int, DraftPool] = {
            id(m): DraftPool(m, model, self.pool.max_blocks, block_size) for m in drafts
        }
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
        blocks as the target's: inside ``kv_budget`` if the model was named in ``draft_models``;
        drafts verified in the batch's forward, rejected
        ones rewound): the same tokens as without it when greedy, the same distribution when
        sampling. ``num_draft``: tokens drafted per step (at most ``max_draft``); None adapts
        to the acceptance rate.
        ``logits_processors``: more processors for this request, after its sampling's (a
        constraint's, for one: each request gets its own)."""
        if isinstance(ids, str):
            raise TypeError("submit: expected token ids, found a str (text goes to Engine.stream)")
        ids = token_ids(ids)
        if not ids:
            raise ValueError("prompt: empty (expected at least one token)")
        check_token_ids(self.model, ids)
        if getattr(draft, "model", None) is not None:  # a DraftModel is fed the prompt too
            check_token_ids(draft.model, ids, "prompt (for the draft model)")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        sampling = sampling or SamplingParams()
        sampling.check()
        self.pool.check_fits(len(ids) + max_tokens, self.max_draft)
        sampling = self.turns.seeded(sampling)  # across ranks, the same seed on every rank
        processors = sampling.processors() + list(logits_processors)
        request = _Request(ids, max_tokens, sampling.sampler(), processors, frozenset(eos))
        drafting = (draft is not None or num_draft is not None) and self.max_draft > 0
        # Across ranks a draft model drafts on rank 0 alone (distributed/batching.py).
        if drafting and not self.turns.follow_drafts(request, draft, num_draft, self.max_draft):
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

    def metrics(self) -> dict[str, float]:
        """A snapshot of the engine's counters (for ``/metrics``; read without a lock, so
        each value is current but they may be a step apart): ``metrics.engine_metrics``."""
        return engine_metrics(self)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine: requests still running end with EngineError. Engines still open
        when the interpreter exits are closed then: a thread killed inside an MLX call aborts
        the process ("terminate called without an active exception")."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        timeout = max(timeout, self.turns.close_s)  # across ranks, the last turn's wait
        self._thread.join(timeout)
        if self.pool.disk is not None:  # what is queued for the disk is written first
            self.pool.disk.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()


def _weight_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _disk_refusal(engine: Engine) -> str | None:
    """Why ``engine``'s prefixes cannot go to disk yet, or None."""
    if engine.recurrent and engine.snapshots is None:
        return "recurrent layers without state snapshots (state_budget=0) share no prefix"
    return None


@atexit.register
def _close_all() -> None:
    for engine in list(_LIVE):
        engine.close(timeout=5.0)


def _target_budget(shapes, draft_models, kv_budget: int, block_size: int) -> int:
    """The part of ``kv_budget`` for the target's pools when ``draft_models``' pools share it:
    the bytes of the blocks the budget buys for every pool at once (the whole budget without
    drafts)."""
    if not draft_models:
        return kv_budget
    per_block = block_bytes(shapes, block_size)
    draft_per_block = [block_bytes(layer_shapes(m), block_size) for m in draft_models]
    blocks = kv_budget // (per_block + sum(draft_per_block))
    if blocks < 1:
        raise pool_mod.PoolFullError(
            f"kv_budget: {kv_budget} bytes hold no block of {per_block} bytes for the model and "
            f"{' + '.join(map(str, draft_per_block))} for its draft model(s)"
        )
    return blocks * per_block
