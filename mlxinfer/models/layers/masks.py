"""Attention masks: what "causal" means, and how a mask applies to attention scores.

A mask (``cache.Mask``) is None (every key visible), the string ``"causal"``
(each of L queries sees the keys up to its own position, aligned lower-right
like ``mx.fast.scaled_dot_product_attention``: the last query sees the last
key), a boolean keep-mask, or an additive float bias (ALiBi). Every attention
that does not go through ``mx.fast`` applies it with :func:`apply`.
"""

from __future__ import annotations

import mlx.core as mx


def causal(n_queries: int, n_keys: int) -> mx.array:
    """Boolean (L, T) mask: query i sees keys up to T − L + i."""
    return mx.arange(n_keys)[None] <= mx.arange(n_keys - n_queries, n_keys)[:, None]


def windowed(n_queries: int, offset: int, window: int) -> mx.array:
    """Boolean (L, offset + L) mask for L queries after ``offset`` keys, each seeing its last ``window``."""
    q = mx.arange(offset, offset + n_queries)[:, None]
    k = mx.arange(offset + n_queries)[None]
    return (k <= q) & (q - k < window)


def with_blocks(mask, blocks: mx.array, offset: int, window: int | None = None):
    """``mask`` for L new queries after ``offset`` keys, where the new tokens that share a block
    id >= 0 in ``blocks`` (L,) also see each other both ways (Gemma 3's image tokens), each
    still within ``window`` of its past (the new keys are the mask's last L columns)."""
    n = blocks.shape[0]
    if mask is None:  # one query: it sees every key already
        return None
    if isinstance(mask, str):
        mask = causal(n, offset + n)
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)  # (L, L)
    if window is not None:
        i = mx.arange(n)
        same = same & (i[:, None] - i[None, :] < window)
    split = mask.shape[-1] - n
    return mx.concatenate([mask[..., :split], mask[..., split:] | same], axis=-1)


def for_groups(mask):
    """``mask`` for scores grouped as (B, n_kv, reps, L, T), where query heads sharing a kv
    head are one axis: a batch's per-row (B, 1, L, T) mask gains the reps axis; others as given."""
    if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] == 1:
        return mask[:, :, None]
    return mask


def apply(scores: mx.array, mask) -> mx.array:
    """``scores`` (…, L, T) with ``mask`` applied: masked keys at −inf, a bias added."""
    if isinstance(mask, str):
        mask = causal(*scores.shape[-2:])
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    return scores + mask
