"""The GGUF container: its header (metadata and tensor directory) and each tensor's bytes.

Read from a buffer holding the whole file (an mmap). The file is untrusted, so
every count, length, type and offset is checked against the file before
anything is read or allocated, and the tensor directory against the rules
llama.cpp's reader enforces (``ggml/src/gguf.cpp``):

- magic ``GGUF``, version 2 or 3 (little-endian);
- tensor and key counts, string lengths and array lengths no larger than the
  bytes left in the file could hold; arrays nested at most two deep;
- every metadata key and tensor name once; known value and tensor type codes; tensor
  names of at most 63 bytes of printable text (ggml's limit), so messages stay one line;
- ``general.alignment`` (if given) a uint32 power of two, ``general.architecture`` a string;
- 1 to 4 dimensions per tensor, each at least 1; the byte size, computed with
  Python integers, a whole number of the type's blocks; each tensor's offset a
  multiple of the alignment, its bytes inside the data section and overlapping
  no other tensor's.

Anything else is a one-line ``WeightsError`` naming the file, the key or
tensor, and what was expected and found.
"""

from __future__ import annotations

import math
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
VALUE_TYPE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "uint16",
    3: "int16",
    4: "uint32",
    5: "int32",
    6: "float32",
    7: "bool",
    8: "string",
    9: "array",
    10: "uint64",
    11: "int64",
    12: "float64",
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
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# The fewest bytes one value of each type takes: a string its 8-byte length, an array
# its 4-byte item type and 8-byte count. A count claiming more than the rest of the file
# could hold is refused before anything is allocated for it.
_MIN_VALUE_BYTES = {
    code: 8 if code == _STRING else 12 if code == _ARRAY else struct.calcsize("<" + fmt)
    for code, fmt in _VALUE_FORMATS.items()
}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dimension, type, offset
MAX_ARRAY_DEPTH = 2  # an array of arrays, no deeper (llama.cpp reads none at all)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # bytes in a tensor name (GGML_MAX_NAME, 64, holds the terminating NUL)
DEFAULT_ALIGNMENT = 32


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

    def left(self) -> int:
        return len(self.buf) - self.pos

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

    def value(self, code: int, key: str, depth: int = 0):
        """One metadata value of type ``code`` (``key`` names it in errors)."""
        if code not in _VALUE_FORMATS:
            raise WeightsError(
                f"{self.path}: GGUF key {key}: unknown value type {code} "
                f"(expected 0-12) at byte {self.pos - 4}"
            )
        if code == _STRING:
            return self.string()
        if code != _ARRAY:
            return self.take(_VALUE_FORMATS[code])
        if depth + 1 > MAX_ARRAY_DEPTH:
            raise WeightsError(
                f"{self.path}: GGUF key {key}: arrays nested more than {MAX_ARRAY_DEPTH} deep "
                "are not supported"
            )
        item, count = self.take("I"), self.take("Q")
        if item not in _VALUE_FORMATS:
            raise WeightsError(
                f"{self.path}: GGUF key {key}: unknown array item type {item} "
                f"(expected 0-12) at byte {self.pos - 12}"
            )
        need = count * _MIN_VALUE_BYTES[item]  # a Python int: no overflow
        if need > self.left():
            raise WeightsError(
                f"{self.path}: truncated GGUF header: {key} claims {count} "
                f"{VALUE_TYPE_NAMES[item]} values, at least {need} bytes; {self.left()} left"
            )
        fmt = _VALUE_FORMATS[item]
        if fmt is not None:  # numeric array: one numpy read
            dtype = np.dtype(_NUMPY_OF_FORMAT[fmt]).newbyteorder("<")
            return np.frombuffer(self.buf[self.span(need)], dtype)
        return [self.value(item, key, depth + 1) for _ in range(count)]


def shown(text: str, limit: int = 80) -> str:
    """A string from the file as a one-line message shows it: as it is if short and printable,
    else quoted with escapes and cut to ``limit`` characters."""
    if len(text) <= limit and text.isprintable():
        return text
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def read_gguf_header(path: Path, buf) -> tuple[dict, dict[str, GGUFTensor]]:
    """Parse metadata and tensor directory from ``buf`` (the whole file, e.g. an mmap).

    Checks everything listed in the module doc; raises ``WeightsError`` otherwise.
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
    if n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES > cur.left():
        raise WeightsError(
            f"{path}: truncated GGUF header: claims {n_tensors} tensors and {n_kv} keys, "
            f"more than the {cur.left()} bytes left could hold"
        )

    metadata, value_types = {}, {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise WeightsError(
                f"{path}: GGUF key {shown(key)} appears twice; expected each key once"
            )
        code = cur.take("I")
        metadata[key] = cur.value(code, shown(key))
        value_types[key] = code

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        if len(name.encode()) > MAX_NAME or not name.isprintable():
            raise WeightsError(
                f"{path}: tensor name {shown(name)}: expected at most {MAX_NAME} bytes "
                "of printable text"
            )
        n_dims = cur.take("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise WeightsError(
                f"{path}: tensor {name} has {n_dims} dimensions; expected 1 to {MAX_DIMS}"
            )
        dims = [cur.take("Q") for _ in range(n_dims)]
        if min(dims) < 1:
            raise WeightsError(
                f"{path}: tensor {name} has dimensions {dims}; expected each at least 1"
            )
        infos.append((name, tuple(reversed(dims)), cur.take("I"), cur.take("Q")))

    alignment = _alignment(path, metadata, value_types)
    if "general.architecture" in metadata and value_types["general.architecture"] != _STRING:
        raise WeightsError(
            f"{path}: general.architecture: expected a string, found a "
            f"{_type_name(metadata['general.architecture'], value_types['general.architecture'])}"
        )
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, code, rel_offset in infos:
        if name in tensors:
            raise WeightsError(
                f"{path}: tensor {name} appears twice in the directory; expected each name once"
            )
        tensors[name] = _tensor(path, buf, name, shape, code, rel_offset, data_start, alignment)
    _check_no_overlap(path, tensors)
    return metadata, tensors


def _alignment(path: Path, metadata: dict, value_types: dict) -> int:
    """``general.alignment``: a uint32 power of two (llama.cpp's rule), 32 if absent."""
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    code, value = value_types["general.alignment"], metadata["general.alignment"]
    if code != _UINT32:
        raise WeightsError(
            f"{path}: general.alignment: expected a uint32, found a {_type_name(value, code)}"
        )
    if value == 0 or value & (value - 1):
        raise WeightsError(f"{path}: general.alignment: expected a power of two, found {value}")
    return value


def _type_name(value, code: int) -> str:
    """'uint64', or 'uint8 array' for an array."""
    if code != _ARRAY:
        return VALUE_TYPE_NAMES[code]
    if isinstance(value, np.ndarray):
        item = value.dtype.name
    else:
        item = "array" if value and isinstance(value[0], (list, np.ndarray)) else "string"
    return f"{item} array"


def _tensor(path, buf, name, shape, code, rel_offset, data_start, alignment) -> GGUFTensor:
    """One directory entry, checked: its type, size (Python ints) and place in the file."""
    if code not in gq.TYPES:
        type_name = gq.OTHER_TYPE_NAMES.get(code, f"type code {code}")
        raise WeightsError(
            f"{path}: tensor {name} has unsupported type {type_name} "
            f"(supported: {', '.join(t.name for t in gq.TYPES.values())})"
        )
    t = gq.TYPES[code]
    if shape[-1] % t.block:
        raise WeightsError(
            f"{path}: tensor {name} row length {shape[-1]} is not a multiple "
            f"of {t.block} ({t.name} blocks)"
        )
    nbytes = math.prod(shape) // t.block * t.nbytes  # exact: Python ints never overflow
    if rel_offset % alignment:
        raise WeightsError(
            f"{path}: tensor {name} offset {rel_offset} is not a multiple of the "
            f"alignment {alignment}"
        )
    offset = data_start + rel_offset
    if offset + nbytes > len(buf):
        raise WeightsError(
            f"{path}: truncated GGUF: tensor {name} ({t.name}, shape {shape}) needs bytes "
            f"up to {offset + nbytes}, file has {len(buf)}"
        )
    return GGUFTensor(name, shape, t.name, offset, nbytes)


def _check_no_overlap(path: Path, tensors: dict[str, GGUFTensor]) -> None:
    """No two tensors share a byte (a hostile file could alias one tensor's data in another)."""
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for before, after in zip(ordered, ordered[1:]):
        if after.offset < before.offset + before.nbytes:
            raise WeightsError(
                f"{path}: tensor {after.name} starts at byte {after.offset}, inside tensor "
                f"{before.name} (bytes {before.offset} to {before.offset + before.nbytes}); "
                "expected tensors not to overlap"
            )


def tensor_bytes(buf, t: GGUFTensor) -> np.ndarray:
    return np.frombuffer(
        buf[t.offset : t.offset + t.nbytes], np.uint8
    )  # a copy: no export pins the mmap
