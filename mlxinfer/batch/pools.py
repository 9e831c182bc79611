"""A request's rows in every pool of the target: the full-attention pool and, for a model with
sliding-window layers, the window pool (``layout.make_pools``). :class:`Pools` is what the
scheduler, the verification step, the flights and the recurrent rows share: one forward's
views over both, and a request's blocks rewound, hashed or given back in both.
"""

from __future__ import annotations

from .draft_pool import DraftPool
from .head_pool import HeadPool
from .pool import KVPool
from .requests import _Request
from .views import StepBatch


class Pools:
    """The target's pools: ``pool`` (every full-attention layer) and ``window_pool`` (the
    sliding-window layers, or None); ``windows``: each layer's window (``check_batchable``);
    ``head_pool``: the MTP rows' head caches (``head_pool.py``), or None."""

    head_pool: HeadPool | None = None

    def __init__(self, pool: KVPool, window_pool: KVPool | None, windows: list) -> None:
        self.pool, self.window_pool, self.windows = pool, window_pool, windows

    def all(self) -> list[KVPool]:
        return [self.pool] + ([self.window_pool] if self.window_pool is not None else [])

    def batch(
        self,
        rows: list[_Request],
        tokens: list[list[int]],
        form: str = "gather",
        hashed=True,
        blocks=None,
    ) -> StepBatch:
        """The StepBatch of one forward feeding ``tokens`` to ``rows``, over every pool
        (``blocks``: each row's image runs over its tokens, or None: ``StepBatch``'s)."""
        window = None if self.window_pool is None else (self.window_pool, [r.wseq for r in rows])
        return StepBatch(
            self.pool,
            [r.seq for r in rows],
            tokens,
            self.windows,
            form,
            states=[r.states for r in rows],
            window=window,
            hashed=hashed,
            blocks=blocks,
        )

    def rewind(self, request: _Request, length: int) -> None:
        """Keep ``request``'s first ``length`` tokens in every pool."""
        self.pool.rewind(request.seq, length)
        if request.wseq is not None:
            self.window_pool.rewind(request.wseq, length)

    def hash_full(self, request: _Request) -> None:
        """Hash ``request``'s full blocks in every pool (a flight's, once every rank wrote them)."""
        self.pool.hash_full(request.seq)
        if request.wseq is not None:
            self.window_pool.hash_full(request.wseq)

    def stores(self) -> list:
        """Every pool's arrays, to evaluate with the step that wrote them."""
        return [p.keys + p.values for p in self.all()]

    def release(self, request: _Request) -> None:
        """Give back the request's blocks in every pool (its draft model's and MTP head's too)."""
        if request.seq is not None:
            self.pool.release(request.seq)
        if request.wseq is not None:
            self.window_pool.release(request.wseq)
        if isinstance(request.drafter, DraftPool):
            request.drafter.release(request)
        if self.head_pool is not None:
            self.head_pool.release(request)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.all())
