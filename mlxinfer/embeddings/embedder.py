"""An embedding model as the server's registry holds it, in place of a generation engine."""

from __future__ import annotations

import threading

from .checkpoint import Pooling
from .forward import check_width, embed_ids


class Embedder:
    """One forward at a time (the lock), with the counters ``/metrics`` reads."""

    alive = True
    failure = None

    def __init__(self, model, tokenizer, pooling: Pooling) -> None:
        check_width(model, pooling)
        self.model, self.tokenizer, self.pooling = model, tokenizer, pooling
        self._lock = threading.Lock()  # one forward at a time
        self._count = threading.Lock()  # the counters
        self.running = self.waiting = self.done = self.tokens = 0

    def embed(self, rows: list[list[int]], dimensions: int | None = None, cancelled=None):
        """:func:`~.forward.embed_ids` of ``rows`` (checked: :func:`~.inputs.encode_inputs`),
        after the forwards other threads asked for first."""
        self._counted(waiting=1)
        with self._lock:
            self._counted(waiting=-1, running=1)
            try:
                return embed_ids(
                    self.model, rows, self.pooling, dimensions=dimensions, cancelled=cancelled
                )
            finally:
                self._counted(running=-1, done=1, tokens=sum(len(r) for r in rows))

    def _counted(self, **changes: int) -> None:
        with self._count:
            for name, change in changes.items():
                setattr(self, name, getattr(self, name) + change)

    def metrics(self) -> dict[str, float]:
        return {
            "requests_running": self.running,
            "requests_waiting": self.waiting,
            "requests_done": self.done,
            "prompt_tokens": self.tokens,
            "kv_bytes": 0,
        }

    def close(self, timeout: float | None = None) -> None:
        pass
