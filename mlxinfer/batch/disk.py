"""The prefix cache's disk tier: full KV blocks kept as files, so a restart starts warm.

Layout. ``DIR/blocks/<xx>/<name>.safetensors``, one file per block, ``name`` the SHA-256 of
the model's fingerprint (:mod:`~mlxinfer.cache.fingerprint`) and the block's chain hash
(:func:`~.pool.block_hash`): two models, or one model with other KV bits, never share a
name; two engines of one model share every block. There is no index: the least recently
used blocks are the files with the oldest mtimes (a read touches its file, and so does a
hit in memory), so engines sharing a directory share nothing mutable but whole files,
each written to a temporary sibling, fsynced and renamed (:mod:`~mlxinfer.files.atomic`).

A file holds one block of every layer of the engine's pools, with the model's fingerprint,
the block's hash and its data's SHA-256 (``block_file.py``). A read checks all of it before a
byte is used: a truncated, corrupted or foreign file (another model's, another ``kv_bits``')
is removed, with a warning, and the prefix is computed again.

Reading happens at admission, before the pools look the prompt up (:meth:`DiskTier.promote`):
the prefix's blocks that memory lacks are read into the pools as cached blocks, and the pools'
own prefix match shares them, windows and all.

Writes stay off the decode path: after each turn of its loop the engine thread copies the
turn's new full blocks out of the store (one gather per array) and queues them; a writer
thread writes them. The queue holds at most ``queue_bytes``: past that, blocks are dropped
(a later request writes them), never waited for. Past ``budget`` bytes on disk the oldest
files go, down to 90 % of it. :meth:`DiskTier.close` (``Engine.close``) writes what is
queued first.

A model with recurrent layers keeps its state snapshots on disk too, as files of their own
beside the blocks' (``disk_states.py``: :meth:`DiskTier.read` and :meth:`DiskTier.offer` with
their :class:`~.block_file.BlockFormat`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

import numpy as np

from ..cache.fingerprint import model_fingerprint
from ..files.atomic import writing_file
from .block_file import BlockFormat, DiskTierError
from .pool import Sequence, chain_hashes

DEFAULT_DISK_BYTES = 10 << 30  # 10 GiB
DEFAULT_QUEUE_BYTES = 256 << 20  # blocks waiting for the writer, at most
_EVICT_TO = 0.9  # past the budget, the oldest files go down to this part of it
_TOUCH_EVERY_S = 60.0  # a block's file is touched at most this often (the LRU's resolution)
_TOUCHED_KEPT = 1 << 16  # hashes whose last touch is remembered
_MAX_QUEUED = 4096  # queued writes and touches, at most (the writes: queue_bytes too)

log = logging.getLogger("mlxinfer.prefix_cache")
_NO_RESERVATION = Sequence()  # _allocate's sequence for blocks read in (they reserve nothing)


def attach(
    model, pools: list, *, directory: str | os.PathLike, budget: int | None, refusal: str | None
) -> DiskTier | None:
    """The disk tier of an engine's ``pools`` (its pool, and its window pool if it has one)
    under ``directory``; None, with a warning, where ``refusal`` names why the engine's
    prefixes cannot go to disk."""
    if refusal is not None:
        log.warning("prefix cache on disk: off for this model (%s)", refusal)
        return None
    root = Path(directory).expanduser()
    storage = {
        "block_size": pools[0].block_size,
        "pools": [
            [
                (s.kv_heads, s.key_dim, s.value_dim, str(s.dtype), s.bits, s.group_size)
                for s in p.layers
            ]
            for p in pools
        ],
        "windows": [p.window for p in pools],
        # Across ranks, each rank's part (its layers or heads): its own files.
        "part": getattr(model, "part", None),
    }
    digest = model_fingerprint(model, storage, root)
    budget = DEFAULT_DISK_BYTES if budget is None else budget
    return DiskTier(root, digest, pools, budget=budget)


class DiskTier:
    """The files of an engine's blocks under ``root``, for the model ``fingerprint`` names:
    each file one block of every layer of ``pools`` (its pool; its window pool)."""

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: str,
        pools: list,
        *,
        budget: int = DEFAULT_DISK_BYTES,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
    ) -> None:
        if budget < 0:
            raise ValueError(f"prefix_cache_disk_bytes must be >= 0, got {budget}")
        self.root = Path(root).expanduser() / "blocks"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DiskTierError(
                f"{root}: cannot be the prefix cache directory ({e.strerror or e})"
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise DiskTierError(f"{root}: the prefix cache directory is not writable")
        self.fingerprint = fingerprint
        self.pools = pools  # the engine's pool, and its window pool if it has one
        self.format = BlockFormat([p.layers for p in pools], pools[0].block_size, fingerprint)
        self.data_bytes = self.format.data_bytes
        self.budget, self.queue_bytes = budget, queue_bytes
        self.fresh: list[tuple[bytes, int]] = []  # (hash, block) hashed since the last save
        self.loaded = self.written = self.dropped = self.rejected = self.evicted = 0
        self.failed = 0  # writes that failed (disk full, permissions): the block is not kept
        self._queue: deque = deque()
        self._pending = 0  # bytes queued or being written
        self._cond = threading.Condition()
        self._closed = False
        self._total: int | None = None  # bytes of block files on disk (the writer's count)
        self._touched: OrderedDict[bytes, float] = OrderedDict()  # hash -> last touch (engine)
        self._thread = threading.Thread(target=self._run, name="mlxinfer-prefix-disk", daemon=True)
        self._thread.start()

    def path(self, h: bytes, fmt: BlockFormat | None = None) -> Path:
        """Where the file of ``h`` (a block; or in ``fmt``, e.g. a state snapshot) lives."""
        fmt = fmt or self.format
        name = hashlib.sha256(fmt.fingerprint.encode() + h).hexdigest()
        return self.root / name[:2] / f"{name}.safetensors"

    # -- the engine thread: admission -------------------------------------------------------

    def promote(
        self,
        prompt: list[int],
        agree: Callable[[int], int] | None = None,
        salts: dict[int, bytes] | None = None,
    ) -> int:
        """Bring the blocks of ``prompt``'s prefix that the pools lack, and disk has, into the
        pools as cached blocks (hashed, unreferenced: what a prefix hit takes), up to the first
        block neither holds; the pools' own lookup then shares them. Returns the blocks read.

        A window pool needs only the blocks the deepest one's window sees. Blocks memory holds
        are made the most recently used first, so these allocations evict other prefixes.
        ``agree(n)``: across ranks, the fewest any rank has (each rank's files are its own:
        one may lack a block another holds), so that every rank's pools take the same blocks.
        ``salts``: the images of the prompt's blocks (``images.py``): files are named by the
        same chain hashes as the pools' blocks, images and all."""
        pool = self.pools[0]
        bs = pool.block_size
        hashes = chain_hashes(prompt, bs, (len(prompt) - 1) // bs, salts)
        n = 0  # the chain's blocks that memory (the first pool) or disk holds
        for h in hashes:
            if not pool.holds(h) and not self.path(h).exists():
                break
            n += 1
        if agree is not None:
            n = agree(n)
        wanted = [(p, range(p.first_seen(n * bs) if p.window else 0, n)) for p in self.pools]
        for p, span in wanted:
            _freshen(p, [hashes[i] for i in span])
        self.touch(hashes[:n])
        missing = sorted({i for p, span in wanted for i in span if not p.holds(hashes[i])})
        missing = missing[: min(p.max_blocks - len(p._refs) for p in self.pools)]
        read = {}
        for i in missing:
            arrays = self.read(hashes[i])
            if arrays is None:  # gone, or bad (removed): the prefix ends before it
                break
            read[i] = arrays
        if agree is not None:  # the same missing blocks everywhere: keep the fewest read
            read = dict(list(read.items())[: agree(len(read))])
        for k, (p, span) in enumerate(wanted):
            at = [i for i in span if i in read and not p.holds(hashes[i])]
            blocks = [_cached_block(p, hashes[i]) for i in at]
            parts = [self._parts(read[i], k) for i in at]
            p.import_blocks(blocks, parts)
            for b in blocks:  # unreferenced now: cached, in chain order
                p._unref(b)
        self.loaded += len(read)
        return len(read)

    def _parts(self, arrays: list[np.ndarray], k: int) -> list[np.ndarray]:
        """The arrays of pool ``k`` among a file's."""
        sizes = [len(p._arrays()) for p in self.pools]
        start = sum(sizes[:k])
        return arrays[start : start + sizes[k]]

    def read(self, h: bytes, fmt: BlockFormat | None = None) -> list[np.ndarray] | None:
        """The arrays of block ``h``'s file (``fmt``: another kind's), or None: no file, or
        one that is not this block of this model (then it is removed)."""
        fmt = fmt or self.format
        path = self.path(h, fmt)
        try:  # non-blocking: a FIFO planted under the name must not hang the engine
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("%s: cannot read (%s); the prefix is computed again", path, e)
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._reject(path, "not a regular file")
                return None
            blob = f.read(fmt.max_bytes + 1)
        arrays = fmt.decode(blob, h)
        if isinstance(arrays, str):
            self._reject(path, arrays)
            return None
        try:
            os.utime(path)  # the LRU's clock
        except OSError:
            pass
        return arrays

    def _reject(self, path: Path, reason: str) -> None:
        self.rejected += 1
        log.warning("%s: %s; removed (the prefix is computed again)", path, reason)
        try:
            path.unlink()
        except OSError:
            pass

    # -- the engine thread: saving -----------------------------------------------------------

    def save_fresh(self) -> None:
        """Queue the blocks hashed since the last call (still holding that hash, in every pool,
        not on disk yet) for the writer; what does not fit the queue is dropped."""
        fresh, self.fresh = self.fresh, []
        pool = self.pools[0]
        keep = [h for h, b in fresh if pool._hash_of.get(b) == h and b < pool.n_blocks]
        keep = [h for h in keep if all(p.holds(h) for p in self.pools)]
        keep = [h for h in keep if not self.path(h).exists()]
        with self._cond:
            room = max(0, (self.queue_bytes - self._pending) // max(self.data_bytes, 1))
        if len(keep) > room:
            self.dropped += len(keep) - room
            keep = keep[:room]
        if not keep:
            return
        per_pool = [p.export_blocks([p._by_hash[h] for h in keep]) for p in self.pools]
        with self._cond:
            for j, h in enumerate(keep):
                arrays = [a for contents in per_pool for a in contents[j]]
                self._queue.append((h, arrays, self.format))
                self._pending += self.data_bytes
            self._cond.notify_all()

    def offer(self, h: bytes, arrays: list[np.ndarray], fmt: BlockFormat) -> bool:
        """Queue one file of ``fmt`` for the writer; False (dropped) if the queue is full."""
        with self._cond:
            if self._pending + fmt.data_bytes > self.queue_bytes or len(self._queue) >= _MAX_QUEUED:
                self.dropped += 1
                return False
            self._queue.append((h, arrays, fmt))
            self._pending += fmt.data_bytes
            self._cond.notify_all()
        return True

    def touch(self, hashes: list[bytes]) -> None:
        """Mark these blocks' files used now (their place in the LRU), on the writer thread;
        a block touched in the last minute is not touched again (a request waiting for room
        looks its prefix up every turn)."""
        now = time.monotonic()
        fresh = [h for h in hashes if now - self._touched.get(h, -_TOUCH_EVERY_S) >= _TOUCH_EVERY_S]
        for h in fresh:
            self._touched[h] = now
            self._touched.move_to_end(h)
        while len(self._touched) > _TOUCHED_KEPT:
            self._touched.popitem(last=False)
        with self._cond:
            if fresh and len(self._queue) < _MAX_QUEUED:  # a touch is dropped rather than kept
                self._queue.append((None, fresh, None))
                self._cond.notify_all()

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                h, arrays, fmt = self._queue.popleft()
            try:
                if h is None:
                    for t in arrays:
                        try:
                            os.utime(self.path(t))
                        except OSError:
                            pass
                else:
                    self._write(h, arrays, fmt)
            except Exception as e:  # a full disk, a removed directory: the block is not kept
                self.failed += 1
                if self.failed == 1:
                    log.warning("prefix cache on disk: a block write failed (%s)", e)
            finally:
                if h is not None:
                    with self._cond:
                        self._pending -= fmt.data_bytes
                        self._cond.notify_all()

    def _write(self, h: bytes, arrays: list[np.ndarray], fmt: BlockFormat) -> None:
        path = self.path(h, fmt)
        if path.exists():  # another engine wrote it meanwhile
            os.utime(path)
            return
        blob = fmt.encode(h, arrays)
        with writing_file(path) as tmp:
            tmp.write_bytes(blob)
        self.written += 1
        if self._total is None:
            self._total = sum(size for _, size, _ in self._files())
        else:
            self._total += len(blob)
        if self._total > self.budget:
            self.evict()

    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block file under the root (any model's)."""
        out = []
        for sub in self.root.iterdir() if self.root.is_dir() else []:
            if not sub.is_dir() or sub.name.startswith("."):
                continue
            for entry in os.scandir(sub):
                if entry.name.startswith(".") or not entry.name.endswith(".safetensors"):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def evict(self) -> None:
        """Remove the least recently used files (every model's: the budget is the directory's)
        until they hold at most 90 % of the budget."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.budget * _EVICT_TO:
                break
            try:
                path.unlink()
                self.evicted += 1
            except FileNotFoundError:
                pass  # another engine removed it
            except OSError:
                continue
            total -= size
        self._total = total

    def bytes_on_disk(self) -> int:
        return sum(size for _, size, _ in self._files())

    # -- the caller ----------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (True), or ``timeout`` seconds (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._pending == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (within ``timeout`` seconds), then stop the writer."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)


def _freshen(pool, hashes: list[bytes]) -> None:
    """Make the cached blocks of ``hashes`` the pool's most recently used."""
    for h in hashes:
        block = pool._by_hash.get(h)
        if block is not None and block in pool._cached:
            pool._cached.move_to_end(block)


def _cached_block(pool, h: bytes) -> int:
    """A block of ``pool`` for hash ``h``, referenced once (the caller unrefs it: cached)."""
    block = pool._allocate(_NO_RESERVATION)
    pool._by_hash[h], pool._hash_of[block] = block, h
    return block
