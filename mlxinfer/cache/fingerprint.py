"""A model's fingerprint: what must match for keys and values stored on disk (the prefix
cache's blocks, a prompt cache file) to be this model's.

It hashes the model's family and configuration, how the keys are stored (the pool's block
size and each layer's KV heads, widths, dtype, KV bits and group size; a prompt cache's
kv_bits), the weights' dtypes, and the files the
model was loaded from (``model.source_dir``, set by the loader): the SHA-256 sums of its
manifest (``mlxinfer-manifest.json``: config, tokenizer, weights) where there is one, else
each file's SHA-256, computed once and kept under the cache directory by path, size and
mtime. A model built in memory (no directory) is known by a sample of its weights instead:
every parameter's name, shape, dtype and 1,024 of its values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import WeightsError
from ..files.atomic import write_text
from ..files.manifest import read_manifest, sha256_file

# The files of a model directory that decide its outputs (the rest: READMEs, a GGUF beside).
_PATTERNS = ("*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.jinja", "*.txt")
_SAMPLES = 1024  # values per parameter hashed for a model without a directory


def model_fingerprint(model, storage: dict[str, Any], cache_dir: Path) -> str:
    """The hex fingerprint of ``model`` with its keys and values kept as ``storage`` says (any
    JSON: the pool's layout, a prompt cache's kv_bits); file sums are kept under ``cache_dir``."""
    h = hashlib.sha256()

    def part(name: str, value) -> None:
        h.update(f"{name}={json.dumps(value, sort_keys=True, default=str)}\n".encode())

    part("model", f"{type(model).__module__}.{type(model).__name__}")
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type):  # an instance, not a class
        part("args", dataclasses.asdict(args))
    else:
        part("args", repr(args))
    part("storage", storage)
    # cast: tree_flatten returns a list of (name, leaf) here (a dict only given a destination)
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    part("dtypes", sorted({str(a.dtype) for _, a in params}))
    source = getattr(model, "source_dir", None)
    if source is not None:
        part("files", file_sums(Path(source), cache_dir))
    else:
        part("weights", sampled_weights(params))
    return h.hexdigest()


def file_sums(model_dir: Path, cache_dir: Path) -> dict[str, str]:
    """{file: SHA-256} of the model directory: its manifest's, or computed (and cached)."""
    try:
        listed = read_manifest(model_dir)
    except WeightsError:
        listed = None
    if listed is not None:
        return {name: entry["sha256"] for name, entry in listed.items()}
    names = sorted({p for pattern in _PATTERNS for p in model_dir.glob(pattern) if p.is_file()})
    return {p.name: cached_sum(p, cache_dir) for p in names}


def cached_sum(path: Path, cache_dir: Path) -> str:
    """``path``'s SHA-256, from ``cache_dir/file-sums/`` when its size and mtime still match
    what was recorded there; computed and recorded otherwise."""
    st = path.stat()
    real = os.path.realpath(path)
    record = cache_dir / "file-sums" / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")
    key = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        if record.stat().st_size < 4096:
            kept = json.loads(record.read_text())
            if isinstance(kept, dict) and all(kept.get(k) == v for k, v in key.items()):
                digest = kept.get("sha256")
                if isinstance(digest, str) and len(digest) == 64:
                    return digest
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    try:
        write_text(record, json.dumps({**key, "sha256": digest}))
    except OSError:
        pass  # a read-only cache directory: computed again next time
    return digest


def sampled_weights(params: list[tuple[str, mx.array]]) -> str:
    h = hashlib.sha256()
    for name, a in sorted(params, key=lambda p: p[0]):
        flat = a.reshape(-1)
        if flat.size > _SAMPLES:
            flat = flat[mx.array(np.linspace(0, flat.size - 1, _SAMPLES).astype(np.uint32))]
        if flat.dtype == mx.bfloat16:
            flat = flat.view(mx.uint16)
        h.update(f"{name}:{a.shape}:{a.dtype}:".encode())
        h.update(np.array(flat).tobytes())
    return h.hexdigest()
