"""MLX's per-thread state, released by the thread that made it when that thread ends.

MLX 0.32 keeps, per thread, the streams the thread evaluated on and the
graphs ``mx.compile`` traced there. Left to C++'s thread-exit destructors,
the traced graphs release their Python functions after Python has let go of
the thread: if the interpreter is shutting down by then, that release ends
the process with "terminate called without an active exception". MLX's
remedy is ``mx.clear_streams()`` on the thread before it ends; every
mlxinfer entry point that runs MLX calls :func:`release_at_thread_exit`, so
that any thread that generated (an app's worker, a server's engine thread)
does it as it ends, without the caller doing anything. The main thread is
MLX's own to clean up at exit.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_local = threading.local()


class _Release:
    """Held in a thread-local: Python drops it on the ending thread itself, before ``join`` returns."""

    def __del__(self) -> None:
        mx.clear_streams()


def release_at_thread_exit() -> None:
    """Have the calling thread release its MLX streams and compiled graphs when it ends."""
    if threading.current_thread() is not threading.main_thread() and not hasattr(_local, "release"):
        _local.release = _Release()
