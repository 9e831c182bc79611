"""One prefix block as a safetensors file (the disk tier's, ``disk.py``): its tensors, and the
bytes written and checked.

A file holds one block of every layer of an engine's pools, in each store's order
(``BlockStore._arrays``): ``{layer}.k`` and ``{layer}.v`` (kv_heads, block_size, dim), or in a
quantized pool ``{layer}.k.0`` … ``.2`` (packed words, scales, biases); a window pool's as
``w{layer}...``. Its metadata names the format, the model's fingerprint, the block's chain hash
and the SHA-256 of the data. :meth:`BlockFormat.decode` takes nothing on trust: the size, the
header (JSON, no key twice, every tensor's name, dtype, shape and offsets), the metadata and the
digest must all be what this engine would write for that block.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError
from .store import LayerShape

FORMAT = "mlxinfer-prefix-block"
VERSION = "1"
_MAX_HEADER = 1 << 16  # our headers are a few KB per hundred layers
_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}


class DiskTierError(MlxInferError):
    """The prefix cache directory cannot be used (not a directory, not writable), or a pool
    whose blocks it cannot store."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    offset: int  # in the data section
    nbytes: int


def tensor_layout(pools: list[list[LayerShape]], block_size: int) -> list[Tensor]:
    """The tensors of one block's file: each pool's in its store's order
    (``BlockStore._arrays``), the window pool's named ``w{layer}...``."""
    out, offset = [], 0
    for prefix, layers in zip(("", "w"), pools):
        for t in _pool_layout(layers, block_size, prefix):
            out.append(Tensor(t.name, t.dtype, t.shape, offset, t.nbytes))
            offset += t.nbytes
    return out


def _pool_layout(layers: list[LayerShape], block_size: int, prefix: str) -> list[Tensor]:
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
                name = f"{prefix}{i}.{side}{suffix}"
                out.append(Tensor(name, _DTYPES[dtype], shape, offset, nbytes))
                offset += nbytes
    return out


def listed_layout(tensors: list[tuple[str, mx.Dtype, tuple[int, ...]]]) -> list[Tensor]:
    """The layout of a file of these (name, dtype, shape) tensors, in this order."""
    out, offset = [], 0
    for name, dtype, shape in tensors:
        if dtype not in _DTYPES:
            raise DiskTierError(f"prefix cache on disk: dtype {dtype} is not stored")
        nbytes = int(np.prod(shape)) * dtype.size
        out.append(Tensor(name, _DTYPES[dtype], tuple(shape), offset, nbytes))
        offset += nbytes
    return out


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


class BlockFormat:
    """The files of one engine's blocks: ``pools`` (each a list of layer shapes), ``block_size``
    tokens, the model ``fingerprint``."""

    def __init__(
        self,
        pools: list[list[LayerShape]],
        block_size: int,
        fingerprint: str,
        layout: list[Tensor] | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.layout = layout if layout is not None else tensor_layout(pools, block_size)
        self.data_bytes = sum(t.nbytes for t in self.layout)
        self.max_bytes = 8 + _MAX_HEADER + self.data_bytes
        self._tensors = {  # the header's tensor entries, as written and as expected
            t.name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [t.offset, t.offset + t.nbytes],
            }
            for t in self.layout
        }

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
