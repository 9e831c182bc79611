"""Where the store keeps things, under the cache root (``MLXINFER_CACHE``, or ``MLXINFER_HOME``;
default the user cache folder, where the default model lives too)::

    <cache>/store/<org>/<name>/<variant>/   one model: its files, mlxinfer-manifest.json and
                                            mlxinfer-source.json (where it came from)
    <cache>/store/.downloads/<org>/<name>/<commit>/   a pull's source files while it runs (kept
                                            after a kill, so the next pull resumes them)
    <cache>/store/.work/                    conversions in progress (a killed one's is removed)
    <cache>/store/server.json               the server ``serve`` last started (``ps``, ``stop``)

Names map onto directories by loading's :func:`~mlxinfer.loading.loader.store_path` (lower case;
an alias lives under ``library``), the one rule model resolution uses too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files.atomic import write_text
from ..files.manifest import FORMAT, MANIFEST_NAME, VERSION, sha256_file, write_manifest
from ..loading.loader import STORE_DIR
from ..platform.machine import user_cache_dir
from .names import ModelName, StoreError

SOURCE_NAME = "mlxinfer-source.json"
SOURCE_FORMAT = "mlxinfer-source"
_MAX_RECORD = 16 << 20  # a record lists a few files; refuse a hostile giant


def store_root(cache_dir: Path | None = None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else user_cache_dir()) / STORE_DIR


def downloads_dir(name: ModelName, root: Path) -> Path:
    return root / ".downloads" / (name.org or "library").lower() / name.name.lower()


def inside_store(path: Path, root: Path) -> bool:
    """Whether ``path`` (links resolved) lies strictly inside the store ``root``."""
    try:
        return path.resolve().is_relative_to(root.resolve()) and path.resolve() != root.resolve()
    except OSError:
        return False


def read_source(model_dir: Path) -> dict[str, Any] | None:
    """A model's source record; None when it has none or it is not one."""
    path = model_dir / SOURCE_NAME
    try:
        if path.stat().st_size > _MAX_RECORD:
            return None
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == SOURCE_FORMAT else None


def write_source(model_dir: Path, record: dict[str, Any], listed: dict | None = None) -> None:
    """Write the source record, and the manifest: ``listed`` (the other files' entries, as
    ``read_manifest`` gives them: not hashed again) plus the record's, else every file hashed."""
    write_text(model_dir / SOURCE_NAME, json.dumps({"format": SOURCE_FORMAT, **record}, indent=1))
    if listed is None:
        write_manifest(model_dir)
        return
    rec = model_dir / SOURCE_NAME
    files = {**listed, SOURCE_NAME: {"size": rec.stat().st_size, "sha256": sha256_file(rec)}}
    manifest = {"format": FORMAT, "version": VERSION, "files": files}
    write_text(model_dir / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")


def stored_models(root: Path) -> list[Path]:
    """Every model directory in the store (``<org>/<name>/<variant>`` holding a config.json)."""
    if not root.is_dir():
        return []
    found = []
    for org in sorted(root.iterdir()):
        if org.name.startswith(".") or not org.is_dir() or org.is_symlink():
            continue
        for model in sorted(p for p in org.iterdir() if p.is_dir() and not p.is_symlink()):
            for variant in sorted(p for p in model.iterdir() if p.is_dir() and not p.is_symlink()):
                if not variant.name.startswith(".") and (variant / "config.json").is_file():
                    found.append(variant)
    return found


def stored_name(model_dir: Path, root: Path) -> str:
    """The name a store model is known by: the one it was pulled or copied as, else its
    folders' (``org/name:variant``; ``name:variant`` for an alias)."""
    record = read_source(model_dir)
    if record and isinstance(record.get("name"), str):
        return record["name"]
    org, name, variant = model_dir.relative_to(root).parts
    return f"{org}/{name}:{variant}" if org != "library" else f"{name}:{variant}"


def require(name: ModelName, root: Path) -> Path:
    """The directory of a model that is in the store, else a StoreError naming it."""
    path = name.path(root.parent)
    if not (path / "config.json").is_file():
        raise StoreError(f"{name}: not in the store ({root}); mlxinfer pull {name.repo} first")
    return path
