"""What the pool holds for a model: each layer's key and value shapes (and their storage), and
whether the model's rows can decode together.
"""

from __future__ import annotations

from typing import Callable, Hashable

import mlx.core as mx

from ..cache.kv import KVCache, LatentKVCache, StateCache
from ..cache.rotating import RotatingKVCache
from ..errors import MlxInferError
from ..models.layers.rope import LongRoPE, RoPE
from .pool import KVPool, LayerShape
from .store import block_bytes


class UnbatchableError(MlxInferError, NotImplementedError):
    """A model whose caches the paged pool cannot hold (the CLI prints it as one line)."""


# check_batchable's entry for a recurrent layer: its state is kept per row, not in the pool.
STATE = "state"


def layer_shapes(model, kv_bits: int | None = None, kv_group_size: int = 64) -> list[LayerShape]:
    """Each layer's cached key and value shapes, read from a one-token forward; stored with
    ``kv_bits`` in groups of ``kv_group_size`` if given (checked as the model's own
    quantized cache checks it)."""
    return shapes_and_states(model, kv_bits, kv_group_size)[0]


def shapes_and_states(
    model, kv_bits: int | None = None, kv_group_size: int = 64
) -> tuple[list[LayerShape], list[mx.array]]:
    """``layer_shapes`` and, from the same forward (across ranks every forward is every
    rank's), the arrays of one row's recurrent states (``snapshots.capture``'s order: their
    shapes and dtypes are fixed; none without a recurrent layer)."""
    cache = model.make_cache()
    model(mx.array([[0]], dtype=mx.int32), cache)
    states = [a for c in cache if isinstance(c, StateCache) for a in c.arrays]
    mx.eval(states)
    return _shapes(cache, model, kv_bits, kv_group_size), states


def _shapes(cache, model, kv_bits, kv_group_size) -> list[LayerShape]:
    if kv_bits is not None:
        if kv_bits not in (4, 8):
            raise ValueError(f"kv_bits must be 4 or 8, got {kv_bits}")
        model.make_cache(kv_bits=kv_bits, kv_group_size=kv_group_size)  # the family's refusals
        if any(isinstance(c, LatentKVCache) for c in cache):
            raise ValueError("kv_bits: the pool does not quantize latent (MLA) caches yet")
    shapes = []
    for i, c in enumerate(cache):
        if isinstance(c, StateCache):  # kept per row, not in the pool
            continue
        k, v = c.state[:2]
        if kv_bits is not None and (k.shape[-1] % kv_group_size or v.shape[-1] % kv_group_size):
            raise ValueError(
                f"kv_bits: layer {i}'s keys ({k.shape[-1]}) and values ({v.shape[-1]}) must be "
                f"whole groups of kv_group_size={kv_group_size}"
            )
        shapes.append(
            LayerShape(
                k.shape[1],
                k.shape[-1],
                v.shape[-1],
                k.dtype,
                bits=kv_bits,
                group_size=kv_group_size,
            )
        )
    return shapes


def check_batchable(model) -> tuple[Callable[[int], Hashable] | None, list[int | str | None]]:
    """Raise for a model the pool cannot hold; else (its rows' frequency regime, each layer's
    sliding window, None, or ``STATE``).

    Rows decode together when every position comes from ``cache.offset``, one per row: RoPE
    with fixed frequencies, learned and sinusoidal tables, ALiBi (the regime is None). Dynamic
    NTK and LongRoPE pick their frequencies from the length a sequence reaches in a forward:
    ``regime(reach)`` names the frequencies a row reaching ``reach`` uses, and the rows of one
    regime decode together, with the results they get alone (LongRoPE: the short or the long
    factors, two groups at most; dynamic NTK: one group up to ``max_position_embeddings``, past
    it each length its own). A sliding-window layer keeps every key in the pool and slides
    its mask.

    A recurrent layer (a ``StateCache``: LFM2's convolutions, Qwen3-Next's Gated DeltaNet)
    is ``STATE``: its state is one fixed-size array per sequence, not keys per token, so each
    request keeps its own and the step stacks the rows' (``views.RowStates``); the pool holds
    the attention layers only.
    """
    windows: list[int | str | None] = []
    for c in model.make_cache():
        if isinstance(c, RotatingKVCache) and c.keep == 0:
            windows.append(c.max_size)
        elif type(c) in (KVCache, LatentKVCache):
            windows.append(None)
        elif isinstance(c, StateCache):
            windows.append(STATE)
        else:
            raise UnbatchableError(
                f"batching: {type(model).__module__} uses a {type(c).__name__}, which the paged "
                "pool does not hold yet"
            )
    if not getattr(model, "positions_from_offset", True):
        return (lambda reach: object()), windows  # positions of its own: every row alone
    ropes = [
        m
        for _, m in model.named_modules()
        if isinstance(m, LongRoPE) or (isinstance(m, RoPE) and m.dynamic is not None)
    ]
    if not ropes:
        return None, windows
    return (lambda reach: tuple(m.regime(reach) for m in ropes)), windows


def make_pools(
    shapes: list[LayerShape],
    windows: list[int | str | None],
    *,
    block_size: int,
    kv_budget: int,
    hold_windows: bool = True,
    blocks: int | None = None,
) -> tuple[KVPool, KVPool | None]:
    """The pools of a model's attention layers: (its pool, its window pool or None).

    With ``hold_windows``, the sliding-window layers keep their keys in a pool of their own,
    where a sequence holds only the blocks its window still sees (the largest of the layers'
    windows), so their memory is the windows, not the sequences. Both pools have the blocks
    ``kv_budget`` buys for every layer together, so admission is as without it and the two
    never hold more than the budget. A model whose every attention layer slides keeps one pool,
    a window pool. ``blocks``: the pool's blocks, given (a model part without attention layers
    across ranks: a pool of no bytes with the other ranks' blocks)."""
    layer_windows = [w for w in windows if w != STATE]
    sliding = [w for w in layer_windows if w is not None]
    if not hold_windows or not sliding:
        return KVPool(shapes, block_size=block_size, kv_budget=kv_budget, blocks=blocks), None
    if len(sliding) == len(layer_windows):
        return KVPool(shapes, block_size=block_size, kv_budget=kv_budget, window=max(sliding)), None
    blocks = kv_budget // block_bytes(shapes, block_size)
    full = [s for s, w in zip(shapes, layer_windows) if w is None]
    windowed = [s for s, w in zip(shapes, layer_windows) if w is not None]

    def budget(part: list[LayerShape]) -> int:
        return blocks * block_bytes(part, block_size)

    if blocks < 1:  # the pool's own error, naming the budget
        KVPool(shapes, block_size=block_size, kv_budget=kv_budget)
    return (
        KVPool(full, block_size=block_size, kv_budget=budget(full)),
        KVPool(windowed, block_size=block_size, kv_budget=budget(windowed), window=max(sliding)),
    )
