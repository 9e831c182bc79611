"""The GGUF container: its header (metadata and tensor directory) and each tensor's bytes.

Read from a buffer holding the whole file (an mmap): every count, type and
offset is checked against the file before anything is read, so a truncated or
damaged file is a one-line ``WeightsError`` naming the file and what is missing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import WeightsError
from . import quants as gq

# ---------------------------------------------------------------------------
# Reading the container

# GGUF metadata value types: code -> struct format (None: string / array).
_VALUE_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    8: None,
    9: None,
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY_OF_FORMAT = {
    "B": np.uint8,
    "b": np.int8,
    "H": np.uint16,
    "h": np.int16,
    "I": np.uint32,
    "i": np.int32,
    "f": np.float32,
    "?": np.bool_,
    "Q": np.uint64,
    "q": np.int64,
    "d": np.float64,
}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols); GGUF stores it reversed
    type_name: str
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Sequential little-endian reads from a buffer; running off its end is a truncated file."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def span(self, n: int) -> slice:
        """The next ``n`` bytes, bounds-checked; moves past them."""
        end = self.pos + n
        if end > len(self.buf):
            raise WeightsError(
                f"{self.path}: truncated GGUF header: needs byte {end}, file has {len(self.buf)}"
            )
        span, self.pos = slice(self.pos, end), end
        return span

    def take(self, fmt: str):
        return struct.unpack("<" + fmt, self.buf[self.span(struct.calcsize("<" + fmt))])[0]

    def string(self) -> str:
        return self.buf[self.span(self.take("Q"))].decode("utf-8", errors="replace")

    def value(self, code: int):
        if code == 8:
            return self.string()
        if code == 9:
            item, count = self.take("I"), self.take("Q")
            fmt = _VALUE_FORMATS.get(item)
            if fmt is not None:  # numeric array: one numpy read
                dtype = np.dtype(_NUMPY_OF_FORMAT[fmt]).newbyteorder("<")
                return np.frombuffer(self.buf[self.span(count * dtype.itemsize)], dtype)
            if item != 8 and item != 9:
                raise WeightsError(
                    f"{self.path}: unknown GGUF metadata value type {item} at byte {self.pos - 12}"
                )
            return [self.value(item) for _ in range(count)]
        if code not in _VALUE_FORMATS:
            raise WeightsError(
                f"{self.path}: unknown GGUF metadata value type {code} at byte {self.pos - 4}"
            )
        return self.take(_VALUE_FORMATS[code])


def read_gguf_header(path: Path, buf) -> tuple[dict, dict[str, GGUFTensor]]:
    """Parse metadata and tensor directory from ``buf`` (the whole file, e.g. an mmap).

    Checks that every tensor's type is supported and its data lies inside the file.
    """
    cur = _Cursor(buf, path)
    if len(buf) < 4 or bytes(buf[:4]) != b"GGUF":
        raise WeightsError(
            f"{path}: not a GGUF file: expected magic b'GGUF', found {bytes(buf[:4])!r}"
        )
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise WeightsError(
            f"{path}: unsupported GGUF version {version} (expected 2 or 3, little-endian)"
        )
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    if n_tensors > len(buf) or n_kv > len(
        buf
    ):  # each needs bytes: a garbage count is a damaged header
        raise WeightsError(
            f"{path}: truncated GGUF header: claims {n_tensors} tensors and {n_kv} keys"
        )

    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, tuple(reversed(dims)), cur.take("I"), cur.take("Q")))

    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, code, rel_offset in infos:
        if code not in gq.TYPES:
            type_name = gq.OTHER_TYPE_NAMES.get(code, f"type {code}")
            raise WeightsError(
                f"{path}: tensor {name} has unsupported type {type_name} "
                f"(supported: {', '.join(t.name for t in gq.TYPES.values())})"
            )
        t = gq.TYPES[code]
        if not shape or shape[-1] % t.block:
            raise WeightsError(
                f"{path}: tensor {name} row length {shape[-1] if shape else 0} is not a multiple "
                f"of {t.block} ({t.name} blocks)"
            )
        nbytes = int(np.prod(shape)) // t.block * t.nbytes
        offset = data_start + rel_offset
        if offset + nbytes > len(buf):
            raise WeightsError(
                f"{path}: truncated GGUF: tensor {name} needs bytes up to {offset + nbytes}, file has {len(buf)}"
            )
        tensors[name] = GGUFTensor(name, shape, t.name, offset, nbytes)
    return metadata, tensors


def tensor_bytes(buf, t: GGUFTensor) -> np.ndarray:
    return np.frombuffer(
        buf[t.offset : t.offset + t.nbytes], np.uint8
    )  # a copy: no export pins the mmap
