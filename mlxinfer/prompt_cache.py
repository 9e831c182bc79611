"""Prompt caches: a layer cache list plus the tokens it holds.

Reusing a cache across requests (chat turns, a server's shared prefixes) comes
down to one rule: keep the longest common prefix of the cached tokens and the
new prompt, trim the rest, and feed only the new suffix.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .cache import _KINDS, Cache, QuantizedKVCache, RotatingKVCache, trim_cache
from .errors import WeightsError


class PromptCache:
    """Per-layer caches and the token ids they were filled with."""

    def __init__(self, cache: list[Cache], tokens: list[int] | None = None):
        self.cache = cache
        self.tokens: list[int] = list(tokens or [])

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
        if drop and (
            not all(c.is_trimmable() for c in self.cache) or trim_cache(self.cache, drop) != drop
        ):
            # Cannot rewind (e.g. a rotating cache that already evicted): start over.
            self.cache = [_fresh(c) for c in self.cache]
            n = 0
        self.tokens = self.tokens[:n]
        return prompt[n:]

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


def _fresh(c: Cache) -> Cache:
    """An empty cache of the same kind and settings."""
    if isinstance(c, RotatingKVCache):
        return RotatingKVCache(c.max_size, c.keep)
    if isinstance(c, QuantizedKVCache):
        return QuantizedKVCache(c.group_size, c.bits)
    return type(c)()


def save_cache(path: Path, cache: list[Cache], metadata: dict[str, str] | None = None) -> None:
    """Write a cache to a safetensors file (atomically: temp file, then rename)."""
    path = Path(path)
    arrays = {f"{i}.{j}": a for i, c in enumerate(cache) for j, a in enumerate(c.state)}
    meta = {"kinds": ",".join(type(c).__name__ for c in cache)}
    for i, c in enumerate(cache):
        meta.update({f"{i}.{k}": v for k, v in c.meta_state.items()})
    meta.update({f"user.{k}": v for k, v in (metadata or {}).items()})
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata=meta)
    tmp.replace(path)


def load_cache(path: Path) -> tuple[list[Cache], dict[str, str]]:
    """Read a cache written by :func:`save_cache`; returns (cache, user metadata)."""
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError for bad files
        raise WeightsError(f"{path}: not a readable cache file ({e})") from None
    cache: list[Cache] = []
    for i, kind in enumerate(meta["kinds"].split(",")):
        layer_meta = {k.split(".", 1)[1]: v for k, v in meta.items() if k.startswith(f"{i}.")}
        c = (
            RotatingKVCache(int(layer_meta["max_size"]))
            if kind == "RotatingKVCache"
            else _KINDS[kind]()
        )
        if layer_meta:
            c.meta_state = layer_meta
        state = [arrays[f"{i}.{j}"] for j in range(6) if f"{i}.{j}" in arrays]
        if state:
            c.state = state
        cache.append(c)
    user = {k[5:]: v for k, v in meta.items() if k.startswith("user.")}
    return cache, user
