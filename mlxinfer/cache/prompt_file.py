"""``--prompt-cache-file F``: one session's prompt cache kept in a file between runs.

``mlxinfer generate`` and ``chat`` resume from ``F`` when it exists and holds this model's
cache: its fingerprint (:mod:`~mlxinfer.cache.fingerprint`: the model, its weights, ``kv_bits`` and
``max_kv_size``) must match, and only the longest common prefix of the tokens it holds and the
new prompt is reused (:meth:`PromptCache.reuse`: a model with recurrent layers reuses it only
when the new prompt extends every token it holds). After the run the cache is written back to
``F`` as safetensors (temp file, fsync, rename).

A file that is not such a cache (truncated, corrupted, another model's or other settings') is
not an error: :func:`open_cache` says why in one line and the run starts cold; the file is
replaced after it.

With ``--mtp`` (an ``MTP`` draft with ``keep_cache``) the file also keeps the head's own KV
cache, its pairs' tokens and where they start, in a section of the same file (``mtp.``): the
next run's head resumes from it as a chat turn's does, instead of not having seen the prefix.
It is keyed by the head (``MTP.head_digest``: its layout and a sample of its weights) and taken
only when it is that head's and holds the head's arrays; otherwise it is passed over (a ``-v``
line says why) and the head starts where the prefill does, as with a file written without
``--mtp``. Either way the output is the same: the head's drafts are verified.

Across ranks (``--distributed``) each rank holds only its own layers' caches (pipeline) or its
heads' share (tensor), so each rank reads and writes a file of its own, ``F.rank<r>of<s>``
(:func:`rank_path`), whose fingerprint holds the rank's part of the model (``model.part``): a
file written under another split is refused as another model's is. The ranks resume together
or not at all: one all-min over the ranks says whether every rank read its file and all hold
the same tokens; if not, every rank starts cold.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError
from ..files.safetensors_check import read_header
from ..platform.machine import user_cache_dir
from .fingerprint import model_fingerprint
from .kv import StateCache, is_trimmable
from .prompt import PromptCache, cache_from, read_cache_file, save_cache, user_metadata

FORMAT = "mlxinfer-prompt-cache"
VERSION = "1"
MAX_BYTES = 64 << 30  # a cache file larger than this is not read
_UNREADABLE = (MlxInferError, KeyError, ValueError, TypeError, IndexError, AttributeError, OSError)
HEAD_SECTION = "mtp"  # an MTP head's kept cache (MTP.head_state)


def cache_fingerprint(model, kv_bits: int | None, max_kv_size: int | None) -> str:
    storage = {"prompt_cache": VERSION, "kv_bits": kv_bits, "max_kv_size": max_kv_size}
    part = getattr(model, "part", None)  # across ranks: this rank's layers or heads
    if part is not None:
        storage["part"] = part
    return model_fingerprint(model, storage, user_cache_dir())


def rank_path(path: str | os.PathLike, model) -> Path:
    """This process's file for ``path``: ``path`` itself in one process, ``path.rank<r>of<s>``
    on rank r of s (``model.ranks``, a distributed model's)."""
    ranks = getattr(model, "ranks", None)
    if ranks is None or ranks.size == 1:
        return Path(path)
    return Path(f"{path}.rank{ranks.rank}of{ranks.size}")


def open_cache(
    path: str | os.PathLike,
    model,
    *,
    kv_bits: int | None = None,
    max_kv_size: int | None = None,
    draft=None,
    log: Callable[[str], None] | None = None,
) -> tuple[PromptCache, str, str | None]:
    """(the cache to run with, the model's fingerprint for :func:`save`, a warning or None):
    the file's cache when it is this model's, else a fresh one (and why, unless there was no
    file). Across ranks: this rank's file (:func:`rank_path`), used only if every rank's is.

    ``draft``: the run's ``MTP`` draft, which takes the head cache the file keeps when it is
    this head's (``MTP.restore_head_state``); ``log`` hears what became of it, in a line."""
    fingerprint = cache_fingerprint(model, kv_bits, max_kv_size)
    fresh = PromptCache(model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits))
    path = rank_path(path, model)
    ranks = getattr(model, "ranks", None)
    # Across ranks a step of the model is a collective: every rank takes the one-token step
    # that gives the arrays a file's must match, whether its own file is there or not.
    expected = _expected(model, kv_bits, max_kv_size) if ranks is not None else None
    pc, warning, head = fresh, None, None
    if path.exists():
        try:
            if expected is None:
                expected = _expected(model, kv_bits, max_kv_size)
            pc, head = _read(path, model, fingerprint, expected)
        except _UNREADABLE as e:
            reason = " ".join(str(e).removeprefix(f"{path}: ").split())[:300]
            warning = f"{path}: not used ({reason}); starting cold"
    if ranks is not None and ranks.size > 1 and not _all_resume(ranks, pc is not fresh, pc.tokens):
        if pc is not fresh:
            reason = "another rank's file is missing, refused or holds other tokens"
            pc, warning = fresh, f"{path}: not used ({reason}); starting cold"
    if pc is not fresh and draft is not None and hasattr(draft, "restore_head_state"):
        said = _restore_head(draft, model, head)
        if log is not None and said:
            log(f"{path}: {said}")
    return pc, fingerprint, warning


def _restore_head(draft, model, head: tuple[dict, dict] | None) -> str | None:
    """Hand the file's head section (arrays and metadata, or None) to ``draft``; what it did."""
    if head is None:
        return None
    arrays, meta = head
    try:
        cache = cache_from(arrays, meta, HEAD_SECTION)
    except _UNREADABLE as e:
        return f"MTP head cache not used (not readable: {type(e).__name__}: {e})"
    try:
        return draft.restore_head_state(model, cache, user_metadata(meta, HEAD_SECTION))
    except _UNREADABLE as e:  # arrays the head cannot run with
        return f"MTP head cache not used ({type(e).__name__}: {e})"


def _all_resume(ranks, read: bool, tokens: list[int]) -> bool:
    """Whether every rank read its file and all hold the same tokens: one all-min of
    (read, n, -n, h, -h), n the count of the tokens and h their checksum (the minima of x and
    of -x are each other's negation only when every rank has the same x)."""
    h = zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes()) & 0x7FFFFFFF
    mine = mx.array([int(read), len(tokens), -len(tokens), h, -h], dtype=mx.int32)
    out = mx.distributed.all_min(mine, group=ranks.group)
    ranks.run("agreeing on the prompt cache files", out)
    both_read, n, minus_n, h_min, minus_h = cast("list[int]", out.tolist())  # (5,) int32
    return both_read == 1 and n == -minus_n and h_min == -minus_h


def _expected(model, kv_bits, max_kv_size) -> list:
    """The model's own layer caches after one token: the arrays a file's must match."""
    expected = model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits)
    model(mx.array([[0]], dtype=mx.int32), expected)  # each layer's arrays, one token long
    return expected


def _read(path: Path, model, fingerprint: str, expected: list):
    """(the file's prompt cache, its head section's (arrays, metadata) or None)."""
    if path.stat().st_size > MAX_BYTES:
        raise ValueError(f"{path.stat().st_size} bytes, over {MAX_BYTES}")
    read_header(path)  # its structure, before MLX reads a byte of it
    arrays, every = read_cache_file(path)
    cache, meta = cache_from(arrays, every), user_metadata(every)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"not an {FORMAT} v{VERSION} file")
    if meta.get("fingerprint") != fingerprint:
        raise ValueError(
            "written for another model, other --kv-bits / --max-kv-size or another split of "
            "the model over ranks (--distributed)"
        )
    tokens = [int(t) for t in meta.get("tokens", "").split(",") if t]
    kinds = [type(c).__name__ for c in cache]
    if kinds != [type(c).__name__ for c in expected]:
        raise ValueError(f"its {len(kinds)} layer caches are not the model's")
    for i, (c, e) in enumerate(zip(cache, expected)):
        if not isinstance(c, StateCache) and c.offset != len(tokens):
            raise ValueError(f"layer {i} holds {c.offset} tokens, the file lists {len(tokens)}")
        _same_arrays(i, c, e)
    head = (arrays, every) if f"{HEAD_SECTION}.kinds" in every else None
    return PromptCache(cache, tokens), head


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


def save(
    path: str | os.PathLike, pc: PromptCache, fingerprint: str, model=None, draft=None
) -> None:
    """Write ``pc`` to ``path`` for a later :func:`open_cache` (atomically); across ranks
    (``model`` a distributed one), to this rank's file of ``path`` (:func:`rank_path`).
    ``draft``: the run's ``MTP`` draft, whose kept head cache goes in the same file."""
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint}
    meta["tokens"] = ",".join(map(str, pc.tokens))
    sections = {}
    state = draft.head_state() if hasattr(draft, "head_state") else None
    if state is not None and is_trimmable(pc.cache):  # else no resume could take it
        sections[HEAD_SECTION] = ([state[0]], state[1])
    save_cache(rank_path(path, model), pc.cache, meta, sections)
