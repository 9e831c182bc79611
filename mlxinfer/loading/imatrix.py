"""Activation-importance statistics ("importance matrices", imatrix): the container and its files.

For each linear layer, the sum over calibration tokens of ``x**2`` per input channel and the number
of tokens counted; the mean ``sum / count`` weighs each input column when a quantizer fits scales.
MoE experts stacked in one weight keep one row and one count per expert (the tokens routed to it).

:class:`Importance` holds them by our module path (``model.layers.0.self_attn.q_proj``):
``sums[path]`` float32 ``(K,)`` or ``(E, K)``, ``counts[path]`` int64 ``()`` or ``(E,)``.
:func:`load_importance` reads three formats, told apart by their first bytes:

* ours (:func:`save_importance`), a safetensors file: ``<path>.in_sum2`` (F32, ``(K,)`` or
  ``(E, K)``) and ``<path>.counts`` (I64, ``()`` or ``(E,)``) for each path, counts in tokens;
  ``meta`` in the safetensors metadata, beside ``mlxinfer.imatrix`` (the format version, ``1``).
  Written atomically (a temporary sibling, fsynced, renamed: ``files/atomic.py``).
* llama.cpp's GGUF imatrix and its legacy ``.dat``, their GGUF tensor names mapped to module paths:
  ``imatrix_llamacpp.py`` reads them (its module doc has both layouts and the mapping).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import WeightsError
from ..files.atomic import write_bytes
from ..files.safetensors_check import read_header
from ..gguf.container import shown
from .imatrix_llamacpp import COUNT, SUM, read_llamacpp

FORMAT_KEY, FORMAT_VERSION = "mlxinfer.imatrix", "1"


@dataclass
class Importance:
    """Per module path: ``sums`` float32 (K,) / (E, K) of x**2, ``counts`` int64 () / (E,) tokens."""

    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    meta: dict[str, str] = field(default_factory=dict)

    def mean(self, path: str) -> np.ndarray | None:
        """``sums / counts`` (float32, the shape of ``sums``); a row whose count is 0 is ones
        (no evidence: every channel alike, llama-quantize's rule); None for an unknown path."""
        if path not in self.sums:
            return None
        s = np.asarray(self.sums[path], np.float64)
        c = np.asarray(self.counts[path], np.int64)
        c = np.broadcast_to(c[..., None] if s.ndim == 2 else c, s.shape)
        out = np.ones(s.shape, np.float32)
        seen = c > 0
        out[seen] = (s[seen] / c[seen]).astype(np.float32)
        return out

    def merge(self, other: Importance) -> Importance:
        """Both together: sums and counts added where a path is in both, kept where in one.

        Raises WeightsError when a path has other shapes in the two, or the counts are in other
        units (tokens against a legacy file's chunks)."""
        units = self.meta.get("count_unit", "tokens"), other.meta.get("count_unit", "tokens")
        if units[0] != units[1]:
            raise WeightsError(
                f"cannot merge importance statistics counted in {units[0]} with ones counted in "
                f"{units[1]}; expected the same unit"
            )
        sums, counts = {}, {}
        for path in sorted(set(self.sums) | set(other.sums)):
            if path not in other.sums or path not in self.sums:
                src = self if path in self.sums else other
                sums[path], counts[path] = src.sums[path].copy(), src.counts[path].copy()
                continue
            a, b = self.sums[path], other.sums[path]
            if a.shape != b.shape or self.counts[path].shape != other.counts[path].shape:
                raise WeightsError(
                    f"cannot merge importance of {path}: sums {a.shape} and {b.shape}, counts "
                    f"{self.counts[path].shape} and {other.counts[path].shape}; expected equal shapes"
                )
            sums[path] = (a.astype(np.float64) + b).astype(np.float32)
            counts[path] = (self.counts[path] + other.counts[path]).astype(np.int64)
        meta = dict(other.meta)
        for key, value in self.meta.items():
            theirs = other.meta.get(key)
            if key == "tokens" and theirs is not None and value.isdigit() and theirs.isdigit():
                meta[key] = str(int(value) + int(theirs))
            elif theirs is None or theirs == value:
                meta[key] = value
            else:
                meta[key] = f"{value} + {theirs}"
        return Importance(sums, counts, meta)


# ---------------------------------------------------------------------------
# Our format


def _check_entry(where: str, path: str, sums: np.ndarray, counts: np.ndarray) -> None:
    """One path's arrays: sums (K,) or (E, K), finite and >= 0; counts () or (E,), >= 0."""
    if sums.ndim not in (1, 2) or sums.shape[-1] < 1 or min(sums.shape) < 1:
        raise WeightsError(
            f"{where}: {path}{SUM}: expected shape (K,) or (experts, K), found {sums.shape}"
        )
    want = sums.shape[:1] if sums.ndim == 2 else ()
    if counts.shape != want:
        raise WeightsError(
            f"{where}: {path}{COUNT}: expected shape {want} for sums of shape {sums.shape}, "
            f"found {counts.shape}"
        )
    bad = ~np.isfinite(sums) | (sums < 0)
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), sums.shape)
        raise WeightsError(
            f"{where}: {path}{SUM}: expected finite sums of squares >= 0, found {sums[i]} at "
            f"index {tuple(int(j) for j in i)}"
        )
    if (counts < 0).any():
        raise WeightsError(
            f"{where}: {path}{COUNT}: expected counts >= 0, found {int(counts.min())}"
        )


def save_importance(imp: Importance, path) -> None:
    """Write ``imp`` as our safetensors format (module doc), atomically.

    Raises WeightsError (naming ``path``) for inconsistent statistics or non-string meta."""
    path = Path(path)
    if set(imp.sums) != set(imp.counts):
        odd = sorted(set(imp.sums) ^ set(imp.counts))[0]
        raise WeightsError(f"{path}: {odd} has sums without counts or counts without sums")
    for key, value in imp.meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise WeightsError(
                f"{path}: meta {key!r}: expected a string value, found {type(value).__name__}"
            )
    header: dict = {"__metadata__": {**imp.meta, FORMAT_KEY: FORMAT_VERSION}}
    blobs, offset = [], 0
    for name in sorted(imp.sums):
        sums = np.asarray(imp.sums[name])
        counts = np.asarray(imp.counts[name])
        if sums.dtype.kind != "f" or counts.dtype.kind not in "iu":
            raise WeightsError(
                f"{path}: {name}: expected float sums and integer counts, found "
                f"{sums.dtype} and {counts.dtype}"
            )
        sums, counts = sums.astype("<f4"), counts.astype("<i8")
        _check_entry(str(path), name, sums, counts)
        for key, arr, dtype in ((name + SUM, sums, "F32"), (name + COUNT, counts, "I64")):
            data = np.ascontiguousarray(arr).tobytes()
            header[key] = {
                "dtype": dtype,
                "shape": list(arr.shape),
                "data_offsets": [offset, offset + len(data)],
            }
            blobs.append(data)
            offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data section 8-byte aligned, as safetensors writes it
    write_bytes(path, struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _load_ours(path: Path, buf) -> Importance:
    tensors = read_header(path)  # every offset, size and dtype checked against the file
    (n,) = struct.unpack("<Q", buf[:8])
    meta = dict(json.loads(bytes(buf[8 : 8 + n]).decode("utf-8")).get("__metadata__") or {})
    version = meta.pop(FORMAT_KEY, FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise WeightsError(
            f"{path}: {FORMAT_KEY} format version {shown(version)}; expected {FORMAT_VERSION}"
        )
    start = 8 + n
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for key, info in tensors.items():
        suffix = SUM if key.endswith(SUM) else COUNT if key.endswith(COUNT) else None
        want = {SUM: "F32", COUNT: "I64"}.get(suffix or "")
        if suffix is None or info["dtype"] != want:
            raise WeightsError(
                f"{path}: tensor {shown(key)} ({info['dtype']}): expected '<path>{SUM}' (F32) "
                f"or '<path>{COUNT}' (I64)"
            )
        begin, end = info["data_offsets"]
        dtype = "<f4" if suffix == SUM else "<i8"
        a = np.frombuffer(buf[start + begin : start + end], dtype).reshape(info["shape"])
        arrays.setdefault(key[: -len(suffix)], {})[suffix] = a.astype(dtype[1:])
    sums, counts = {}, {}
    for name, pair in sorted(arrays.items()):
        for suffix in (SUM, COUNT):
            if suffix not in pair:
                have = SUM if suffix == COUNT else COUNT
                raise WeightsError(f"{path}: {name}{have} has no {name}{suffix}")
        _check_entry(str(path), name, pair[SUM], pair[COUNT])
        sums[name], counts[name] = pair[SUM], pair[COUNT]
    return Importance(sums, counts, meta)


# ---------------------------------------------------------------------------


def load_importance(path, *, arch: str | None = None, config: dict | None = None) -> Importance:
    """Read ours, llama.cpp's GGUF or its legacy .dat imatrix (module doc), told apart by their
    first bytes. llama.cpp's names are mapped to module paths for ``arch`` (or config's
    ``model_type``); ``config`` also gives the expert count and layer count.

    Raises WeightsError, naming the file, for anything missing, malformed or unmappable."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        # ours: safetensors, '{' after the 8-byte header length (a GGUF's 9th byte may be '{'
        # too; a legacy name never starts with it)
        if bytes(buf[:4]) != b"GGUF" and len(buf) > 8 and bytes(buf[8:9]) == b"{":
            return _load_ours(path, buf)
        return Importance(*read_llamacpp(path, buf, arch=arch, config=config))  # GGUF or .dat
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
