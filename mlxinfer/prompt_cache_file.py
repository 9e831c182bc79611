"""``--prompt-cache-file F``: one session's prompt cache kept in a file between runs.

``mlxinfer generate`` and ``chat`` resume from ``F`` when it exists and holds this model's
cache: its fingerprint (:mod:`~mlxinfer.fingerprint`: the model, its weights, ``kv_bits`` and
``max_kv_size``) must match, and only the longest common prefix of the tokens it holds and the
new prompt is reused (:meth:`PromptCache.reuse`: a model with recurrent layers reuses it only
when the new prompt extends every token it holds). After the run the cache is written back to
``F`` as safetensors (temp file, fsync, rename).

A file that is not such a cache (truncated, corrupted, another model's or other settings') is
not an error: :func:`open_cache` says why in one line and the run starts cold; the file is
replaced after it.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

from .cache import StateCache
from .errors import MlxInferError
from .fingerprint import model_fingerprint
from .machine import user_cache_dir
from .prompt_cache import PromptCache, load_cache, save_cache
from .safetensors_check import read_header

FORMAT = "mlxinfer-prompt-cache"
VERSION = "1"
MAX_BYTES = 64 << 30  # a cache file larger than this is not read


def cache_fingerprint(model, kv_bits: int | None, max_kv_size: int | None) -> str:
    storage = {"prompt_cache": VERSION, "kv_bits": kv_bits, "max_kv_size": max_kv_size}
    return model_fingerprint(model, storage, user_cache_dir())


def open_cache(
    path: str | os.PathLike, model, *, kv_bits: int | None = None, max_kv_size: int | None = None
) -> tuple[PromptCache, str, str | None]:
    """(the cache to run with, the model's fingerprint for :func:`save`, a warning or None):
    the file's cache when it is this model's, else a fresh one (and why, unless there was no
    file)."""
    fingerprint = cache_fingerprint(model, kv_bits, max_kv_size)
    fresh = PromptCache(model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits))
    path = Path(path)
    if not path.exists():
        return fresh, fingerprint, None
    try:
        pc = _read(path, model, fingerprint, kv_bits, max_kv_size)
    except (
        MlxInferError,
        KeyError,
        ValueError,
        TypeError,
        IndexError,
        AttributeError,
        OSError,
    ) as e:
        reason = " ".join(str(e).removeprefix(f"{path}: ").split())[:300]
        return fresh, fingerprint, f"{path}: not used ({reason}); starting cold"
    return pc, fingerprint, None


def _read(path: Path, model, fingerprint: str, kv_bits, max_kv_size) -> PromptCache:
    if path.stat().st_size > MAX_BYTES:
        raise ValueError(f"{path.stat().st_size} bytes, over {MAX_BYTES}")
    read_header(path)  # its structure, before MLX reads a byte of it
    cache, meta = load_cache(path)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"not an {FORMAT} v{VERSION} file")
    if meta.get("fingerprint") != fingerprint:
        raise ValueError("written for another model or other --kv-bits / --max-kv-size")
    tokens = [int(t) for t in meta.get("tokens", "").split(",") if t]
    expected = model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits)
    kinds = [type(c).__name__ for c in cache]
    if kinds != [type(c).__name__ for c in expected]:
        raise ValueError(f"its {len(kinds)} layer caches are not the model's")
    model(mx.array([[0]], dtype=mx.int32), expected)  # each layer's arrays, one token long
    for i, (c, e) in enumerate(zip(cache, expected)):
        if not isinstance(c, StateCache) and c.offset != len(tokens):
            raise ValueError(f"layer {i} holds {c.offset} tokens, the file lists {len(tokens)}")
        _same_arrays(i, c, e)
    return PromptCache(cache, tokens)


def _same_arrays(i: int, found, expected) -> None:
    """Layer ``i``'s arrays as the model's own: the same count, dtypes and shapes (but the
    length, axis 2, of a cache that grows per token)."""
    a_all = [a for a in found.state if a is not None]
    b_all = [b for b in expected.state if b is not None]
    grows = not isinstance(expected, StateCache)
    ok = len(a_all) == len(b_all) and all(
        a.dtype == b.dtype
        and a.ndim == b.ndim
        and all(x == y for k, (x, y) in enumerate(zip(a.shape, b.shape)) if not (grows and k == 2))
        for a, b in zip(a_all, b_all)
    )
    if not ok:
        shapes = [(tuple(a.shape), str(a.dtype)) for a in a_all]
        raise ValueError(f"layer {i}'s arrays {shapes} are not the model's")


def save(path: str | os.PathLike, pc: PromptCache, fingerprint: str) -> None:
    """Write ``pc`` to ``path`` for a later :func:`open_cache` (atomically)."""
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint}
    meta["tokens"] = ",".join(map(str, pc.tokens))
    save_cache(Path(path), pc.cache, meta)
