"""What an :class:`~.config.EngineConfig` makes of a model: its pools inside the budget, the
snapshots of its recurrent states, its draft models' pools, and whether it micro-batches.
:func:`make_parts` runs once, when the engine is made; the scheduler is given the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import disk as disk_mod
from . import disk_states
from . import pool as pool_mod
from .config import EngineConfig
from .draft_pool import DraftPool, poolable
from .head_pool import HeadPool, head_shape, mtp_head
from .layout import STATE, check_batchable, layer_shapes, make_pools, shapes_and_states
from .pools import Pools
from .snapshots import make_store, split_budget
from .store import block_bytes


@dataclass
class Parts:
    pools: Pools
    snapshots: Any  # a recurrent model's state snapshots (snapshots.py), or None
    regime: Callable | None  # rows of one regime share a forward (None: all rows)
    recurrent: bool  # the model has recurrent layers (across ranks: any rank's has)
    micro: Any  # the model's MicroPipeline (flights.py), or None
    shrink_every: float
    draft_pools: dict[int, DraftPool]  # the draft models' pools inside the budget, by id


def rank_turns(model, rank0_requests: bool):
    """For ``model`` across ranks (``load(distributed=...)``), the turns every rank's engine
    takes (``distributed/batching.py``); None for a model in one process."""
    if hasattr(model, "engine_turns"):
        return model.engine_turns(rank0_requests=rank0_requests)
    if rank0_requests:
        raise ValueError("rank0_requests: the model does not run across ranks")
    return None


def make_parts(model, c: EngineConfig, turns=None) -> Parts:
    """``model``'s pools, snapshots and draft pools as ``c`` has them, inside ``c.kv_budget``;
    ``turns``: the ranks' (``rank_turns``), or None in one process."""
    across = turns is not None
    # Rows of one regime share a forward (None: all rows; see check_batchable).
    regime, windows = check_batchable(model)
    # Recurrent layers' states live with each request; prefixes are shared from snapshots
    # of the states at block boundaries (snapshots.py), inside kv_budget, and a drafting
    # row's states go back to before a step whose drafts were rejected (verification.py).
    recurrent = STATE in windows
    if across:  # a rank without recurrent layers takes the others' turns
        recurrent = turns.any_recurrent(recurrent)
    shapes, template = shapes_and_states(model, c.kv_bits, c.kv_group_size)
    # A draft model's pool inside kv_budget; across ranks none: rank 0 alone drafts
    # (distributed/copies.py), its pool made on the first request outside the budget, so
    # that every rank's pool keeps the same blocks.
    drafts = [m for m in c.draft_models if poolable(m)] if c.max_draft > 0 and not across else []
    # A model with MTP heads: its rows' head caches in a pool inside kv_budget (head_pool.py;
    # MTP drafting does not run across ranks).
    head = mtp_head(model) if c.max_draft > 0 and not across else None
    head_layer = head_shape(head) if head is not None else None
    others = [block_bytes(layer_shapes(m), c.block_size) for m in drafts]
    if head_layer is not None:
        others.append(block_bytes([head_layer], c.block_size))
    target_budget = _target_budget(shapes, others, c.kv_budget, c.block_size)
    state_bytes = 0
    if recurrent:
        target_budget, state_bytes = split_budget(target_budget, c.prefix_state_bytes)
    blocks, shrink_every = None, c.shrink_every
    if across:  # as many blocks on every rank (of no bytes without attention)
        per_block = block_bytes(shapes, c.block_size)
        blocks = turns.equal_blocks(per_block, target_budget)
        target_budget, shrink_every = blocks * per_block, turns.shrink_every
    # Sliding-window layers hold only their windows, in a pool of their own (make_pools).
    pool, window_pool = make_pools(
        shapes,
        windows,
        block_size=c.block_size,
        kv_budget=target_budget,
        hold_windows=c.hold_windows,
        blocks=blocks,
    )
    pools = Pools(pool, window_pool, windows)
    if head_layer is not None:  # as many blocks as the target's pool
        pools.head_pool = HeadPool(head, head_layer, pool.max_blocks, c.block_size)
    snapshots = None
    if state_bytes:  # across ranks as many snapshots on every rank (snapshots.py)
        snapshots = make_store(state_bytes, template, pool.holds, turns)
    if c.prefix_cache_dir is not None:
        refusal = None
        if recurrent and snapshots is None:
            refusal = (
                "recurrent layers without state snapshots (prefix_state_bytes=0) share no prefix"
            )
        pool.disk = disk_mod.attach(
            model,
            pools.all(),
            directory=c.prefix_cache_dir,
            budget=c.prefix_cache_disk_bytes,
            refusal=refusal,
        )
        if pool.disk is not None and snapshots is not None and template:
            # states on disk too (a pipeline rank without recurrent layers has none)
            snapshots = disk_states.DiskSnapshots(snapshots, pool.disk, template)
    if c.kv_reserve:
        for p in pools.all() + ([pools.head_pool.pool] if pools.head_pool is not None else []):
            p.reserve()
    # Across pipeline ranks: one flight of rows at each rank's stage (flights.py).
    micro = None
    if hasattr(model, "micro_pipeline") and not recurrent and regime is None:
        micro = model.micro_pipeline(c.micro_batches)  # None: off, or one rank
    draft_pools = {id(m): DraftPool(m, model, pool.max_blocks, c.block_size) for m in drafts}
    return Parts(pools, snapshots, regime, recurrent, micro, shrink_every, draft_pools)


def _target_budget(shapes, others: list[int], kv_budget: int, block_size: int) -> int:
    """The part of ``kv_budget`` for the target's pools when pools of as many blocks share it
    (``others``: a block's bytes in each, draft models' and the MTP head's): the bytes of the
    blocks the budget buys for every pool at once (the whole budget without others)."""
    if not others:
        return kv_budget
    per_block = block_bytes(shapes, block_size)
    blocks = kv_budget // (per_block + sum(others))
    if blocks < 1:
        raise pool_mod.PoolFullError(
            f"kv_budget: {kv_budget} bytes hold no block of {per_block} bytes for the model and "
            f"{' + '.join(map(str, others))} for its draft model(s) or MTP head"
        )
    return blocks * per_block
