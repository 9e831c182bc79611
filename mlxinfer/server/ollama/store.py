"""Ollama's model-store routes on mlxinfer's store (:mod:`mlxinfer.store`, the one ``mlxinfer
pull``, ``rm`` and ``cp`` use): ``POST /api/pull`` (its progress streamed as NDJSON ``{status,
digest, total, completed}`` lines, as Open WebUI shows them, unless ``stream`` is false),
``DELETE /api/delete`` and ``POST /api/copy``. A name is a Hub repo id, ``org/name[:variant]``
(Ollama's library names such as ``llama3.2`` are not Hub ids: a 400 says so).

A pull runs in a worker thread of its own and is not cancelled when the client goes (it is
resumable: the next pull continues it); its lines are read with a bounded wait, a status line
going out at least every ``STATUS_EVERY_S`` seconds.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path
from typing import Any, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse

from ...errors import MlxInferError
from ..api_errors import OllamaError
from ..limits import in_worker
from ..sse import streamed
from .reply import line
from .request import parse_model

STATUS_EVERY_S = 10.0  # a stream's silence at most, while a conversion runs without progress
_END = object()


class StoreRoutes:
    """``/api/pull``, ``/api/delete``, ``/api/copy``; ``registry``: the served models (one
    loaded here is unloaded before it is deleted, or the delete is refused while it runs)."""

    def __init__(self, registry, body) -> None:
        self.registry, self.body = registry, body

    async def pull(self, request: Request):
        body = await self.body(request)
        name = parse_model(body)
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise OllamaError(400, f"stream: expected true or false, found {type(stream).__name__}")
        lines = _pulling(name)
        if stream:
            response = streamed(request, lines, line({"status": "pulling"}), STATUS_EVERY_S)
            response.headers["content-type"] = "application/x-ndjson"
            return response
        return await in_worker(request, _last, lines)

    async def delete(self, request: Request):
        name = parse_model(await self.body(request))
        return await in_worker(request, self._delete, name)

    def _delete(self, name: str) -> JSONResponse:
        from ... import store

        try:
            path = _stored(name)
            for entry in list(self.registry.entries.values()):
                same = entry.path is not None and Path(entry.path).resolve() == path.resolve()
                if same and entry.engine is not None and not self.registry.unload(entry.name):
                    raise OllamaError(409, f"model '{name}' is running requests here; retry later")
            store.remove(name, force=True)  # held here: checked above, not over HTTP
        except store.StoreError as e:
            raise _store_error(e) from None
        return JSONResponse({"status": "success"})

    async def copy(self, request: Request):
        body = await self.body(request)
        source, destination = body.get("source"), body.get("destination")
        for key, value in (("source", source), ("destination", destination)):
            if not isinstance(value, str) or not value:
                raise OllamaError(400, f"{key}: expected a model name")
        return await in_worker(request, _copy, source, destination)


def _copy(source: str, destination: str) -> JSONResponse:
    from ... import store

    try:
        store.copy(source, destination)
    except store.StoreError as e:
        raise _store_error(e) from None
    return JSONResponse({"status": "success"})


def _stored(name: str) -> Path:
    """The store's folder of ``name``: a StoreError when it is not there."""
    from ...store.layout import require, store_root
    from ...store.names import parse_name

    return require(parse_name(name), store_root())


def _store_error(e: Exception) -> OllamaError:
    message = str(e)
    status = 404 if "not in the store" in message or "not found" in message else 400
    return OllamaError(status, message)


def _pulling(name: str) -> Iterator[str]:
    """The pull's NDJSON lines: "pulling manifest", the stages' progress (bytes downloaded,
    then convert's), "verifying", "success"; an ``{"error"}`` line if it fails. The pull runs
    in a thread of its own; its lines come through a queue."""
    from ... import store

    lines: queue.Queue = queue.Queue(maxsize=1024)
    digest = "sha256:" + hashlib.sha256(name.encode()).hexdigest()

    def put(item: Any) -> None:
        try:
            lines.put_nowait(item)
        except queue.Full:  # a client that stopped reading: progress is dropped, not waited on
            pass

    def progress(stage: str, done: int, total: int) -> None:
        put({"status": stage, "digest": digest, "total": int(total), "completed": int(done)})

    def run() -> None:
        try:
            result = store.pull(name, progress)  # "pulled", or "up to date"
            put({"status": "verifying sha256 digest"})
            put({"status": "success", "detail": result.get("status", "pulled")})
        except (MlxInferError, OSError) as e:
            put(_store_error(e).body() if isinstance(e, store.StoreError) else {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - the stream's last line says what went wrong
            put({"error": f"internal error: {type(e).__name__}: {e}"})
        finally:
            lines.put(_END)

    put({"status": "pulling manifest"})
    threading.Thread(target=run, name=f"pull {name}", daemon=True).start()
    last = {"status": "pulling manifest"}
    while True:
        try:
            item = lines.get(timeout=STATUS_EVERY_S)
        except queue.Empty:
            yield line(last)  # still working: the last status again
            continue
        if item is _END:
            return
        last = item
        yield line(item)


def _last(lines: Iterator[str]) -> JSONResponse:
    """A pull not streamed: its last line, "success" or the error with its status."""
    import json

    out: dict = {}
    for text in lines:
        out = json.loads(text)
    if "error" in out:
        status = 404 if "not found" in out["error"] else 400
        return JSONResponse(out, status_code=status)
    return JSONResponse({"status": out.get("status", "success")})
