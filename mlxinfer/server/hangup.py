"""Noticing a client that hangs up before its response is ready.

A whole (non-streamed) response is computed in a worker thread (``limits.in_worker``); so is
a stream's start (the wait for room in the batch, the prefill, the first token). Meanwhile the
handler listens on the connection (``request.receive()``, which gives ``http.disconnect``
when the client goes; ``request.is_disconnected()`` never sees it through an
``@app.middleware``), and when the client is gone it cancels the engine requests the worker
started (:class:`Streams`): they end within a decode step and free their blocks. (uvicorn
drops a response to a closed connection without an error, so without this the requests would
run to ``max_tokens``.) A stream's later hang-ups are noticed by its response (``sse``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response

from .limits import in_worker

# Most seconds to wait for the worker once its requests are cancelled (each ends within a decode
# step); past it the handler returns and the worker finishes on its own.
CANCELLED_WAIT_S = 30.0


class Streams:
    """The engine streams one HTTP request started, to cancel when its client hangs up."""

    def __init__(self) -> None:
        self._streams: list[Any] = []
        self._lock = threading.Lock()
        self.gone = False

    def add(self, stream) -> None:
        """Keep ``stream`` (anything with ``cancel()``); cancelled at once if the client left."""
        with self._lock:
            self._streams.append(stream)
            gone = self.gone
        if gone:
            stream.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.gone = True
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()


async def watched(request: Request, fn: Callable, *args) -> Any:
    """``fn(*args, streams)`` in a worker thread; if ``request``'s client hangs up meanwhile,
    the streams ``fn`` added to ``streams`` are cancelled (and its result is sent to no one)."""
    streams = Streams()
    work = asyncio.ensure_future(in_worker(request, fn, *args, streams))
    gone = asyncio.ensure_future(_hung_up(request))
    try:
        # The worker's own waits are bounded (each token within the engine's timeout).
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and gone.exception() is None:  # the client hung up
            streams.cancel()
            await asyncio.wait({work}, timeout=CANCELLED_WAIT_S)
        elif not work.done():  # the connection could not be read: wait as if unwatched
            await asyncio.wait({work})
    finally:
        gone.cancel()
    if not work.done():  # the worker outlived the bound: let it finish unheard
        work.add_done_callback(lambda t: t.exception())
        return Response(status_code=499)  # nginx's "client closed request": no one reads it
    return work.result()


async def _hung_up(request: Request) -> None:
    """Returns when the client has gone (its body was read: nothing else can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
