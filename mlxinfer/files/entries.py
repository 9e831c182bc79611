"""A small JSON file of entries kept per machine ({key: entry}): the BLAS check's verdicts and the
CPU backend's decode plans. Read whole; one entry added by rewriting the file atomically.

A file that is missing or unreadable reads as empty, and one that cannot be written is skipped:
what it caches is then worked out again next time, and the library prints nothing.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_entries(path: Path) -> dict:
    """What the file at ``path`` holds, {key: entry} (empty if it is missing or unreadable)."""
    try:
        known = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def store_entry(path: Path, key: str, entry: dict) -> None:
    """Add (or replace) one entry: temporary file, fsync, rename (``atomic.write_text``)."""
    write_entries(path, {**read_entries(path), key: entry})


def write_entries(path: Path, data: dict) -> None:
    """Replace the file's entries with ``data``; skipped if it cannot be written."""
    from ..errors import MlxInferError
    from .atomic import write_text

    try:
        write_text(Path(path), json.dumps(data, indent=1, sort_keys=True, default=str))
    except (OSError, MlxInferError):
        pass
