"""The engine's settings as one object: :class:`EngineConfig`.

``Engine(model, config=EngineConfig(kv_budget=...))`` and ``Engine(model, kv_budget=...)`` are
the same engine: the keywords fill an :class:`EngineConfig` (:meth:`EngineConfig.with_options`),
whose fields are named as the CLI's flags are (``kv_reserve`` is ``--kv-reserve``,
``prefix_state_bytes`` is ``--prefix-state-bytes``). The names they had before are kept as
aliases (:data:`ALIASES`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Sequence

from .images import DEFAULT_ENCODER_BYTES
from .pool import DEFAULT_BLOCK_SIZE, DEFAULT_KV_BUDGET

DEFAULT_MAX_BATCH = 16  # sequences decoded together at most
DEFAULT_PREFILL_STEP = 256  # prompt tokens per prefill chunk between decode steps
DEFAULT_MAX_DRAFT = 8  # tokens a drafting request may propose per step

# Old keyword -> the field it sets (the field's name is the CLI flag's).
ALIASES = {
    "reserve": "kv_reserve",
    "state_budget": "prefix_state_bytes",
    "state_every": "prefix_state_every",
}


@dataclass(frozen=True)
class EngineConfig:
    """The settings of an :class:`~mlxinfer.batch.engine.Engine`.

    Args:
        kv_budget: bytes the KV pool may hold (keys and values of every layer). For a model
            with MTP heads (and ``max_draft`` > 0) the head's pool too: its one layer, as many
            blocks as the target's pool, the budget buying that many blocks of both together,
            and each MTP row reserving its worst case in both at admission (``head_pool.py``).
        block_size: tokens per KV block.
        max_batch: most sequences decoded in one step.
        prefill_step: most prompt tokens prefilled between two decode steps (one or more
            requests' chunks).
        attention: how decode steps read the pool: ``"pages"``, over its blocks in place
            (the faster measured on the CPU backend, docs/batching.md), or ``"gather"``, over a
            contiguous copy of each row's keys. Both give the same logits (1e-4).
        max_draft: most tokens a drafting request (``submit(draft=...)``: prompt lookup or a
            draft model) may propose per step; 0 turns drafting off. Each request reserves
            this many more tokens of KV room.
        kv_bits: store keys and values with 8 or 4 bits (groups of ``kv_group_size``), as
            ``--kv-bits`` does for one request (float32 keys in 64-wide heads: 3.6x / 6.4x the
            tokens for the same ``kv_budget``).
        kv_group_size: the quantization groups' width.
        hold_windows: sliding-window layers keep only the blocks their window still sees (in a
            pool of their own, as many blocks as the pool: ``kv_budget`` holds both), not every
            key of the sequence.
        draft_models: the draft models requests will draft with (``DraftModel(m)``), whose
            pools ``kv_budget`` then holds too: each has as many blocks as the target's pool,
            and the budget buys that many for all of them together. A draft model not named
            here gets its pool at its first request, on top of ``kv_budget``.
        shrink_every: seconds between two looks at the pool's store: one that is at least
            four times what the busiest moment since the last look needed is cut to twice
            that (a burst's memory goes back to the system); ``math.inf`` never cuts.
        kv_reserve: take the whole ``kv_budget`` at start (``serve`` does; ``--kv-grow`` turns
            it off): memory is flat from the first request on instead of growing with the load
            (and the prefixes kept). Alias: ``reserve``.
        prefix_state_bytes: for a model with recurrent layers, the bytes of ``kv_budget`` kept
            for snapshots of their states at block boundaries, which let requests share
            prefixes (``snapshots.py``; the pool gets the rest). None: a quarter; 0: no prefix
            sharing. Alias: ``state_budget``.
        prefix_state_every: a recurrent model's rows snapshot their states every this many
            blocks of prefill (and at each prompt's last full block). None: a prefill chunk's
            blocks. Alias: ``state_every``.
        prefix_cache_dir: keep the prefix cache's full blocks on disk here too (``disk.py``):
            a later engine of the same model (a restart, another server sharing the directory)
            reads them back instead of computing them; a recurrent model's state snapshots
            too (``disk_states.py``).
        prefix_cache_disk_bytes: most bytes of block files in ``prefix_cache_dir`` (every
            model's: the oldest go first); None: 10 GiB.
        rank0_requests: for a model across ranks (``load(distributed=...)``), requests are
            submitted on rank 0 only (``serve``): the other ranks' engines receive them, and
            rank 0's tokens, at each turn (``distributed/batching.py``).
        micro_batches: for a model across pipeline ranks, decode in flights of about 1/S of
            the rows, one at each rank's stage (``distributed/micro.py``), not every row through
            the ranks one after another; None: as loaded (``distributed.load(micro_batches=)``,
            default on). Not for recurrent models or frequencies that follow the length.
        encoder_cache_bytes: for a model with a vision tower, the image features kept by
            (SHA-256, processor variant), least recently used out (``images.EncoderCache``):
            the same image in a later request skips the tower. 0: none kept.
    """

    kv_budget: int = DEFAULT_KV_BUDGET
    block_size: int = DEFAULT_BLOCK_SIZE
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_step: int = DEFAULT_PREFILL_STEP
    attention: str = "pages"
    max_draft: int = DEFAULT_MAX_DRAFT
    kv_bits: int | None = None
    kv_group_size: int = 64
    hold_windows: bool = True
    draft_models: Sequence = ()
    shrink_every: float = 20.0
    kv_reserve: bool = False
    prefix_state_bytes: int | None = None
    prefix_state_every: int | None = None
    prefix_cache_dir: str | os.PathLike | None = None
    prefix_cache_disk_bytes: int | None = None
    rank0_requests: bool = False
    micro_batches: bool | None = None
    encoder_cache_bytes: int = DEFAULT_ENCODER_BYTES

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_step < 1:
            raise ValueError(
                f"max_batch and prefill_step must be >= 1, got {self.max_batch}, "
                f"{self.prefill_step}"
            )
        if self.attention not in ("pages", "gather"):
            raise ValueError(f"attention: expected 'pages' or 'gather', found {self.attention!r}")
        if self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {self.max_draft}")
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes}")
        every = self.prefix_state_every
        if every is not None and every < 1:
            raise ValueError(f"prefix_state_every (state_every) must be >= 1 (blocks), got {every}")

    def with_options(self, **options: Any) -> EngineConfig:
        """This config with ``options`` (field names, or their :data:`ALIASES`) set; a
        TypeError names an option that is neither."""
        return dataclasses.replace(self, **fields(options, "Engine"))

    @property
    def state_every(self) -> int:
        """The blocks between a recurrent model's snapshots (``prefix_state_every``, or a
        prefill chunk's blocks)."""
        return self.prefix_state_every or max(1, self.prefill_step // self.block_size)


NAMES = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def fields(options: dict[str, Any], who: str) -> dict[str, Any]:
    """``options`` with their aliases replaced by the fields' names; a TypeError naming the
    first that is neither (or a field given under both names)."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = ALIASES.get(key, key)
        if name not in NAMES:
            raise TypeError(f"{who}: unexpected keyword argument {key!r}")
        if name in out:
            raise TypeError(f"{who}: {name!r} given twice (as {key!r} too)")
        out[name] = value
    return out
