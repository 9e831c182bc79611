"""A request's two sides: what the engine keeps of it, and the caller's handle on it.

The engine thread owns ``_Request``: its sequence in the pool, its sampler and
processors, the token to feed next. The caller holds a :class:`Handle`: it
reads the request's :class:`~mlxinfer.generation.results.Step`s from a queue
(every wait bounded) and may cancel it from any thread.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import mlx.core as mx

from ..generation.results import Step
from ..generation.sampling import LogitsProcessor, Sampler
from .images import RowImages
from .pool import Sequence

POLL_S = 0.5  # how long a wait sleeps before it checks that the engine is still alive


class EngineError(RuntimeError):
    """The engine stopped (closed, or its thread failed) while a request was waiting on it."""


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    sampler: Sampler
    processors: list[LogitsProcessor]
    eos: frozenset[int]
    out: queue.Queue = field(default_factory=queue.Queue)
    seq: Sequence | None = None
    wseq: Sequence | None = None  # its sequence in the window pool (sliding-window layers)
    history: mx.array | None = None  # prompt + generated, for the processors
    pending: int | None = None  # the token to feed next (decode row)
    generated: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    cached_tokens: int = 0  # prompt tokens served from shared prefix blocks
    branch: int = 0  # a recurrent model's: where its shared blocks end past its snapshot
    last_block: Any = None  # and (chain hash, states) at the last block its decoding filled
    # Speculative decoding (None: plain decoding): the drafter (prompt lookup, or a draft
    # model's own cache), how many tokens to draft next, the row's key and this step's key
    # for the acceptance, and prompt + generated tokens.
    drafter: Any = None
    draft_model: Any = None  # the draft model, when the drafter runs one
    draft_seq: Any = None  # its sequence in the draft model's pool, when the drafter is one
    draft_length: Any = None
    key: mx.array | None = None
    accept_key: mx.array | None = None
    tokens: list[int] = field(default_factory=list)
    # A recurrent model's per-request states (StateCache per recurrent layer, in order).
    states: list[Any] = field(default_factory=list)
    # Micro-batched decode across pipeline ranks (flights.py): in a flight, and cancelled there.
    flying: bool = False
    dropped: bool = False
    # A request with images (images.py): their runs, their blocks' salts, their embeddings.
    images: RowImages | None = None

    @property
    def salts(self) -> dict[int, bytes] | None:
        """The salts of its blocks that hold image tokens (None: a text request)."""
        return self.images.salts if self.images is not None else None


class Handle:
    """A submitted request: iterate its :class:`Step`s, or cancel it from any thread."""

    def __init__(self, engine: Any, request: _Request, rid: int) -> None:
        self._engine, self._request, self.id = engine, request, rid

    @property
    def cached_tokens(self) -> int:
        return self._request.cached_tokens

    def cancel(self) -> None:
        self._request.cancelled.set()
        self._engine._wake()

    def _stored(self) -> int:
        """Tokens whose keys the request has stored so far (0 before its admission)."""
        seq = self._request.seq
        return seq.length if seq is not None else 0

    def steps(self, timeout: float | None = None) -> Iterator[Step]:
        """The request's tokens as they come; ends after its last one. ``timeout``: most
        seconds to wait with no progress: no token, and no prefill chunk stored (a long
        prompt's prefill may take longer than ``timeout`` in all; None: as long as the engine
        is alive)."""
        waited, stored = 0.0, self._stored()
        while True:
            try:
                item = self._request.out.get(timeout=POLL_S)
            except queue.Empty:
                waited += POLL_S
                if self._stored() != stored:  # a prefill chunk went in: progress
                    waited, stored = 0.0, self._stored()
                if not self._engine.alive:
                    raise EngineError(
                        f"engine stopped: {self._engine.failure or 'closed'}"
                    ) from None
                if timeout is not None and waited >= timeout:
                    self.cancel()
                    raise TimeoutError(f"request {self.id}: no token within {timeout} s") from None
                continue
            waited, stored = 0.0, self._stored()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Stream:
    """One request's results as they come (``stream_generate``'s), and a way to stop it.

    Iterate it on one thread; :meth:`cancel` may be called from any thread or task: the
    engine drops the request at its next step (within one decode step) and frees its blocks,
    and the iteration ends."""

    def __init__(self, handle: Handle, results: Iterator) -> None:
        self.handle, self._results = handle, results

    def __iter__(self) -> Stream:
        return self

    def __next__(self):
        result = next(self._results)
        result.stats.cached_tokens = self.handle.cached_tokens
        return result

    def cancel(self) -> None:
        self.handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self.handle._request.cancelled.is_set()
