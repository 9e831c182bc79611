"""Recurrent-state snapshots on disk: the disk tier's second kind of file.

A model with recurrent layers shares a prefix only where a snapshot of its states after it is
kept (``snapshots.py``). With the disk tier each snapshot put in memory is also written (off
the decode path, through the tier's writer: dropped when its queue is full) as a file beside
the blocks' (``disk.py``), named by the chain hash of the block it ends, salted apart from the
blocks' names; a chain hash the memory lacks is looked for on disk, read back (every file
checked as a block's is: size, header, fingerprint, hash, digest) and kept in memory again.
So after a restart the blocks come back from disk at admission (``DiskTier.promote``) and the
deepest snapshot among them with them.

Across ranks each rank's files hold its own layers' states (or its share of their channels or
heads): the rank's part is in the tier's fingerprint, and so in these files' names and
headers, so the ranks of one machine can share the directory. A pipeline rank without a
recurrent layer writes none. At admission the ranks agree on the deepest snapshot every rank
holds, in memory or on disk (``held``; ``distributed/batching.py``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .block_file import BlockFormat, listed_layout
from .disk import DiskTier
from .snapshots import ELSEWHERE, Snapshots


class DiskSnapshots(Snapshots):
    """:class:`Snapshots` whose entries are kept on disk too (the interface unchanged)."""

    def __init__(self, memory: Snapshots, tier: DiskTier, template: list[mx.array]) -> None:
        super().__init__(memory.max_bytes, memory.alive, memory.max_count)
        self.tier = tier
        tensors = [(f"s{i}", a.dtype, tuple(a.shape)) for i, a in enumerate(template)]
        self.format = BlockFormat([], 0, tier.fingerprint + ":states", listed_layout(tensors))
        self._bf16 = [a.dtype == mx.bfloat16 for a in template]

    def held(self, chain_hash: bytes) -> int:
        if held := super().held(chain_hash):
            return held
        return ELSEWHERE if self.tier.path(chain_hash, self.format).exists() else 0

    def __contains__(self, chain_hash: bytes) -> bool:
        if super().__contains__(chain_hash):
            return True
        arrays = self.tier.read(chain_hash, self.format)  # checked, or None (a bad one removed)
        if arrays is None:
            return False
        states = [
            mx.array(a).view(mx.bfloat16) if bf16 else mx.array(a)
            for a, bf16 in zip(arrays, self._bf16)
        ]
        self.tier.loaded += 1
        return Snapshots.put(self, chain_hash, states)

    def put(self, chain_hash: bytes, arrays: list[mx.array]) -> bool:
        kept = super().put(chain_hash, arrays)
        if not self.tier.path(chain_hash, self.format).exists():
            host = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
            mx.eval(host)  # on the engine thread, whose stream made them
            self.tier.offer(chain_hash, [np.array(a, copy=True) for a in host], self.format)
        return kept
