"""Prefill: the one function that feeds a prompt into a cache, for every loop.

The plain loop (``generation.generate_step``), the speculative loop and a
draft model's own cache all prefill through :func:`prefill`; a
``PromptCache`` only holds the caches and their tokens.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import mlx.core as mx

from ..backends import prefill_schedule
from ..cache.prompt import PromptCache, Snapshot
from ..cache.state import StateCache
from ..errors import TokenIdError
from ..models.base import embedding_rows
from ..models.layers.rope import prompt_reach

DEFAULT_PREFILL_STEP = 512  # tokens per prefill chunk: bounds the attention scores' memory
# Most tokens after the prompt given room up front; past it the cache grows in steps.
MAX_RESERVED_DECODE = 2048


@runtime_checkable
class _Growing(Protocol):
    """A cache that preallocates its buffers (``KVCache``, ``QuantizedKVCache``)."""

    offset: int

    def reserve(self, n_tokens: int) -> None: ...
    def grow(self, n_tokens: int) -> None: ...


def token_ids(items: Iterable, what: str = "prompt") -> list[int]:
    """``items`` as a list of Python ints (numpy and MLX integer scalars too); a TokenIdError
    naming the first item that is not an integer (a float, a str, a bool)."""
    out = []
    for i, item in enumerate(items):
        try:
            if isinstance(item, bool):
                raise TypeError  # True is not token 1
            out.append(operator.index(item))
        except TypeError:
            raise TokenIdError(
                f"{what}: item {i} should be a token id (an int), found {item!r:.40}"
            ) from None
    return out


def check_token_ids(model, ids: Sequence[int], what: str = "prompt") -> None:
    """Raise TokenIdError unless every id is a row of ``model``'s embedding (0..rows-1).

    MLX's embedding lookup does not check its indices: an id past the rows reads memory the
    table does not own (garbage, or a segmentation fault), a negative one wraps around. So ids
    are checked where they enter: once per request, for the prompt (the sampled ones come from
    the LM head, whose rows loader.check_vocabulary holds to the embedding's).
    """
    rows = embedding_rows(model)
    if not ids or rows is None:
        return
    low, high = min(ids), max(ids)
    if low >= 0 and high < rows:
        return
    bad = low if low < 0 else high
    raise TokenIdError(
        f"{what}: token id {bad} (position {list(ids).index(bad)}) is not in the model's "
        f"vocabulary (expected 0..{rows - 1})"
    )


def prefill(
    model,
    pc: PromptCache,
    ids: list[int],
    step: int = DEFAULT_PREFILL_STEP,
    *,
    then: int = 1,
    checkpoint: bool = True,
    observe: Callable[[mx.array, int], list[mx.array]] | None = None,
) -> None:
    """Feed ``ids`` into ``pc`` in chunks of ``step``, computing only the caches.

    Only the cache states are evaluated, so the LM head of these chunks is
    never computed (the lazy graph drops it). The caches get room for
    ``ids`` and the one token every caller feeds next, allocated once (no
    copy as the prompt's chunks arrive); after it, room for the ``then``
    tokens expected next (at most ``MAX_RESERVED_DECODE``). Growing between
    the two copies the prompt's keys once, layer by layer, so the peak is the
    larger of (prompt's KV + prefill's transients) and (whole KV + a decode
    step's), not their sum (docs/performance.md, "Peak memory"). With
    ``checkpoint``, ``pc`` remembers the point reached for a later request's
    reuse (``PromptCache.checkpoint``: only where state caches cannot trim). ``observe``
    (an MTP head priming its cache): each chunk runs ``model.trunk`` and its final hidden
    states (L, H) go to ``observe(hidden, start)``, whose returned arrays are evaluated too.
    """
    y = mx.array(ids, dtype=mx.int32)
    growable = [c for c in pc.cache if isinstance(c, _Growing)]
    for c in growable:
        c.reserve(c.offset + len(ids) + 1)
    # As the backend schedules it (the CPU's, for a quantized model: one step's buffers at a time).
    # Its chunks rotate as the whole prompt would (with the token fed next: dynamic NTK, LongRoPE).
    with prefill_schedule(model), prompt_reach(len(pc.tokens) + len(ids) + 1):
        for start in range(0, len(ids), step):
            extra: list[mx.array] = []
            if observe is None:
                model(y[None, start : start + step], pc.cache)
            else:
                hidden, _ = model.trunk(y[None, start : start + step], pc.cache)
                extra = observe(hidden[0], start)
            # Materialise this chunk's cache writes before building the next chunk,
            # so the graph (and its memory) stays one chunk deep.
            mx.eval([c.state for c in pc.cache] + extra)
            pc.tokens.extend(ids[start : start + step])
    for c in growable:
        c.grow(c.offset + max(1, min(then, MAX_RESERVED_DECODE)))
    if checkpoint:
        pc.checkpoint()


def rewind(model, pc: PromptCache, n: int, snapshot: Snapshot | None = None) -> None:
    """Keep the first ``n`` tokens of ``pc`` in its caches (rejected drafts go).

    Where every cache can drop tokens they are trimmed. A list with state caches, which
    hold no entry per token, takes each state cache's recorded state at ``n`` when the last pass
    recorded them by position (``StateCache.recording``: Gated DeltaNet and LFM2's convolution
    do), with no other forward; else it goes back to ``snapshot`` (taken at most ``n`` tokens
    in, before the pass that went past ``n``) and feeds the kept tokens after it again: one
    more forward of those tokens, whose logits are not computed.
    """
    if snapshot is None or all(c.offset <= n for c in pc.cache):
        pc.rewind(n)
        return
    states = [c for c in pc.cache if isinstance(c, StateCache) and c.offset > n]
    if all(c.can_rewind_within(n) for c in states):
        for c in states:
            c.rewind_within(n)
        pc.rewind(n)  # the KV caches trimmed
        return
    tokens = pc.tokens[:n]
    pc.restore(snapshot)
    prefill(model, pc, tokens[snapshot[0] :], checkpoint=False)
