"""A model directory's manifest: the size and SHA-256 of every file, written last.

``convert``, the GGUF import and the default-model fetch write
``mlxinfer-manifest.json`` as the last file of the temporary directory, before it is
renamed into place::

    {"format": "mlxinfer-manifest", "version": 1,
     "files": {"config.json": {"size": 712, "sha256": "…"}, "model.safetensors": {…}, …}}

Loading compares the sizes (a ``stat`` per file: a truncated or grown file is a
one-line :class:`WeightsError`); :func:`verify` (``mlxinfer verify DIR``) also
compares the sums. A directory without a manifest (converted before manifests, or
by another tool) loads as before; :func:`verify` says it has none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import WeightsError

MANIFEST_NAME = "mlxinfer-manifest.json"
FORMAT = "mlxinfer-manifest"
VERSION = 1
_MAX_BYTES = 16 << 20  # a manifest is a few hundred bytes per file; refuse a hostile giant
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _files(model_dir: Path) -> list[str]:
    """Every regular file under ``model_dir`` but the manifest, as sorted POSIX relative paths."""
    out = []
    for here, dirs, files in os.walk(model_dir):
        dirs.sort()
        for name in files:
            rel = (Path(here) / name).relative_to(model_dir).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(model_dir: Path) -> dict:
    """Write ``model_dir``/mlxinfer-manifest.json for the files there now; returns its content."""
    model_dir = Path(model_dir)
    files = {
        rel: {"size": (model_dir / rel).stat().st_size, "sha256": sha256_file(model_dir / rel)}
        for rel in _files(model_dir)
    }
    manifest = {"format": FORMAT, "version": VERSION, "files": files}
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(model_dir: Path) -> dict[str, dict] | None:
    """``{relative path: {"size", "sha256"}}`` from the manifest; None when there is none.

    Raises:
      WeightsError: the manifest is not one (bad JSON, wrong shape, a path outside the directory).
    """
    path = Path(model_dir) / MANIFEST_NAME
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size > _MAX_BYTES:
        raise WeightsError(f"{path}: {size} bytes; a manifest is at most {_MAX_BYTES}")
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise WeightsError(f"{path}: expected format '{FORMAT}', found {found!r}")
    version = data.get("version")
    if type(version) is not int or version < 1:
        raise WeightsError(f"{path}: expected an integer version >= 1, found {version!r}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise WeightsError(f"{path}: 'files' must be an object, found {type(files).__name__}")
    for name, entry in files.items():
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts or "\\" in name or ":" in name:
            raise WeightsError(
                f"{path}: file name {name!r} is not a path inside the model directory"
            )
        size_ok = isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
        if (
            not size_ok
            or not isinstance(entry.get("sha256"), str)
            or not _SHA256.match(entry["sha256"])
        ):
            raise WeightsError(
                f'{path}: entry \'{name}\': expected {{"size": int >= 0, "sha256": 64 hex digits}}, '
                f"found {json.dumps(entry)[:80]}"
            )
    return files


def _size_problem(model_dir: Path, name: str, expected: int) -> str | None:
    path = Path(model_dir) / name
    try:
        found = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing (listed in {MANIFEST_NAME} with {expected} bytes)"
    if found != expected:
        return f"{path}: size {found} bytes, expected {expected} ({MANIFEST_NAME}); the file is damaged"
    return None


def check_sizes(model_dir: Path) -> None:
    """Compare every file's size with the manifest (nothing to do without one).

    Raises:
      WeightsError: a file is missing or its size differs, naming it and both sizes.
    """
    files = read_manifest(model_dir)
    for name, entry in (files or {}).items():
        if problem := _size_problem(model_dir, name, entry["size"]):
            raise WeightsError(problem)


@dataclass
class Verification:
    """What :func:`verify` found.

    ``has_manifest``: False for a directory without one (nothing was checked).
    ``problems``: one line per damaged or missing file (empty: every file matches).
    ``unlisted``: files in the directory the manifest does not name (added later).
    """

    path: Path
    has_manifest: bool
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.has_manifest and not self.problems


def verify(model_dir: str | os.PathLike) -> Verification:
    """Check every file of ``model_dir`` against its manifest: size, then SHA-256.

    Raises:
      WeightsError: ``model_dir`` is not a directory, or its manifest is malformed.
    """
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise WeightsError(f"{model_dir}: not a model directory")
    files = read_manifest(model_dir)
    if files is None:
        return Verification(model_dir, has_manifest=False)
    result = Verification(model_dir, has_manifest=True, files=len(files))
    for name, entry in sorted(files.items()):
        if problem := _size_problem(model_dir, name, entry["size"]):
            result.problems.append(problem)
            continue
        result.bytes += entry["size"]
        digest = sha256_file(model_dir / name)
        if digest != entry["sha256"]:
            result.problems.append(
                f"{model_dir / name}: SHA-256 {digest}, expected {entry['sha256']} "
                f"({MANIFEST_NAME}); the file is damaged"
            )
    result.unlisted = [rel for rel in _files(model_dir) if rel not in files]
    return result


def existing_output_error(dst: Path) -> str:
    """The one-line refusal for a destination that is not empty: whether it holds a complete
    model (its manifest's sizes match) or something else."""
    try:
        files = read_manifest(dst) if Path(dst).is_dir() else None
    except WeightsError:
        files = None
    if files and not any(_size_problem(dst, n, e["size"]) for n, e in files.items()):
        return (
            f"{dst}: a complete model already exists there ({len(files)} files match its "
            f"{MANIFEST_NAME}); remove it to write it again"
        )
    if not Path(dst).is_dir():
        return f"{dst}: output path exists and is not a directory"
    return f"{dst}: output directory already exists and is not empty"
