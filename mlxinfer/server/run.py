"""Running an app under uvicorn with its limits, and stopping it within seconds.

uvicorn's graceful shutdown waits for every open connection to close, for ever by default: an
open stream would hold a SIGTERM off until it ends. Here a shutdown first cancels every request
in flight (the engines close: the requests running or waiting end at their next step, a stream
with an error event, a whole response with an error), then lets uvicorn close the connections
as their responses end, cutting those still open after ``shutdown_timeout`` seconds.
"""

from __future__ import annotations

import anyio
import uvicorn


class Server(uvicorn.Server):
    also: list[tuple[str, int]] = []  # more (host, port) listeners

    def run(self, sockets=None) -> None:
        if self.also and sockets is None:  # every listener bound here, then served together
            configs = [self.config] + [_same(self.config, h, p) for h, p in self.also]
            sockets = [c.bind_socket() for c in configs]
        super().run(sockets=sockets)

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        app.state.stopping = True  # requests arriving now get a 503
        timeout = app.state.limits.shutdown_timeout
        # Engines join their threads: off the event loop, which still sends the last events.
        await anyio.to_thread.run_sync(app.state.models.close, timeout)
        await super().shutdown(sockets)


def server(
    app, host: str, port: int, log_level: str = "info", also: list[tuple[str, int]] = ()
) -> Server:
    """A uvicorn server for ``app`` (from ``make_app``): h11, whose parser bounds a request's
    head (``Limits.h11_limit``), and the shutdown above; ``also``: more ``(host, port)`` to
    listen on."""
    limits = app.state.limits
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http="h11",  # httptools does not bound the headers it buffers
        h11_max_incomplete_event_size=limits.h11_limit,
        timeout_graceful_shutdown=limits.shutdown_timeout,
    )
    out = Server(config)
    out.also = [(h, p) for h, p in also if (h, p) != (host, port)]
    return out


def _same(config: uvicorn.Config, host: str, port: int) -> uvicorn.Config:
    """``config`` for another address (only its socket is used)."""
    return uvicorn.Config(config.app, host=host, port=port, log_level=config.log_level)
