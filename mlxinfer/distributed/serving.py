"""``serve`` across ranks: rank 0 owns the HTTP server, the other ranks follow its engine.

Every rank loads its part of the model and makes the same batching engine (the same options,
``rank0_requests``). Rank 0 serves as one process does; its engine sends each turn's new
requests, and each decode step's tokens, to the others (``batching.py``), whose engines run
the same forwards and discard what they produce. They end when rank 0's engine closes (a
SIGTERM to rank 0, say) or fails.

A draft model (``--draft-model``) drafts on rank 0 alone (every rank loads it, so that a bad one
fails them all alike), in a pool of its own outside the KV budget with as many blocks as the
target's: it admits whatever the target's pool admits, so the ranks' admissions stay equal.
Each verification step sends its drafts to the others (``batching.py``).

An embedding model (``--embedding-model``) is rank 0's alone: small, it is not split, and its
forwards run on the request's own thread and stream, with no collective (the engine's thread
issues every one), so they neither wait on the ranks nor interleave with their collectives.

Faults: a rank that dies surfaces in rank 0's engine within a turn (it turns at least every
second, idle or not): its running requests end with an error naming the rank, ``/health``
answers 503 with it, and new requests get the API's error; the engine is not remade (the
others are gone). A rank that stalls blocks rank 0's collective, which nothing can wake: past
the rank timeout the watchdog fails every running request with its message, gives their
streams a moment to say so, and ends the process (exit code 3).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from ..errors import DistributedError
from .watchdog import EXIT_CODE

REFUSED = {  # serve's options that do not run across ranks yet
    "models_dir": "--models-dir",
}
GOODBYE_S = 1.0  # how long failed streams get to send their error before a stalled rank ends us


def across_ranks(model) -> bool:
    return model is not None and hasattr(model, "engine_turns")


def check_options(options: dict[str, Any]) -> None:
    """A DistributedError naming the first of ``options`` that does not run across ranks."""
    for key, flag in REFUSED.items():
        if options.get(key):
            raise DistributedError(f"serving across ranks: {flag} is not built yet")


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The part of serve's ``options`` that is the engine's (the same on every rank)."""
    from ..batch.config import ALIASES, NAMES

    return {k: v for k, v in options.items() if k in NAMES or k in ALIASES}


def follow(model, options: dict[str, Any]) -> None:
    """On a rank other than 0: run the engine rank 0's server feeds until it closes; a
    DistributedError if it stopped on a failure (a rank lost)."""
    from ..batch import Engine

    ranks = model.ranks
    engine = Engine(model, **{**options, "rank0_requests": True})
    sys.stderr.write(f"distributed: rank {ranks.rank}/{ranks.size} follows rank 0's server\n")
    while engine._thread.is_alive():
        engine._thread.join(1.0)
    if engine.failure is not None:
        raise DistributedError(f"rank {ranks.rank}: {engine.failure}")


def fail_then_exit(registry) -> Any:
    """The watchdog's ``on_timeout`` for rank 0's server: every request of every engine ends
    with the message, their streams get :data:`GOODBYE_S` to send it, then the process ends."""
    from ..batch import EngineError

    def on_timeout(message: str) -> None:
        sys.stderr.write(f"Error: {message}\n")
        sys.stderr.flush()
        error = EngineError(f"engine stopped: {message}")
        for entry in list(registry.entries.values()):
            engine = entry.engine
            if engine is None or not hasattr(engine, "_running"):
                continue
            engine.failure = engine.failure or DistributedError(message)
            engine._closed = True
            for request in list(engine._running) + list(engine._waiting):
                request.out.put(error)
        time.sleep(GOODBYE_S)
        os._exit(EXIT_CODE)

    return on_timeout


def lead(model, app) -> None:
    """On rank 0: the watchdog fails the app's requests before it ends the process."""
    model.ranks.watchdog.on_timeout = fail_then_exit(app.state.models)
