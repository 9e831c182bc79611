"""The running server ``ps``, ``stop`` and ``rm`` ask: the one at ``MLXINFER_HOST`` (``host:port``,
as ``OLLAMA_HOST`` works for Ollama), else the one ``serve`` recorded in the store
(:func:`record_server`). Asked over Ollama's API (``GET /api/ps``; ``stop`` is a generate with
``keep_alive: 0``, as ``ollama stop`` sends), each request bounded by :data:`TIMEOUT_S`. A server
started with ``--api-key`` is asked with the same key, read from ``MLXINFER_API_KEY`` (the
variable ``serve`` reads it from).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..files.atomic import write_text
from .layout import store_root
from .names import ModelName, StoreError

HOST_ENV = "MLXINFER_HOST"
KEY_ENV = "MLXINFER_API_KEY"
RECORD_NAME = "server.json"
TIMEOUT_S = 5.0


def record_server(host: str, port: int, *, cache_dir: Path | None = None) -> Path | None:
    """Note the server this process runs (``serve`` calls it as it starts); returns the record's
    path, or None when it cannot be written (a read-only cache: serving goes on without it). A
    record whose process has ended is ignored by :func:`server_url`."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise StoreError(f"record_server: port {port!r}, expected 1..65535")
    path = store_root(cache_dir) / RECORD_NAME
    record = {"host": host, "port": port, "pid": os.getpid(), "started": time.time()}
    try:
        write_text(path, json.dumps(record))
    except OSError:
        return None
    return path


def forget_server(*, cache_dir: Path | None = None) -> None:
    """Remove this process's record (``serve`` at exit); another process's is left."""
    path = store_root(cache_dir) / RECORD_NAME
    record = _read(path)
    if record is not None and record.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_url(*, cache_dir: Path | None = None) -> str | None:
    """``http://host:port`` of the server to ask, or None when there is none to ask."""
    given = os.environ.get(HOST_ENV, "").strip()
    if given:
        url = given if "://" in given else f"http://{given}"
        return url.rstrip("/")
    record = _read(store_root(cache_dir) / RECORD_NAME)
    if record is None or not _alive(record.get("pid")):
        return None
    host, port = record.get("host"), record.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _request(url: str, method: str = "GET", body: dict | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(KEY_ENV, "").strip()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            text = r.read(16 << 20).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        if e.code == 401:
            wanted = "a wrong key was sent" if key else "the server wants an API key"
            raise StoreError(f"{method} {url}: HTTP 401, {wanted}: set {KEY_ENV}") from None
        raise StoreError(f"{method} {url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StoreError(f"{method} {url}: no server answers ({reason})") from None
    last = [line for line in text.splitlines() if line.strip()]  # NDJSON: its last line
    try:
        return json.loads(last[-1]) if last else {}
    except ValueError:
        raise StoreError(f"{method} {url}: expected JSON, found {text[:80]!r}") from None


def running_models(*, cache_dir: Path | None = None) -> list[dict[str, Any]] | None:
    """The models the running server holds in memory (Ollama's ``/api/ps`` entries), or None
    when there is no server to ask."""
    url = server_url(cache_dir=cache_dir)
    if url is None:
        return None
    answer = _request(f"{url}/api/ps")
    models = answer.get("models") if isinstance(answer, dict) else None
    if not isinstance(models, list):
        raise StoreError(f"GET {url}/api/ps: expected {{'models': [...]}}, found {answer!r:.80}")
    return [m for m in models if isinstance(m, dict)]


def stop_model(name: str, *, cache_dir: Path | None = None) -> None:
    """Ask the running server to unload ``name`` now."""
    url = server_url(cache_dir=cache_dir)
    if url is None:
        raise StoreError(f"stop {name}: no running server ({HOST_ENV} unset, none recorded)")
    _request(f"{url}/api/generate", "POST", {"model": name, "keep_alive": 0, "stream": False})


def holds(name: ModelName, *, cache_dir: Path | None = None) -> bool:
    """Whether the running server (if one answers) holds ``name``: under its store name, or
    under its repo's name alone, as ``serve -m org/name`` names it (a same-named model of
    another org then counts too: ``rm`` refuses, never deletes, on a doubt)."""
    try:
        models = running_models(cache_dir=cache_dir)
    except StoreError:  # a server recorded but gone, or one that cannot tell
        return False
    wanted = {_canonical(str(name)), _canonical(f"{name.name}:{name.tag}")}
    return any(
        _canonical(str(m.get("model") or m.get("name") or "")) in wanted for m in models or []
    )


def _canonical(name: str) -> str:
    name = name.lower()
    return name if ":" in name else f"{name}:latest"
