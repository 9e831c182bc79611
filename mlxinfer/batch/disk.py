"""The prefix cache's disk tier: full KV blocks kept as files, so a restart starts warm.

Layout. ``DIR/blocks/<xx>/<name>.safetensors``, one file per block, ``name`` the SHA-256 of
the model's fingerprint (:mod:`~mlxinfer.fingerprint`) and the block's chain hash
(:func:`~.pool.block_hash`): two models, or one model with other KV bits, never share a
name; two engines of one model share every block. There is no index: the least recently
used blocks are the files with the oldest mtimes (a read touches its file, and so does a
hit in memory), so engines sharing a directory share nothing mutable but whole files,
each written to a temporary sibling, fsynced and renamed (:mod:`~mlxinfer.atomic`).

A file holds one block of every layer of the pool: ``{layer}.k`` and ``{layer}.v``
(kv_heads, block_size, dim), or in a quantized pool ``{layer}.k.0`` … ``.2`` (packed words,
scales, biases); its metadata names the format, the fingerprint, the block's hash and the
SHA-256 of its data. A read checks all of it against what this pool expects (the size,
every name, dtype, shape and offset, the fingerprint, the hash, the digest) before a byte
is used: a truncated, corrupted or foreign file (another model's, another ``kv_bits``') is
removed, with a warning, and the prefix is computed again.

Writes stay off the decode path: after each turn of its loop the engine thread copies the
turn's new full blocks out of the store (one gather per array) and queues them; a writer
thread writes them. The queue holds at most ``queue_bytes``: past that, blocks are dropped
(a later request writes them), never waited for. Past ``budget`` bytes on disk the oldest
files go, down to 90 % of it. :meth:`DiskTier.close` (``Engine.close``) writes what is
queued first.

Hook for recurrent state (models with recurrent layers are not on disk yet): a state
snapshot taken at a block boundary would be a second file beside the block's, named by the
same hash with its own tensor list (``snapshot.{layer}.{i}``), read only where the block is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..atomic import writing_file
from ..errors import MlxInferError
from ..fingerprint import model_fingerprint
from .pool import block_hash
from .store import LayerShape

FORMAT = "mlxinfer-prefix-block"
VERSION = "1"
DEFAULT_DISK_BYTES = 10 << 30  # 10 GiB
DEFAULT_QUEUE_BYTES = 256 << 20  # blocks waiting for the writer, at most
_EVICT_TO = 0.9  # past the budget, the oldest files go down to this part of it
_MAX_QUEUED = 4096  # queued writes and touches, at most (the writes: queue_bytes too)
_MAX_HEADER = 1 << 16  # our headers are a few KB per hundred layers
_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}

log = logging.getLogger("mlxinfer.prefix_cache")


class DiskTierError(MlxInferError):
    """The prefix cache directory cannot be used (not a directory, not writable)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    offset: int  # in the data section
    nbytes: int


def tensor_layout(layers: list[LayerShape], block_size: int) -> list[Tensor]:
    """The tensors of one block's file, in the store's order (``BlockStore._arrays``)."""
    out, offset = [], 0
    for i, s in enumerate(layers):
        for side, dim in (("k", s.key_dim), ("v", s.value_dim)):
            if s.bits is None:
                parts = [("", s.dtype, dim)]
            else:
                groups = dim // s.group_size
                parts = [(".0", mx.uint32, dim * s.bits // 32)]
                parts += [(f".{j}", s.dtype, groups) for j in (1, 2)]
            for suffix, dtype, width in parts:
                if dtype not in _DTYPES:
                    raise DiskTierError(f"prefix cache on disk: KV dtype {dtype} is not stored")
                shape = (s.kv_heads, block_size, width)
                nbytes = int(np.prod(shape)) * dtype.size
                out.append(Tensor(f"{i}.{side}{suffix}", _DTYPES[dtype], shape, offset, nbytes))
                offset += nbytes
    return out


def attach(
    model, pool, *, directory: str | os.PathLike, budget: int | None, shared_only: str | None
) -> DiskTier | None:
    """The disk tier of ``pool`` (the engine's dense pool) under ``directory``; None, with a
    warning, where ``shared_only`` names why the engine's prefixes cannot go to disk."""
    if shared_only is not None:
        log.warning("prefix cache on disk: off for this model (%s)", shared_only)
        return None
    root = Path(directory).expanduser()
    layers = [
        (s.kv_heads, s.key_dim, s.value_dim, str(s.dtype), s.bits, s.group_size)
        for s in pool.layers
    ]
    storage = {"block_size": pool.block_size, "layers": layers}
    digest = model_fingerprint(model, storage, root)
    budget = DEFAULT_DISK_BYTES if budget is None else budget
    return DiskTier(root, digest, pool.layers, pool.block_size, budget=budget)


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


class DiskTier:
    """The files of one pool's blocks under ``root``, for the model ``fingerprint`` names."""

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: str,
        layers: list[LayerShape],
        block_size: int,
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
        self.layout = tensor_layout(layers, block_size)
        self.data_bytes = sum(t.nbytes for t in self.layout)
        self._tensors = {  # the header's tensor entries, as written and as expected
            t.name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [t.offset, t.offset + t.nbytes],
            }
            for t in self.layout
        }
        self.budget, self.queue_bytes = budget, queue_bytes
        self.fresh: list[tuple[bytes, int]] = []  # (hash, block) hashed since the last save
        self.loaded = self.written = self.dropped = self.rejected = self.evicted = 0
        self.failed = 0  # writes that failed (disk full, permissions): the block is not kept
        self._queue: deque = deque()
        self._pending = 0  # bytes queued or being written
        self._cond = threading.Condition()
        self._closed = False
        self._total: int | None = None  # bytes of block files on disk (the writer's count)
        self._thread = threading.Thread(target=self._run, name="mlxinfer-prefix-disk", daemon=True)
        self._thread.start()

    def path(self, h: bytes) -> Path:
        name = hashlib.sha256(self.fingerprint.encode() + h).hexdigest()
        return self.root / name[:2] / f"{name}.safetensors"

    # -- the engine thread: admission -------------------------------------------------------

    def load_into(self, pool, seq, prompt: list[int]) -> int:
        """Continue ``seq``'s shared prefix (admitted from memory, its reservation made) with
        the blocks of ``prompt`` that memory or disk holds, up to the first that neither does;
        returns the blocks added. Each block read from disk takes one of the reservation's."""
        bs = pool.block_size
        self.touch(list(seq.hashes))
        parent = seq.hashes[-1] if seq.hashes else b""
        added, blocks, contents = 0, [], []
        for i in range(len(seq.hashes), (len(prompt) - 1) // bs):
            tokens = prompt[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens)
            if seq.reserved < 1:
                break
            block = pool._by_hash.get(h)
            if block is not None:  # a later block still in memory (LRU evicts chains' heads)
                pool._take(block)
                seq.reserved -= 1
                pool._reserved -= 1
                self.touch([h])
            else:
                arrays = self.read(h)
                if arrays is None:
                    break
                block = pool._allocate(seq)
                blocks.append(block)
                contents.append(arrays)
                pool._by_hash[h], pool._hash_of[block] = block, h
                self.loaded += 1
            seq.blocks.append(block)
            seq.hashes.append(h)
            seq.tokens.extend(tokens)
            parent = h
            added += 1
        pool.import_blocks(blocks, contents)
        return added

    def read(self, h: bytes) -> list[np.ndarray] | None:
        """The arrays of block ``h``'s file, or None: no file, or one that is not this block
        of this model (then it is removed)."""
        path = self.path(h)
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
            blob = f.read(8 + _MAX_HEADER + self.data_bytes + 1)
        arrays = self.decode(blob, h)
        if isinstance(arrays, str):
            self._reject(path, arrays)
            return None
        try:
            os.utime(path)  # the LRU's clock
        except OSError:
            pass
        return arrays

    def decode(self, blob: bytes, h: bytes) -> list[np.ndarray] | str:
        """The arrays of a block file's bytes, or why they are not block ``h`` of this pool."""
        if len(blob) < 8:
            return f"truncated ({len(blob)} bytes)"
        (n,) = struct.unpack("<Q", blob[:8])
        if n > _MAX_HEADER:
            return f"header of {n} bytes (expected at most {_MAX_HEADER})"
        if len(blob) != 8 + n + self.data_bytes:
            return f"{len(blob)} bytes, expected {8 + n + self.data_bytes} (truncated or foreign)"
        try:
            header = json.loads(blob[8 : 8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            return f"header is not valid JSON ({' '.join(str(e).split())[:120]})"
        if not isinstance(header, dict):
            return "header is not a JSON object"
        meta = header.pop("__metadata__", None)
        expected = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint}
        expected["block"] = h.hex()
        if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in expected.items()):
            found = {k: meta.get(k) for k in expected} if isinstance(meta, dict) else meta
            return f"metadata {str(found)[:200]} is not this model's block (fingerprint, kv_bits)"
        if header != self._tensors:
            return "tensors are not this pool's (names, dtypes, shapes or offsets differ)"
        data = memoryview(blob)[8 + n :]
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            return "data does not match its SHA-256 (corrupted)"
        return [
            np.frombuffer(
                data, _NUMPY[t.dtype], t.nbytes // np.dtype(_NUMPY[t.dtype]).itemsize, t.offset
            ).reshape(t.shape)
            for t in self.layout
        ]

    def _reject(self, path: Path, reason: str) -> None:
        self.rejected += 1
        log.warning("%s: %s; removed (the prefix is computed again)", path, reason)
        try:
            path.unlink()
        except OSError:
            pass

    # -- the engine thread: saving -----------------------------------------------------------

    def save_fresh(self, pool) -> None:
        """Queue the blocks hashed since the last call (still holding that hash, not on disk
        yet) for the writer; what does not fit the queue is dropped."""
        fresh, self.fresh = self.fresh, []
        keep = [(h, b) for h, b in fresh if pool._hash_of.get(b) == h and b < pool.n_blocks]
        keep = [(h, b) for h, b in keep if not self.path(h).exists()]
        with self._cond:
            room = max(0, (self.queue_bytes - self._pending) // max(self.data_bytes, 1))
        if len(keep) > room:
            self.dropped += len(keep) - room
            keep = keep[:room]
        if not keep:
            return
        contents = pool.export_blocks([b for _, b in keep])
        with self._cond:
            for (h, _), arrays in zip(keep, contents):
                self._queue.append((h, arrays))
                self._pending += self.data_bytes
            self._cond.notify_all()

    def touch(self, hashes: list[bytes]) -> None:
        """Mark these blocks' files used now (their place in the LRU), on the writer thread."""
        with self._cond:
            if hashes and len(self._queue) < _MAX_QUEUED:  # a touch is dropped rather than kept
                self._queue.append((None, hashes))
                self._cond.notify_all()

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                h, arrays = self._queue.popleft()
            try:
                if h is None:
                    for t in arrays:
                        try:
                            os.utime(self.path(t))
                        except OSError:
                            pass
                else:
                    self._write(h, arrays)
            except Exception as e:  # a full disk, a removed directory: the block is not kept
                self.failed += 1
                if self.failed == 1:
                    log.warning("prefix cache on disk: a block write failed (%s)", e)
            finally:
                if h is not None:
                    with self._cond:
                        self._pending -= self.data_bytes
                        self._cond.notify_all()

    def encode(self, h: bytes, arrays: list[np.ndarray]) -> bytes:
        """The bytes of block ``h``'s file."""
        for t, a in zip(self.layout, arrays):
            if a.shape != t.shape or a.nbytes != t.nbytes:
                raise ValueError(f"prefix cache on disk: {t.name} is {a.shape}, expected {t.shape}")
        data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        header: dict = {
            "__metadata__": {
                "format": FORMAT,
                "version": VERSION,
                "fingerprint": self.fingerprint,
                "block": h.hex(),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        }
        header.update(self._tensors)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        return struct.pack("<Q", len(raw)) + raw + data

    def _write(self, h: bytes, arrays: list[np.ndarray]) -> None:
        path = self.path(h)
        if path.exists():  # another engine wrote it meanwhile
            os.utime(path)
            return
        blob = self.encode(h, arrays)
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
