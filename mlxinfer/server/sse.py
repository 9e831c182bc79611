"""An SSE response that notices when its client goes away, and keeps quiet streams alive.

The lines come from a blocking iterator over the engine's results (one request). Each line is
read in a worker thread of the app's generation work (``limits.Work``); between two lines the
client's connection is checked (at most every ``CHECK_S`` while lines come quickly: each check
is a receive under a cancel scope, and it was most of the event loop's work a token), and while
a line is slow to come (a request waiting for room in the batch, a long prefill) a keep-alive is
sent every ``every`` seconds, so proxies and clients with read timeouts do not hang up.
When the client is gone the iterator is closed, which cancels the request in the engine and
frees its blocks. (uvicorn drops writes to a closed connection without an error, so without
the check the request would run to its end.)
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Iterator

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from .limits import in_worker

KEEP_ALIVE_S = 15.0
CHECK_S = 0.2  # while lines come quickly, the connection checked at most this often
COMMENT = ": keep-alive\n\n"  # an SSE comment: clients skip it
_END = object()


def streamed(
    request: Request,
    lines: Iterator[str],
    keep_alive: str = COMMENT,
    every: float | None = None,
    on_close: Callable[[], None] | None = None,
) -> StreamingResponse:
    """``lines`` as an SSE response; ``on_close()`` once it has ended, however it ended."""
    every = KEEP_ALIVE_S if every is None else every
    return StreamingResponse(
        _lines(request, lines, keep_alive, every, on_close),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(on_close) if on_close is not None else None,
    )


async def _lines(
    request: Request,
    lines: Iterator[str],
    keep_alive: str,
    every: float,
    on_close: Callable[[], None] | None,
) -> AsyncIterator[str]:
    pending = None
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            pending = asyncio.ensure_future(in_worker(request, next, lines, _END))
            while not (await asyncio.wait({pending}, timeout=every))[0]:
                if await request.is_disconnected():
                    return
                yield keep_alive
            line, pending = pending.result(), None
            if line is _END:
                return
            if loop.time() - checked >= CHECK_S:
                if await request.is_disconnected():
                    return
                checked = loop.time()
            yield line
    finally:
        with anyio.CancelScope(shield=True):
            if pending is not None:  # a read in flight ends within one token's wait
                await asyncio.wait({pending})
            await in_worker(request, lines.close)
            if on_close is not None:
                on_close()
