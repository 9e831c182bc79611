"""A paged KV pool: every sequence's keys and values in fixed-size blocks of one store
(the arrays: ``store.py``), and which sequence holds which block.

A sequence owns a *block table* (its logical blocks → physical blocks), so a
sequence that joins or leaves copies nothing, and memory is the blocks in use,
not batch × the longest sequence.

Sharing. A full block is named by a hash chained over its parent's hash, its
tokens and its salt (the images whose tokens it holds: ``images.py``; none for text),
as vLLM's automatic prefix caching does, so two requests with the same
prefix (a system prompt, earlier chat turns) map it to the same physical block:
the second takes a reference instead of computing it. Only full blocks are
shared and a sequence only writes into its last, partial block, so a write never
lands in a shared block; :meth:`fork` (which shares a partial block too) copies
it on the first write (copy-on-write). A block whose last reference goes keeps
its hash and its contents in an LRU queue of *cached* blocks, which a later hit
revives and an allocation evicts, oldest first.

Accounting is exact: ``stats()`` gives blocks in use, free, cached, the hits and
the bytes the store holds. Admission reserves a request's worst case (prompt +
``max_tokens``) up front, so a running sequence never finds the pool empty.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..errors import MlxInferError
from .store import BlockStore, LayerShape

__all__ = ["DROPPED", "KVPool", "LayerShape", "PoolFullError", "PoolStats", "Sequence"]

DEFAULT_BLOCK_SIZE = 16  # tokens per block (vLLM's default; vllm-metal's kernel uses 16 too)
DEFAULT_KV_BUDGET = 1 << 30  # bytes of keys and values the pool may hold (1 GiB)
_GROWTH_BLOCKS = 16  # blocks the store starts with and grows by at least (it doubles)

DROPPED = -1  # a block table entry whose block a sliding-window pool gave back (masked anyway)


class PoolFullError(MlxInferError):
    """A request needs more KV blocks than the pool's budget can ever hold."""


@dataclass(frozen=True)
class PoolStats:
    block_size: int
    blocks_total: int  # the most blocks the budget allows
    blocks_in_use: int  # referenced by a running sequence
    blocks_cached: int  # unreferenced, holding a hashed prefix block
    blocks_free: int  # neither (the store's unused blocks included)
    bytes_per_block: int
    nbytes: int  # bytes the store's arrays hold now
    prefix_hits: int  # blocks served from the prefix cache
    prefix_queries: int  # full prompt blocks looked up

    @property
    def bytes_in_use(self) -> int:
        return self.blocks_in_use * self.bytes_per_block


@dataclass
class Sequence:
    """One sequence's place in the pool: its blocks, its tokens, and what it reserved."""

    blocks: list[int] = field(default_factory=list)  # DROPPED: a block given back (a window's)
    tokens: list[int] = field(default_factory=list)  # tokens whose keys are stored, in order
    hashes: list[bytes] = field(default_factory=list)  # one per full block
    salts: dict[int, bytes] = field(default_factory=dict)  # block -> its images (images.py)
    reserved: int = 0  # blocks promised at admission and not allocated yet

    @property
    def length(self) -> int:
        return len(self.tokens)


def block_hash(parent: bytes, tokens: list[int], salt: bytes = b"") -> bytes:
    """The name of a full block: its parent's name, its tokens and its ``salt`` (the images
    whose tokens it holds, ``images.block_salts``; empty for text) hashed together."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes() + salt).digest()


def chain_hashes(
    ids: list[int], block_size: int, n: int, salts: dict[int, bytes] | None = None
) -> list[bytes]:
    """The names of the first ``n`` full blocks of ``ids`` (``salts``: block -> its salt)."""
    hashes, parent, salts = [], b"", salts or {}
    for i in range(n):
        parent = block_hash(parent, ids[i * block_size : (i + 1) * block_size], salts.get(i, b""))
        hashes.append(parent)
    return hashes


class KVPool(BlockStore):
    """Blocks of keys and values for every layer, shared by all sequences of an engine: which
    sequence holds which block (the arrays themselves: :class:`~.store.BlockStore`)."""

    disk = None  # a DiskTier (disk.py): full blocks also go to disk, and come back from it

    def __init__(
        self,
        layers: list[LayerShape],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_budget: int = DEFAULT_KV_BUDGET,
        window: int | None = None,
        blocks: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        # A pool of sliding-window layers: a sequence keeps only the blocks its window still
        # sees (drop_before), and a cached block is reused before the store grows.
        self.window = window
        BlockStore.__init__(self, layers, block_size)
        # ``blocks``: the most blocks, given (across ranks a pipeline rank of recurrent layers
        # only has a pool of no layer: no bytes, the others' block tables; batching.py).
        if blocks is None and not self.bytes_per_block:
            raise ValueError("a pool of no layer's bytes needs its number of blocks")
        self.max_blocks = kv_budget // self.bytes_per_block if blocks is None else blocks
        if self.max_blocks < 1:
            raise PoolFullError(
                f"kv_budget: {kv_budget} bytes hold no block of {self.bytes_per_block} bytes "
                f"({block_size} tokens × {len(layers)} layers)"
            )
        self._free: list[int] = []  # a min-heap: the lowest free block is taken first
        self._refs: dict[int, int] = {}  # block -> references, for blocks in use
        self._hash_of: dict[int, bytes] = {}  # block -> its hash, for hashed blocks
        self._by_hash: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = (
            OrderedDict()
        )  # unreferenced hashed blocks, LRU first
        self._reserved = 0  # blocks promised to admitted sequences
        self._high = 0  # blocks below the highest taken since the last shrink() (its look)
        self.floor = _GROWTH_BLOCKS  # blocks shrink() keeps at least (reserve(): all of them)
        self.prefix_hits = self.prefix_queries = 0

    # -- capacity -------------------------------------------------------------------------

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def available(self) -> int:
        """Blocks a new request may still reserve."""
        in_use = len(self._refs)
        return self.max_blocks - in_use - self._reserved

    def check_fits(self, n_tokens: int, room: int = 0) -> None:
        """Raise PoolFullError if ``n_tokens`` (and ``room`` more, for drafts) could never fit,
        even in an empty pool."""
        need = self.blocks_for(n_tokens + room)
        if need > self.max_blocks:
            extra = f" and {room} of draft room" if room else ""
            raise PoolFullError(
                f"kv_budget: a request of {n_tokens} tokens{extra} needs {need} blocks "
                f"({need * self.bytes_per_block / 1e6:.1f} MB); the budget holds "
                f"{self.max_blocks} ({self.max_blocks * self.bytes_per_block / 1e6:.1f} MB)"
            )

    # -- sequences ------------------------------------------------------------------------

    def lookup(self, prompt: list[int], salts: dict[int, bytes] | None = None) -> list[int | None]:
        """The block holding each full block of ``prompt`` (but the block of its last token),
        by hash (``salts``: its blocks' images), or None: what :meth:`admit` could share."""
        n = (len(prompt) - 1) // self.block_size
        return [self._by_hash.get(h) for h in chain_hashes(prompt, self.block_size, n, salts)]

    def shareable(self, found: list[int | None]) -> int:
        """How many leading blocks of a :meth:`lookup` a sequence can share: those up to the
        first missing one, or in a window pool up to the last ``n`` whose window is all there
        (the blocks before a window are never read)."""
        if self.window is None:
            return next((i for i, b in enumerate(found) if b is None), len(found))
        for n in range(len(found), 0, -1):
            if all(b is not None for b in found[self.first_seen(n * self.block_size) : n]):
                return n
        return 0

    def holds(self, chain_hash: bytes) -> bool:
        """Whether the pool holds the full block of that chain hash (in use or cached)."""
        return chain_hash in self._by_hash

    def first_seen(self, position: int) -> int:
        """The first block a query at ``position`` still sees in a window pool."""
        return max(0, position - self.window + 1) // self.block_size

    def admit(
        self,
        prompt: list[int],
        max_tokens: int,
        share: bool = True,
        hits: int | None = None,
        salts: dict[int, bytes] | None = None,
    ) -> Sequence | None:
        """A sequence for ``prompt`` with room for ``max_tokens`` more, its prefix blocks
        shared where the pool has them (unless not ``share``: a model whose recurrent layers
        keep a state outside the pool needs the whole prompt fed; ``hits``: share exactly that
        many, as :meth:`shareable` allows them); None if the pool has no room now (try later).
        ``salts``: the salts of the prompt's blocks that hold image tokens (``images.py``).

        At least the prompt's last token is left to compute: its logits start decoding.
        """
        self.check_fits(len(prompt) + max_tokens)
        seq = Sequence(salts=dict(salts or {}))
        found = self.lookup(prompt, salts) if share else []
        n = self.shareable(found) if hits is None else hits
        skip = self.first_seen(n * self.block_size) if self.window is not None else 0
        for i, h in enumerate(chain_hashes(prompt, self.block_size, n, salts)):
            if i < skip:  # before the window: never read, not held
                seq.blocks.append(DROPPED)
            else:
                self._take(found[i])
                seq.blocks.append(found[i])
            seq.hashes.append(h)
        seq.tokens.extend(prompt[: n * self.block_size])
        need = self.blocks_for(len(prompt) + max_tokens) - n
        if need > self.available():
            self.release(seq)
            return None
        seq.reserved = need
        self._reserved += need
        self.prefix_queries += len(found)
        self.prefix_hits += n
        return seq

    def drop_before(self, seq: Sequence, position: int) -> None:
        """In a window pool: give back ``seq``'s blocks that a query at ``position`` (or later)
        no longer sees. Their hashes stay: cached, they can serve a later prefix."""
        for i in range(self.first_seen(position)):
            block = seq.blocks[i]
            if block != DROPPED:
                self._unref(block)
                seq.blocks[i] = DROPPED

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            del self._refs[block]
            if block in self._hash_of:
                self._cached[block] = None
            else:
                heapq.heappush(self._free, block)

    def release(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks and reservation; hashed blocks stay cached for later hits."""
        for block in seq.blocks:
            if block != DROPPED:
                self._unref(block)
        self._reserved -= seq.reserved
        seq.blocks, seq.tokens, seq.hashes, seq.reserved, seq.salts = [], [], [], 0, {}

    def fork(self, seq: Sequence) -> Sequence | None:
        """A second sequence sharing every block of ``seq``, with the same room left; their
        partial last block is copied by whichever writes into it first. None if no room."""
        need = seq.reserved + (seq.length % self.block_size != 0)
        if need > self.available():
            return None
        child = Sequence(list(seq.blocks), list(seq.tokens), list(seq.hashes), dict(seq.salts))
        child.reserved = need
        for block in child.blocks:
            if block != DROPPED:
                self._refs[block] += 1
        self._reserved += need
        return child

    def _take(self, block: int) -> None:
        if block in self._cached:
            del self._cached[block]
        self._refs[block] = self._refs.get(block, 0) + 1

    def reserve(self) -> None:
        """Take the whole budget now (as llama.cpp and vLLM do): memory stays flat from the
        first request on, and the store never grows by copying or shrinks."""
        first = self.n_blocks
        if first < self.max_blocks:
            self.grow(self.max_blocks - first)
            self._free.extend(range(first, self.n_blocks))
            heapq.heapify(self._free)
        self.floor = self.max_blocks

    def shrink(self) -> int:
        """Give back the store's tail when at most a quarter of it was used since the last call
        (after a burst): the store is cut to twice the blocks below the highest one taken since
        then (at least ``_GROWTH_BLOCKS``), and cached blocks in the cut part are forgotten.
        Blocks are taken lowest first, so the tail empties as the rows that grew it retire.
        Returns the blocks given back (0 for a window pool: it is the size of its windows)."""
        top = max(self._refs, default=-1) + 1
        high, self._high = max(self._high, top), top
        if self.window is not None or self.n_blocks <= self.floor:
            return 0
        keep = max(self.floor, 2 * high)
        if 2 * keep > self.n_blocks:  # hysteresis: only a store at least twice what it needs
            return 0
        for block in [b for b in self._cached if b >= keep]:
            del self._cached[block]
            del self._by_hash[self._hash_of.pop(block)]
        self._free = [b for b in self._free if b < keep]
        heapq.heapify(self._free)
        dropped = self.n_blocks - keep
        self.truncate(keep)
        return dropped

    def _allocate(self, seq: Sequence) -> int:
        # A window pool reuses its cached blocks before it grows: its store stays the size of
        # the windows held. The others grow first, to keep every prefix they can.
        evict_first = self.window is not None and self._cached
        if self._free:  # the lowest, so the store's tail empties and can be given back
            block = heapq.heappop(self._free)
        elif self.n_blocks < self.max_blocks and not evict_first:
            # Double the store (at least _GROWTH_BLOCKS more), up to the budget: a copy of
            # every layer's arrays, so rare.
            first = self.n_blocks
            self.grow(min(self.max_blocks - first, max(_GROWTH_BLOCKS, first)))
            self._free.extend(range(first, self.n_blocks))
            heapq.heapify(self._free)
            block = heapq.heappop(self._free)
        elif self._cached:  # evict the least recently used cached block
            block, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise PoolFullError("KV pool: no free block (a reservation was exceeded)")
        self._refs[block] = 1
        self._high = max(self._high, block + 1)
        if seq.reserved:
            seq.reserved -= 1
            self._reserved -= 1
        return block

    def append_slots(self, seq: Sequence, tokens: list[int], hashed: bool = True) -> np.ndarray:
        """Slots for ``tokens`` appended to ``seq`` (blocks allocated as needed, a shared
        partial block copied first); the tokens are recorded and full blocks hashed (with
        ``hashed=False`` not yet: :meth:`hash_full`, once every rank has written them)."""
        bs = self.block_size
        start = seq.length
        slots = np.empty(len(tokens), np.int32)
        for j in range(len(tokens)):
            pos = start + j
            index, within = divmod(pos, bs)
            if index == len(seq.blocks):
                seq.blocks.append(self._allocate(seq))
            elif within == 0 or j == 0:
                block = seq.blocks[index]
                if self._refs[block] > 1:  # copy-on-write
                    fresh = self._allocate(seq)
                    self.copy_block(block, fresh)
                    self._refs[block] -= 1
                    seq.blocks[index] = fresh
            slots[j] = seq.blocks[index] * bs + within
        seq.tokens.extend(tokens)
        if hashed:
            self.hash_full(seq)
        return slots

    def hash_full(self, seq: Sequence) -> None:
        """Hash ``seq``'s full blocks not hashed yet: from now on a prefix may share them (and
        the disk tier save them), so their keys must be written by then."""
        bs = self.block_size
        for index in range(len(seq.hashes), seq.length // bs):
            parent = seq.hashes[-1] if seq.hashes else b""
            h = block_hash(
                parent, seq.tokens[index * bs : (index + 1) * bs], seq.salts.get(index, b"")
            )
            seq.hashes.append(h)
            block = seq.blocks[index]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h
                if self.disk is not None:  # written to disk after the step (save_fresh)
                    self.disk.fresh.append((h, block))

    def rewind(self, seq: Sequence, length: int) -> None:
        """Keep ``seq``'s first ``length`` tokens (rejected drafts go): blocks past them return
        to its reservation, and a block no longer full loses the hash it got."""
        if length >= seq.length:
            return
        bs = self.block_size
        keep = -(-length // bs)
        for block in seq.blocks[keep:]:
            self._unhash(block)
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                heapq.heappush(self._free, block)
            seq.reserved += 1
            self._reserved += 1
        del seq.blocks[keep:]
        full = length // bs
        for block in seq.blocks[full:]:  # the last block, partial again
            self._unhash(block)
        del seq.hashes[full:]
        del seq.tokens[length:]

    def _unhash(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]

    def block_table(self, seq: Sequence, length: int) -> np.ndarray:
        """The blocks holding ``seq``'s first ``length`` positions (a block a window pool gave
        back reads as block 0: the mask hides it)."""
        return np.maximum(np.asarray(seq.blocks[: -(-length // self.block_size)], np.int32), 0)

    def stats(self) -> PoolStats:
        in_use, cached = len(self._refs), len(self._cached)
        return PoolStats(
            block_size=self.block_size,
            blocks_total=self.max_blocks,
            blocks_in_use=in_use,
            blocks_cached=cached,
            blocks_free=self.max_blocks - in_use - cached,
            bytes_per_block=self.bytes_per_block,
            nbytes=self.nbytes,
            prefix_hits=self.prefix_hits,
            prefix_queries=self.prefix_queries,
        )
