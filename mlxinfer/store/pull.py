"""``pull``: a Hub repo (or one GGUF quant of it) into the store, converted once.

Steps: resolve the revision to a commit (nothing to do when the store already holds that commit
made with the same recipe); choose the files (:func:`hub.needed_files`); check the free disk
against what is left to download plus the converted output, refusing with the numbers; download
(resumable); convert in ``.work`` with :func:`mlxinfer.convert` (a GGUF keeps its own quant, an
MLX-format repo is kept as it is); add the source record and the manifest; rename into place;
remove the downloaded source unless ``keep_source``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import MlxInferError
from ..files.atomic import discard_dir, fsync_path, scratch_dir
from ..files.manifest import check_sizes, read_manifest
from ..loading.convert import DEFAULT_BPW, convert
from ..loading.memory import size_text
from ..platform.progress import Progress, quiet
from . import hub
from .layout import downloads_dir, read_source, store_root, write_source
from .names import ModelName, StoreError, parse_name
from .others import hf_cache_dir

# The store's default recipe: convert's best (-q: the measured plan at DEFAULT_BPW bits per weight).
DEFAULT_RECIPE: dict[str, Any] = {"quantize": True}
RECIPE_KEYS = {"quantize", "bits", "group_size", "bpw", "recipe", "dtype", "rounding"}


def converter_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxinfer")
    except PackageNotFoundError:
        return "unknown"


def pull(
    name: str,
    progress: Progress | None = None,
    *,
    revision: str | None = None,
    recipe: dict[str, Any] | None = None,
    keep_source: bool = False,
    endpoint: str | None = None,
    token: str | bool | None = None,
    cache_dir: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Pull ``name`` (``org/name`` or ``org/name:QUANT`` for a GGUF repo) into the store.

    Args:
      progress: ``(stage, done, total)``: ``"downloading weights"`` in bytes, then convert's
        stages (:mod:`mlxinfer.platform.progress`); an HTTP route can stream these.
      revision: branch, tag or commit (default ``main``).
      recipe: :func:`mlxinfer.convert`'s quantization keywords for a float checkpoint (default
        ``{"quantize": True}``: the measured plan); not used for a GGUF or an MLX-format repo.
      keep_source: keep the downloaded files (``<store>/.downloads``) after converting.
      endpoint, token: the Hub's (default ``HF_ENDPOINT``, ``HF_TOKEN``).
    Returns:
      The model's source record, plus ``"path"`` and ``"status"`` (``"pulled"`` or
      ``"up to date"``).
    Raises:
      StoreError: a bad name, a refusing Hub (gated: naming HF_TOKEN), too little disk.
    """
    model = parse_name(name)
    if model.org is None:
        raise StoreError(
            f"model name {name!r}: pull takes a Hub repo id, expected 'org/name[:variant]', "
            "found no org"
        )
    recipe = dict(DEFAULT_RECIPE if recipe is None else recipe)
    if unknown := set(recipe) - RECIPE_KEYS:
        raise StoreError(
            f"pull {name}: recipe keys {sorted(unknown)}, expected some of {sorted(RECIPE_KEYS)}"
        )
    say = log or (lambda message: None)
    report = progress or quiet
    root = store_root(cache_dir)
    dst = model.path(root.parent)
    current = read_source(dst)
    if current is not None and _offline():  # the Hub cannot say otherwise: keep what is there
        say(f"{model}: in the store ({current.get('commit', '?')[:12]}); HF_HUB_OFFLINE is set")
        return {**current, "path": str(dst), "status": "up to date"}
    remote = hub.resolve(model.repo, revision, endpoint=endpoint, token=token)
    kind, files = hub.needed_files(remote, model.variant)
    wanted = _recipe_record(kind, recipe)
    if current is not None and _same(current, remote.commit, wanted, kind):
        try:
            check_sizes(dst)
            say(f"{model}: up to date ({remote.commit[:12]})")
            return {**current, "path": str(dst), "status": "up to date"}
        except MlxInferError:  # damaged: pulled again below
            say(f"{model}: damaged in the store; pulling it again")

    source = downloads_dir(model, root) / remote.commit
    with _pull_lock(root, model):
        source.mkdir(parents=True, exist_ok=True)
        _clear_other_commits(source)
        if reused := hub.reuse_cached(remote, files, source, hf_cache_dir()):
            say(f"{model}: {len(reused)} file(s) taken from the Hugging Face cache")
        _check_disk(model, root, files, source)
        hub.download(remote, files, source, endpoint=endpoint, token=token, progress=report)
        if kind == "hf" and _is_mlx(source / "config.json"):
            kind, wanted = "mlx", _recipe_record("mlx", recipe)
        # (scratch_dir removes a killed pull's work of this model on entry)
        with scratch_dir(root / ".work", f"{model.org}-{model.name}") as work:
            out = work / "model"
            if kind == "gguf":
                convert(source / files[0].path, out, progress=report, log=log)
            elif kind == "mlx":
                _keep_as_is(source, out, files)
            else:
                convert(source, out, **recipe, progress=report, log=log)
            record = {
                "name": str(model),
                "repo": remote.repo,
                "revision": revision or "main",
                "commit": remote.commit,
                "kind": kind,
                "files": {
                    f.path: {"size": f.size, "sha256": f.sha256, "blob_id": f.blob_id}
                    for f in files
                },  # fmt: skip
                "recipe": wanted,
                "converter": converter_version(),
                "license": remote.license,
                "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            record["bytes"] = _bytes(out)
            write_source(out, record, read_manifest(out))  # convert's manifest, plus the record
            _place(out, dst)
        if not keep_source:
            shutil.rmtree(source.parent, ignore_errors=True)
    say(f"{model}: pulled {remote.repo}@{remote.commit[:12]} into {dst}")
    return {**read_source(dst), "path": str(dst), "status": "pulled"}


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _recipe_record(kind: str, recipe: dict[str, Any]) -> dict[str, Any]:
    if kind == "gguf":
        return {"gguf": "imported with its own quantization"}
    if kind == "mlx":
        return {"mlx": "kept as published"}
    if recipe.get("quantize") and not set(recipe) & {"bits", "group_size", "bpw", "recipe"}:
        return {**recipe, "bpw": DEFAULT_BPW}
    return recipe


def _same(current: dict, commit: str, wanted: dict, kind: str) -> bool:
    if current.get("commit") != commit:
        return False
    if kind == "hf" and current.get("kind") == "mlx":  # only the download tells; it was MLX
        return True
    return current.get("recipe") == wanted


def _is_mlx(config: Path) -> bool:
    """An MLX-format checkpoint (mlx-lm's or ours): config.json carries MLX's quantization record."""
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("quantization"), dict)


def _keep_as_is(source: Path, out: Path, files: list[hub.RemoteFile]) -> None:
    out.mkdir()
    for f in files:
        target = out / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / f.path, target)  # the same bytes, no copy (one file system)
        except OSError:
            shutil.copyfile(source / f.path, target)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _place(out: Path, dst: Path) -> None:
    """Rename the finished model onto ``dst``; an older one there is discarded first."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        discard_dir(dst)
    os.replace(out, dst)
    fsync_path(dst.parent)


def _check_disk(model: ModelName, root: Path, files: list[hub.RemoteFile], source: Path) -> None:
    """Refuse, naming the numbers, when the disk has not room for what is left to download plus
    the converted output (at most the source's size: conversion keeps or shrinks it)."""
    root.mkdir(parents=True, exist_ok=True)
    download = hub.missing_bytes(files, source)
    output = sum(f.size for f in files)
    free = shutil.disk_usage(root).free
    if download + output > free:
        raise StoreError(
            f"pull {model}: needs {size_text(download + output)} on {root} "
            f"({size_text(download)} to download + {size_text(output)} converted), "
            f"{size_text(free)} free; free some space or set MLXINFER_CACHE to another disk"
        )


def _clear_other_commits(source: Path) -> None:
    """Partial downloads of other commits of this model: a new commit replaces them."""
    for other in source.parent.iterdir():
        if other != source and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)


@contextmanager
def _pull_lock(root: Path, model: ModelName) -> Iterator[None]:
    """One pull of a model at a time (two would append to the same ``.part`` files)."""
    locks = root / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{model.org}--{model.name}.lock".lower(), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"pull {model}: another pull of this model is running") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
