"""Prompt caches: a layer cache list plus the tokens it holds.

Reusing a cache across requests (chat turns, a server's shared prefixes) comes
down to one rule: keep the longest common prefix of the cached tokens and the
new prompt, trim the rest, and feed only the new suffix.

A recurrent layer's state cache cannot trim: it holds no entry per token. A
cache list with one keeps *checkpoints* instead (snapshots taken where a prompt
was prefilled, :meth:`PromptCache.checkpoint`), and reuse goes back to the
latest checkpoint within the common prefix, feeding the rest again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from ..errors import WeightsError
from ..files.atomic import writing_file
from .kv import (
    KVCache,
    LatentKVCache,
    LayerCache,
    StateCache,
    is_trimmable,
    restore_cache,
    snapshot_cache,
    trim_cache,
)
from .quantized import QuantizedKVCache
from .rotating import RotatingKVCache

# Checkpoints a cache list with state caches keeps (the newest): one per prompt prefilled,
# each the state arrays' references plus an offset per KV layer, so a few are cheap.
MAX_CHECKPOINTS = 8

Snapshot = tuple[int, list[Any]]  # (tokens held, each layer's snapshot)

# The kinds a cache file may name (save_cache writes each layer's class name), each with the
# meta_state and state setters load_cache uses.
Stored = KVCache | RotatingKVCache | QuantizedKVCache | StateCache
# Those made without arguments; a RotatingKVCache takes its size from the file (load_cache).
_KINDS: dict[str, Callable[[], Stored]] = {
    cls.__name__: cls for cls in (KVCache, QuantizedKVCache, LatentKVCache, StateCache)
}


class PromptCache:
    """Per-layer caches and the token ids they were filled with."""

    def __init__(self, cache: list[LayerCache], tokens: list[int] | None = None):
        self.cache = cache
        self.tokens: list[int] = list(tokens or [])
        self.checkpoints: list[Snapshot] = []  # where reuse() may go back to (state caches)

    def reuse(self, prompt: list[int]) -> list[int]:
        """Trim to the longest common prefix with ``prompt``; return the ids still to feed.

        At least one token is always left to feed, since its logits start decoding.
        """
        n = 0
        for a, b in zip(self.tokens, prompt):
            if a != b:
                break
            n += 1
        n = min(n, len(prompt) - 1)
        drop = len(self.tokens) - n
        if drop and any(isinstance(c, StateCache) for c in self.cache):
            # State caches cannot drop tokens: back to the latest checkpoint in the prefix.
            n = self._back_to_checkpoint(n)
        elif drop and (not is_trimmable(self.cache) or trim_cache(self.cache, drop) != drop):
            # Cannot rewind (e.g. a rotating cache that already evicted): start over.
            self._start_over()
            n = 0
        self.tokens = self.tokens[:n]
        self.checkpoints = [p for p in self.checkpoints if p[0] <= n]
        return prompt[n:]

    def _back_to_checkpoint(self, n: int) -> int:
        """Restore the latest checkpoint holding at most ``n`` tokens (start over if none can
        be restored); returns the tokens now held."""
        for point in reversed(self.checkpoints):
            if point[0] <= n:
                try:
                    self.restore(point)
                    return point[0]
                except ValueError:  # a rotating cache evicted what the checkpoint held
                    break
        self._start_over()
        return 0

    def _start_over(self) -> None:
        self.cache = [_fresh(c) for c in self.cache]
        self.tokens, self.checkpoints = [], []

    def snapshot(self) -> Snapshot:
        """This point, for :meth:`restore` (see ``Cache.snapshot``)."""
        return len(self.tokens), snapshot_cache(self.cache)

    def restore(self, snapshot: Snapshot) -> None:
        """Back to ``snapshot``, taken on this cache at most as many tokens ago as it holds."""
        n, layers = snapshot
        restore_cache(self.cache, layers)
        self.tokens = self.tokens[:n]
        self.checkpoints = [p for p in self.checkpoints if p[0] <= n]

    def checkpoint(self) -> None:
        """Remember this point for a later :meth:`reuse` to go back to; only where a state
        cache cannot trim (the KV caches of other models trim to any point)."""
        if not any(isinstance(c, StateCache) for c in self.cache):
            return
        n = len(self.tokens)
        kept = [p for p in self.checkpoints if p[0] < n][-(MAX_CHECKPOINTS - 1) :]
        self.checkpoints = kept + [self.snapshot()]

    def rewind(self, n: int) -> None:
        """Keep only the first ``n`` tokens (speculative decoding drops rejected drafts).

        Each layer is trimmed to ``n`` on its own, since layers may hold
        different counts mid-step (a self-draft writes only the first layers).
        """
        for c in self.cache:
            held = c.offset
            if held > n and c.trim(held - n) != held - n:
                raise ValueError(f"cannot rewind a {type(c).__name__} holding {held} tokens to {n}")
        self.tokens = self.tokens[:n]
        self.checkpoints = [p for p in self.checkpoints if p[0] <= n]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)

    def save(self, path: Path) -> None:
        save_cache(path, self.cache, {"tokens": ",".join(map(str, self.tokens))})

    @classmethod
    def load(cls, path: Path) -> "PromptCache":
        cache, meta = load_cache(path)
        tokens = [int(t) for t in meta.get("tokens", "").split(",") if t]
        return cls(cache, tokens)


def _fresh(c: LayerCache) -> LayerCache:
    """An empty cache of the same kind and settings."""
    if isinstance(c, RotatingKVCache):
        return RotatingKVCache(c.max_size, c.keep)
    if isinstance(c, QuantizedKVCache):
        return QuantizedKVCache(c.group_size, c.bits)
    if isinstance(c, StateCache):
        return StateCache(len(c.arrays))
    return type(c)()


def save_cache(
    path: Path,
    cache: list[LayerCache],
    metadata: dict[str, str] | None = None,
    sections: dict[str, tuple[list[LayerCache], dict[str, str]]] | None = None,
) -> None:
    """Write a cache to a safetensors file (atomically: temp file, fsync, rename; atomic.py).

    ``sections``: name -> (another cache list, its metadata) (an MTP head's: ``prompt_file.py``),
    kept under ``name.`` in the same file; :func:`read_cache_file`, :func:`cache_from` and
    :func:`user_metadata` read them back, :func:`load_cache` passes over them."""
    path = Path(path)
    arrays, meta = _entries(cache, metadata)
    for name, (more, more_meta) in (sections or {}).items():
        if not name.isidentifier() or name in ("user", "kinds"):
            raise ValueError(f"a cache file section cannot be named {name!r}")
        named = _entries(more, more_meta, f"{name}.")
        arrays.update(named[0])
        meta.update(named[1])
    with writing_file(path) as tmp:  # ends in path's suffix: mlx appends .safetensors to others
        mx.save_safetensors(str(tmp), arrays, metadata=meta)
        if tmp.suffix != ".safetensors":
            os.replace(f"{tmp}.safetensors", tmp)


def _entries(
    cache: list[LayerCache], user: dict[str, str] | None, prefix: str = ""
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and metadata that keep ``cache`` and ``user``, each name after ``prefix``."""
    arrays = {f"{prefix}{i}.{j}": a for i, c in enumerate(cache) for j, a in enumerate(c.state)}
    meta = {f"{prefix}kinds": ",".join(type(c).__name__ for c in cache)}
    for i, c in enumerate(cache):
        meta.update({f"{prefix}{i}.{k}": v for k, v in c.meta_state.items()})
    meta.update({f"{prefix}user.{k}": v for k, v in (user or {}).items()})
    return arrays, meta


def load_cache(path: Path) -> tuple[list[LayerCache], dict[str, str]]:
    """Read a cache written by :func:`save_cache`; returns (cache, user metadata)."""
    arrays, meta = read_cache_file(path)
    return cache_from(arrays, meta), user_metadata(meta)


def read_cache_file(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """A cache file's arrays and metadata, for :func:`cache_from` (a WeightsError if MLX cannot
    read it)."""
    try:
        # cast: with return_metadata, mlx returns (arrays, metadata) and no other of its kinds
        return cast(
            "tuple[dict[str, mx.array], dict[str, str]]",
            mx.load(str(path), format="safetensors", return_metadata=True),
        )
    except Exception as e:  # mlx raises RuntimeError/ValueError for bad files
        raise WeightsError(f"{path}: not a readable cache file ({e})") from None


def user_metadata(meta: dict[str, str], section: str = "") -> dict[str, str]:
    """The metadata :func:`save_cache` was given, or ``section``'s."""
    prefix = f"{section}.user." if section else "user."
    return {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}


def cache_from(arrays: dict[str, mx.array], meta: dict[str, str], section: str = "") -> list:
    """The cache list a file's arrays and metadata keep: its own, or ``section``'s
    (:func:`save_cache`'s ``sections``; a KeyError when it has none)."""
    prefix = f"{section}." if section else ""
    cache: list[LayerCache] = []
    for i, kind in enumerate(meta[f"{prefix}kinds"].split(",")):
        at = f"{prefix}{i}."
        layer_meta = {k[len(at) :]: v for k, v in meta.items() if k.startswith(at)}
        c: Stored = (
            RotatingKVCache(int(layer_meta["max_size"]))
            if kind == "RotatingKVCache"
            else _KINDS[kind]()
        )
        if layer_meta:
            c.meta_state = layer_meta
        state = [arrays[f"{at}{j}"] for j in range(6) if f"{at}{j}" in arrays]
        if state:
            c.state = state
        cache.append(c)
    return cache
