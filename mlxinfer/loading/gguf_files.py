"""A ``.gguf`` file given where a model directory is expected (``load``, ``generate -m``,
``serve -m``): imported once (:func:`mlxinfer.gguf.import_gguf`, exact types kept) into
``<cache>/models/gguf/<stem>-<key>``, where the key follows the file's path, size and
modification time, so an edited or replaced file is imported again; then loaded from there."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, MlxInferError
from ..platform.machine import user_cache_dir
from .default_model import intact_import, is_model_dir

MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """A file named ``*.gguf`` or starting with GGUF's magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def model_dir_for(
    path: Path, cache_dir: Path | None = None, *, log: Callable[[str], None] | None = None
) -> Path:
    """The model directory for the file ``path``: its import for a GGUF (made now if there is
    none yet); any other file is a ConfigError naming it."""
    path = Path(path).expanduser().resolve()
    if not is_gguf_file(path):
        raise ConfigError(
            f"{path}: a file, expected a model directory (config.json, weights, tokenizer) or a "
            ".gguf file"
        )
    from ..gguf import import_gguf

    say = log or (lambda message: None)
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    dst = root / "models" / "gguf" / f"{path.stem}-{key}"
    if intact_import(dst, say, f"Damaged import of {path.name} ({{}}); importing it again"):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    say(f"Importing {path} into {dst} (once)")
    try:
        import_gguf(path, dst)
    except (MlxInferError, OSError):
        if is_model_dir(dst):  # another process finished the same import first
            return dst
        raise
    return dst
