"""The engine: requests join and leave a running batch at token granularity.

:class:`Engine` is the caller's side: ``submit`` from any thread (``start`` and ``stream``, the
text side, are its ``frontend``'s: :mod:`.frontend`), the pools' statistics and ``metrics``,
``close``. Its thread runs :class:`~.scheduler.Scheduler`'s loop over the requests, which owns
the model and the pools; what its config makes of the model is :mod:`.parts`'.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import threading
import weakref
from typing import Iterator, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import MediaError
from ..generation.drafts import Draft
from ..generation.images import PromptImages
from ..generation.prefill import check_token_ids, token_ids
from ..generation.results import GenerationResult
from ..generation.sampling import LogitsProcessor, SamplingParams
from . import rows as rows_mod
from .config import EngineConfig
from .draft_pool import DraftPool, poolable
from .frontend import TextRequests
from .images import PER_POSITION, RowImages
from .metrics import COUNTERS, engine_metrics
from .parts import make_parts, rank_turns
from .pool import PoolStats
from .requests import EngineError, Handle, Stream, _Request
from .scheduler import Scheduler, _keywords
from .turns import LocalTurns


class Engine(Scheduler):
    """Continuous batching over one model: ``submit`` from any thread, read each
    request's steps as they come.

    The engine is its scheduler's loop (``scheduler.py``) over its members: ``pools``,
    ``recurrent``, ``verification``, ``flights`` (the rows' parts), ``turns`` and ``frontend``
    (``start`` and ``stream``: text in, ``stream_generate``'s results out).

    Args:
        config: the engine's settings (:class:`~.config.EngineConfig`; its defaults without).
        options: settings by keyword, over ``config``'s: ``EngineConfig``'s fields (``kv_budget``,
            ``max_batch``, ``kv_bits``, ...), or their old names (``reserve``, ``state_budget``,
            ``state_every``).
    """

    def __init__(self, model, *, config: EngineConfig | None = None, **options) -> None:
        config = (config or EngineConfig()).with_options(**options)
        turns = rank_turns(model, config.rank0_requests)  # across ranks, the same turns
        parts = make_parts(model, config, turns)
        super().__init__(model, config, turns or LocalTurns(), parts)
        room = self.pool.max_blocks * self.pool.block_size - config.max_draft
        self.frontend = TextRequests(model, self.submit, room)
        self._ids = itertools.count()
        self._draft_weights: dict[int, int] = {}  # each draft model's weights' bytes
        self._thread = threading.Thread(target=self._loop, name="mlxinfer-engine", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def __getattr__(self, name: str):
        """The counters (``steps_run``, ``decode_tokens``, ...), read as the engine's own."""
        counters = self.__dict__.get("counters")
        if counters is not None and name in COUNTERS:
            return getattr(counters, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @functools.wraps(TextRequests.stream)
    def stream(self, tokenizer, prompt, **options) -> Iterator[GenerationResult]:
        return self.frontend.stream(tokenizer, prompt, **options)

    @functools.wraps(TextRequests.start)
    def start(self, tokenizer, prompt, **options) -> Stream:
        return self.frontend.start(tokenizer, prompt, **options)

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
        images: PromptImages | None = None,
    ) -> Handle:
        """Queue a request for ``ids`` (token ids); raises PoolFullError at once if it could
        never fit the budget.

        ``draft``: speculative decoding by :class:`~mlxinfer.generation.drafts.PromptLookup`,
        with the model's MTP head (:class:`~mlxinfer.generation.mtp_drafts.MTP`: each row's head
        cache a sequence of the head's pool, inside ``kv_budget``) or with a :class:`~mlxinfer.generation.drafts.DraftModel`
        (same vocabulary; the rows
        drafting with one draft model share its forwards, over a pool of its own as large in
        blocks as the target's: inside ``kv_budget`` if the model was named in ``draft_models``;
        drafts verified in the batch's forward, rejected
        ones rewound): the same tokens as without it when greedy, the same distribution when
        sampling. ``num_draft``: tokens drafted per step (at most ``max_draft``); None adapts
        to the acceptance rate.
        ``logits_processors``: more processors for this request, after its sampling's (a
        constraint's, for one: each request gets its own).
        ``images``: the images whose placeholder tokens ``ids`` hold (``load_images``; ids from
        ``prepare_request(images=...)``): encoded on the engine's thread before the row's first
        prefill chunk, their blocks named by them in the prefix cache (``images.py``)."""
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
        if images is not None:
            self._check_images(draft, num_draft)
            request.images = RowImages.make(ids, images, self.pool.block_size)
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

    def image_refusal(self) -> str | None:
        """Why this engine cannot run requests with images (one line), or None: it can."""
        model = self.model
        if not callable(getattr(model, "encode_images", None)):
            return f"images: {type(model).__module__} has no vision tower"
        if not isinstance(self.turns, LocalTurns):
            return "images: an engine across ranks does not take images yet"
        extra = sorted(_keywords(model) - {"inputs", "cache", *PER_POSITION})
        if extra:
            return (
                f"images: the batching engine feeds a row {', '.join(PER_POSITION)}, but "
                f"{type(model).__module__} also takes {', '.join(extra)} (stream_generate runs it)"
            )
        return None

    def _check_images(self, draft, num_draft) -> None:
        """A request with images: refused in one line where the engine cannot run it."""
        refusal = self.image_refusal()
        if refusal is not None:
            raise MediaError(refusal)
        if draft is not None or num_draft is not None:
            raise ValueError("draft: speculative decoding does not take images yet")

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


@atexit.register
def _close_all() -> None:
    for engine in list(_LIVE):
        engine.close(timeout=5.0)
