"""safetensors files and shard indexes, checked before MLX reads a byte of them.

MLX's loader trusts a file's header: a tensor whose byte count overflows 64 bits, with empty
data offsets, loads as an array over no memory, and the first reduction over it crashes the
process. So every file is parsed here first, by the safetensors library's own rules
(``safetensors`` 0.4+: ``read_metadata`` and ``Metadata::validate``):

* 8 bytes, the header's length N (little-endian), at most ``MAX_HEADER_BYTES``, then N bytes of
  UTF-8 JSON: an object whose ``__metadata__`` (optional, or null) maps strings to strings and whose
  other keys are tensors ``{"dtype", "shape", "data_offsets": [begin, end]}``;
* each dtype one MLX loads, each shape a list of ints >= 0 (below 2**31: MLX's dimensions are
  int32), and the shape's element count times the dtype's size, in exact integers, equal to
  ``end - begin``;
* the ranges, in order of their offsets, each beginning where the one before ended: no overlap,
  no gap, and the last ending at the end of the file (8 + N + the data section).

A tensor name given twice is refused too (JSON readers disagree on which one wins).

A shard index (``model.safetensors.index.json``) may only name files inside the model directory
(no ``..``, no absolute path, no symlink that leads out of it: CVE-2024-37032 was a path
traversal by a model's file names). A Hugging Face cache snapshot is the one exception the
layout needs: its files are symlinks into the repository's ``blobs/``.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from ..errors import WeightsError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's MAX_HEADER_SIZE
MAX_INDEX_BYTES = 64 << 20  # a shard index lists names: the largest known are a few MB
MAX_DIM = 2**31 - 1  # MLX shapes are int32
# The dtypes MLX 0.32's safetensors reader accepts, in bits per element (the library's table;
# F8_E5M2, F6_*, F4 and F64 are valid safetensors that MLX refuses, so they are refused here).
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "C64": 64,
}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _json(data: bytes) -> Any:
    """JSON with duplicate keys refused; RecursionError (deep nesting) as ValueError."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file declares (name -> dtype, shape, data_offsets), checked as
    the module doc says; raises WeightsError with a one-line reason otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(
                    f"{path}: not a safetensors file (expected an 8-byte header length, "
                    f"found a {len(head)}-byte file)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise WeightsError(
                    f"{path}: header of {n} bytes, over the safetensors limit of {MAX_HEADER_BYTES}"
                )
            if 8 + n > size:
                raise WeightsError(
                    f"{path}: truncated (header of {n} bytes, but the file has {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = _json(raw)
    except (UnicodeDecodeError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise WeightsError(f"{path}: header is not valid UTF-8 JSON ({reason})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: header should be a JSON object, found {type(header).__name__}")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            if info is None:  # the library's Option: null is no metadata
                continue
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise WeightsError(
                    f"{path}: '__metadata__' should map strings to strings, found {_short(info)}"
                )
            continue
        tensors[name] = _tensor(path, name, info)
    _check_layout(path, tensors, data_bytes=size - 8 - n)
    return tensors


def _tensor(path: Path, name: str, info: Any) -> dict[str, Any]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise WeightsError(
            f"{where}: expected an object with dtype, shape and data_offsets, found {_short(info)}"
        )
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise WeightsError(
            f"{where}: dtype {_short(dtype)} is not one MLX loads "
            f"(expected one of {', '.join(DTYPE_BITS)})"
        )
    if not isinstance(shape, list) or not all(_int(d) and 0 <= d <= MAX_DIM for d in shape):
        raise WeightsError(
            f"{where}: shape should be a list of ints in 0..{MAX_DIM}, found {_short(shape)}"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_int(o) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise WeightsError(
            f"{where}: data_offsets should be [begin, end] with 0 <= begin <= end, found "
            f"{_short(offsets)}"
        )
    elements = 1
    for d in shape:
        elements *= d  # Python ints: exact, no overflow
    bits = elements * DTYPE_BITS[dtype]
    if bits // 8 != offsets[1] - offsets[0]:
        raise WeightsError(
            f"{where}: shape {shape} of {dtype} is {bits // 8} bytes, but data_offsets "
            f"{offsets} hold {offsets[1] - offsets[0]}"
        )
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _check_layout(path: Path, tensors: dict[str, dict[str, Any]], data_bytes: int) -> None:
    """The ranges, sorted as the library sorts them, tile the data section exactly."""
    end = 0
    for name, info in sorted(tensors.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, stop = info["data_offsets"]
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise WeightsError(
                f"{path}: tensor {name!r} data_offsets {[begin, stop]} {what} "
                f"(expected it to begin at {end})"
            )
        end = stop
    if end != data_bytes:
        if end > data_bytes:
            raise WeightsError(
                f"{path}: truncated (the tensors need {end} data bytes, the file holds "
                f"{data_bytes})"
            )
        raise WeightsError(
            f"{path}: {data_bytes - end} bytes after the last tensor (expected the data to end "
            f"the file at {end} data bytes)"
        )


def check_safetensors(path: Path) -> None:
    """Raise WeightsError unless ``path`` is a complete, well-formed safetensors file."""
    read_header(path)


def index_files(model_dir: Path, index: Path) -> list[Path]:
    """The shard files ``index`` (model.safetensors.index.json) names, each checked to lie
    inside ``model_dir`` and to exist; raises WeightsError naming the index otherwise."""
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise WeightsError(
                f"{index}: {index.stat().st_size} bytes, over the {MAX_INDEX_BYTES}-byte limit "
                "for a shard index"
            )
        data = _json(index.read_bytes())
    except OSError as e:
        raise WeightsError(f"{index}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise WeightsError(f"{index}: not valid JSON ({reason})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(
            f"{index}: expected an object with 'weight_map' mapping tensor names to file names, "
            f"found {_short(weight_map if isinstance(data, dict) else data)}"
        )
    files = []
    for name in sorted(set(weight_map.values())):
        file = inside(model_dir, name, index)
        if not file.is_file():
            raise WeightsError(f"{index}: lists shard {name!r}, which is missing")
        files.append(file)
    return files


def inside(model_dir: Path, name: str | os.PathLike, source: Path | str) -> Path:
    """``model_dir / name``, refused (WeightsError naming ``source``) unless ``name`` is a plain
    relative path that, symlinks followed, stays inside ``model_dir`` (or, for a Hugging Face
    cache snapshot, inside its repository's ``blobs/``) and is not a device or pipe."""
    model_dir = Path(model_dir)
    pure = Path(name)
    if str(name) == "" or "\x00" in str(name) or pure.is_absolute() or ".." in pure.parts:
        raise WeightsError(
            f"{source}: file name {str(name)!r} leads outside the model directory "
            "(expected a name relative to it, without '..')"
        )
    file = model_dir / pure
    if not os.path.lexists(file):
        return file  # the caller reports the missing file
    real, roots = Path(os.path.realpath(file)), [Path(os.path.realpath(model_dir))]
    if model_dir.resolve().parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<rev>
        roots.append(model_dir.resolve().parent.parent / "blobs")
    if not any(real == root or root in real.parents for root in roots):
        raise WeightsError(
            f"{source}: {str(name)!r} is a link to {real}, outside the model directory {model_dir}"
        )
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return file
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise WeightsError(f"{source}: {str(name)!r} is not a regular file")
    return file


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
