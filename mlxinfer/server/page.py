"""The chat page at ``/``: the files ``web/`` builds into ``static/`` (``npm ci && npm run
build`` there), served with a Content-Security-Policy that lets only the page's own script
run, whatever the model writes. A client that does not ask for HTML may be answered otherwise
(``other``: Ollama's "Ollama is running", which its clients probe for)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
# KaTeX sets inline styles (so 'unsafe-inline' for styles only); scripts, fonts and requests
# come from this server alone, so the page works offline and model output cannot load or run code.
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "font-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff"}


def add_page(app: FastAPI, other: Callable[[], Response] | None = None) -> None:
    """Serve the chat page at ``/`` and its assets under ``/static``; ``other()`` answers
    ``/`` for a client whose ``Accept`` does not name HTML (browsers' does), when given."""
    index = STATIC / "index.html"

    # HEAD too: Claude Code probes the base URL with one before its first request.
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def page(request: Request):
        if other is not None and "text/html" not in request.headers.get("accept", "").lower():
            return other()
        if not index.is_file():
            return PlainTextResponse(
                f"the chat page is not built: {index} is missing (run `npm ci && npm run build` "
                "in web/)",
                status_code=404,
            )
        return FileResponse(index, headers=HEADERS)

    if STATIC.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC), name="static")
