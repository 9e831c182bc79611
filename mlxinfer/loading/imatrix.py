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
* llama.cpp's GGUF imatrix (``llama-imatrix``'s default output; its
  ``tools/imatrix/imatrix.cpp`` ``save_imatrix`` writes it, ``common/imatrix-loader.cpp`` reads it):
  ``general.type = "imatrix"``, ``imatrix.datasets`` (strings), ``imatrix.chunk_count`` and
  ``imatrix.chunk_size`` (uint32); per weight ``<gguf name>.in_sum2``, F32 with ggml dimensions
  ``[K, n_mat]`` (numpy ``(n_mat, K)``: one row per expert, experts in order), and
  ``<gguf name>.counts``, F32 ``[1, n_mat]``: tokens counted per matrix, whole numbers stored as
  floats (llama.cpp reads them with ``lround``); a dense weight has ``n_mat = 1``. An optional
  ``<gguf name>.in_sum`` (sum of ``x``, same size) is checked for size and not kept.
* llama.cpp's legacy ``.dat`` (``--output-format dat``; ``save_imatrix_legacy``), little-endian:
  int32 ``n_entries``; per entry int32 name length, the name, int32 ``ncall``, int32 ``nval``,
  ``nval`` float32 ``values``; then, optional, int32 last chunk and int32 length + the dataset
  name. ``values[i] = sum[i] / count * ncall`` with ``ncall`` the chunks seen (ceil(max count /
  chunk size)), an expert never routed to stored as ``1 * ncall``; so the mean is ``values /
  ncall`` (``values`` as they are when ``ncall`` is 0: llama-quantize's rule). We keep
  ``sums = values`` and ``counts = ncall`` (1 when 0): the means are exact, the counts are chunks,
  not tokens (``meta["count_unit"] = "chunks"``; :meth:`Importance.merge` refuses to mix units).
  Experts share one flat row of ``E * K`` values and one ``ncall``: splitting it needs ``E``, the
  config's ``num_experts`` / ``num_local_experts``.

GGUF tensor names map to module paths through ``gguf/arch.py``'s :func:`~mlxinfer.gguf.arch.hf_module`
for ``arch`` (llama.cpp's architecture name; or from ``config["model_type"]``). Only input-channel
statistics are stored, so llama.cpp's Q/K row permutation (llama) changes nothing here. The halves
of a fused weight, ``ffn_gate_exps`` and ``ffn_up_exps`` (our ``experts.gate_up_proj``), see the same
input: one half's statistics serve the fused weight, and both, when present, must agree.
``output.weight`` (collected with ``--process-output``) is ``lm_head``. Names
that map to no module (another architecture's, a layer past ``num_hidden_layers`` such as a
NextN layer, a non-weight) are left out and counted in ``meta["unmapped"]`` (the first few in
``meta["unmapped_names"]``). Anything malformed is one :class:`~mlxinfer.errors.WeightsError`
naming the file, the entry and what was expected and found; every length is checked against the
file's size before anything is allocated for it.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import WeightsError
from ..files.atomic import write_bytes
from ..files.safetensors_check import read_header
from ..gguf.arch import SUPPORTED, fused_part, hf_module
from ..gguf.container import GGUFTensor, read_gguf_header, shown, tensor_bytes

SUM, COUNT, SUM1 = ".in_sum2", ".counts", ".in_sum"
FORMAT_KEY, FORMAT_VERSION = "mlxinfer.imatrix", "1"
MAX_LEGACY_NAME = 1024  # bytes; llama.cpp's names are at most 63 (GGML_MAX_NAME)
UNMAPPED_SHOWN = 20  # names listed in meta["unmapped_names"]
AGREE_RTOL = 1e-5  # fused halves: their means must agree this closely
ARCH_OF_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp converts Mistral as "llama"
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gpt_oss": "gpt-oss",
}


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
# llama.cpp's formats: raw entries {gguf name: (sums (n_mat, K) float32, counts (n_mat,) int64)}


def _check_raw(path: Path, name: str, sums: np.ndarray, what: str) -> None:
    bad = ~np.isfinite(sums) | (sums < 0)
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        raise WeightsError(
            f"{path}: {what} {name}: expected finite sums of squares >= 0, found "
            f"{sums.reshape(-1)[i]} at value {i}"
        )


def _read_gguf(path: Path, buf) -> tuple[dict, dict[str, str]]:
    metadata, tensors = read_gguf_header(path, buf)
    kind = metadata.get("general.type")
    if kind != "imatrix":
        raise WeightsError(
            f"{path}: general.type: expected 'imatrix' (a llama.cpp importance matrix), found "
            f"{shown(str(kind)) if kind is not None else 'none'}"
        )
    groups: dict[str, dict[str, GGUFTensor]] = {}
    for tname, t in tensors.items():
        for suffix in (SUM, COUNT, SUM1):  # .in_sum2 before .in_sum: it ends the same way
            if tname.endswith(suffix):
                groups.setdefault(tname[: -len(suffix)], {})[suffix] = t
                break  # other tensors are ignored, as llama.cpp does
    raw = {}
    for name, parts in sorted(groups.items()):
        if SUM not in parts or COUNT not in parts:
            missing = SUM if SUM not in parts else COUNT
            raise WeightsError(f"{path}: entry {name}: no {name}{missing} tensor")
        for suffix, t in parts.items():
            if t.type_name != "F32":
                raise WeightsError(
                    f"{path}: tensor {name}{suffix}: expected F32, found {t.type_name}"
                )
        s_t, c_t = parts[SUM], parts[COUNT]
        shape = s_t.shape
        if len(shape) > 2:
            raise WeightsError(
                f"{path}: tensor {name}{SUM}: expected (matrices, K), found shape {shape}"
            )
        n_mat, k = (1, shape[0]) if len(shape) == 1 else shape
        n_counts = int(np.prod(c_t.shape))
        if n_counts != n_mat:
            raise WeightsError(
                f"{path}: tensor {name}{COUNT}: expected {n_mat} counts (one per row of "
                f"{name}{SUM}, shape {tuple(shape)}), found shape {c_t.shape}"
            )
        if SUM1 in parts and int(np.prod(parts[SUM1].shape)) != n_mat * k:
            raise WeightsError(
                f"{path}: tensor {name}{SUM1}: expected {n_mat * k} values like {name}{SUM}, "
                f"found shape {parts[SUM1].shape}"
            )
        sums = tensor_bytes(buf, s_t).view("<f4").astype(np.float32).reshape(n_mat, k)
        _check_raw(path, name, sums, "entry")
        c = tensor_bytes(buf, c_t).view("<f4").astype(np.float64)
        if not (np.isfinite(c).all() and (c >= 0).all() and (c < 2.0**62).all()):
            bad = c[~(np.isfinite(c) & (c >= 0) & (c < 2.0**62))][0]
            raise WeightsError(
                f"{path}: tensor {name}{COUNT}: expected token counts >= 0, found {bad}"
            )
        raw[name] = (sums, np.rint(c).astype(np.int64))
    meta = {"format": "llama.cpp imatrix (GGUF)", "count_unit": "tokens"}
    datasets = metadata.get("imatrix.datasets")
    if isinstance(datasets, list):
        meta["datasets"] = json.dumps([str(d) for d in datasets])
    for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
        if key in metadata:
            meta[key.split(".", 1)[1]] = str(metadata[key])
    return raw, meta


class _Reader:
    """Little-endian int32 reads of a legacy .dat, each checked against the file's end."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos = path, buf, 0

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise WeightsError(
                f"{self.path}: truncated legacy imatrix (.dat): {what} needs {n} bytes at byte "
                f"{self.pos}, {self.left()} left of {len(self.buf)}"
            )
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]


def _read_dat(path: Path, buf) -> tuple[dict, dict[str, str]]:
    r = _Reader(path, buf)
    n_entries = r.i32("the entry count")
    min_entry = 4 + 1 + 4 + 4 + 4  # name length, a 1-byte name, ncall, nval, one value
    if n_entries < 1 or n_entries * min_entry > r.left():
        raise WeightsError(
            f"{path}: legacy imatrix (.dat; not GGUF or safetensors either): entry count "
            f"{n_entries}; expected at least 1 and at most {r.left() // min_entry} (what a "
            f"{len(buf)}-byte file can hold)"
        )
    raw: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(n_entries):
        n = r.i32(f"entry {i}'s name length")
        if not 1 <= n <= min(MAX_LEGACY_NAME, r.left()):
            raise WeightsError(
                f"{path}: legacy imatrix (.dat): entry {i}: name length {n}; expected 1 to "
                f"{min(MAX_LEGACY_NAME, r.left())} (bytes left in the file)"
            )
        name = r.take(n, f"entry {i}'s name").decode("utf-8", errors="replace")
        if not name.isprintable():
            raise WeightsError(
                f"{path}: legacy imatrix (.dat): entry {i}: name {shown(name)}; expected "
                "printable text"
            )
        if name in raw:
            raise WeightsError(
                f"{path}: legacy imatrix (.dat): entry {name} appears twice; expected once"
            )
        ncall = r.i32(f"entry {name}'s ncall")
        nval = r.i32(f"entry {name}'s value count")
        if ncall < 0 or not 1 <= nval <= r.left() // 4:
            raise WeightsError(
                f"{path}: legacy imatrix (.dat): entry {name}: ncall {ncall}, nval {nval}; "
                f"expected ncall >= 0 and nval 1 to {r.left() // 4} (bytes left / 4)"
            )
        values = np.frombuffer(r.take(4 * nval, f"entry {name}'s values"), "<f4")
        values = values.astype(np.float32).reshape(1, nval)
        _check_raw(path, name, values, "legacy imatrix (.dat): entry")
        raw[name] = (values, np.array([max(ncall, 1)], np.int64))  # ncall 0: values are means
    meta = {"format": "llama.cpp imatrix (legacy .dat)", "count_unit": "chunks"}
    if r.left():  # optional: the last chunk, then the dataset's name
        meta["chunk_count"] = str(r.i32("the trailing chunk count"))
        if r.left():
            n = r.i32("the dataset name's length")
            if not 0 <= n <= r.left():
                raise WeightsError(
                    f"{path}: legacy imatrix (.dat): dataset name length {n}; expected 0 to "
                    f"{r.left()} (bytes left in the file)"
                )
            if n:
                dataset = r.take(n, "the dataset name").decode("utf-8", errors="replace")
                meta["datasets"] = json.dumps([dataset])
        if r.left():
            raise WeightsError(
                f"{path}: legacy imatrix (.dat): {r.left()} bytes after the dataset name; "
                "expected the file to end there"
            )
    return raw, meta


def _arch(path: Path, arch: str | None, config: dict | None) -> str:
    model_type = str((config or {}).get("model_type", ""))
    from_config = ARCH_OF_MODEL_TYPE.get(model_type)
    if model_type and from_config is None and arch is None:
        raise WeightsError(
            f"{path}: config model_type {shown(model_type)} has no llama.cpp architecture "
            f"here; expected one of {', '.join(ARCH_OF_MODEL_TYPE)}"
        )
    arch = arch if arch is not None else from_config
    if arch is None:
        raise WeightsError(
            f"{path}: a llama.cpp imatrix names GGUF tensors; mapping them to modules needs the "
            "architecture (arch=, or a config with model_type)"
        )
    if arch not in SUPPORTED:
        raise WeightsError(
            f"{path}: architecture {shown(arch)}: expected one of {', '.join(SUPPORTED)}"
        )
    if from_config is not None and from_config != arch:
        raise WeightsError(
            f"{path}: architecture {arch} but config model_type {model_type} "
            f"({from_config}); expected them to agree"
        )
    return arch


def _experts(config: dict | None) -> int | None:
    if config is None:
        return None
    n = config.get("num_experts", config.get("num_local_experts"))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _mapped(path: Path, raw: dict, meta: dict, arch: str, config: dict | None) -> Importance:
    """GGUF names -> module paths; experts split per expert; fused halves made one."""
    n_experts = _experts(config)
    n_layers = (config or {}).get("num_hidden_layers")
    sums, counts, unmapped = {}, {}, []
    halves: dict[str, dict[int, tuple[str, np.ndarray, np.ndarray]]] = {}
    for name, (s, c) in sorted(raw.items()):
        try:
            module, kind = hf_module(arch, path, name)
        except WeightsError:
            unmapped.append(name)
            continue
        layer = re.match(r"model\.layers\.(\d+)\.", module)
        past = isinstance(n_layers, int) and layer is not None and int(layer.group(1)) >= n_layers
        if kind != "weight" or past:
            unmapped.append(name)
            continue
        if name.startswith("blk.") and name.split(".")[2].endswith("_exps"):
            s, c = _per_expert(path, name, s, c, n_experts)
        elif s.shape[0] != 1:
            raise WeightsError(
                f"{path}: entry {name}: {s.shape[0]} matrices; expected 1 for a dense weight"
            )
        else:
            s, c = s[0], c.reshape(())
        part = fused_part(name)
        if part is not None:
            halves.setdefault(module, {})[part] = (name, s, c)
        else:
            sums[module], counts[module] = s, c
    for module, got in halves.items():
        (first, s, c), other = got[min(got)], got.get(max(got)) if len(got) == 2 else None
        if other is not None:
            _agree(path, (first, s, c), other)
        sums[module], counts[module] = s, c
    meta = {**meta, "arch": arch, "unmapped": str(len(unmapped))}
    if unmapped:
        more = len(unmapped) - UNMAPPED_SHOWN
        meta["unmapped_names"] = ", ".join(unmapped[:UNMAPPED_SHOWN]) + (
            f", ... ({more} more)" if more > 0 else ""
        )
    return Importance(sums, counts, meta)


def _per_expert(path: Path, name: str, s: np.ndarray, c: np.ndarray, n_experts: int | None):
    """An expert weight's statistics as (E, K) and (E,): GGUF stores a row per expert; a legacy
    .dat one flat row of E * K values, which config's expert count splits."""
    if s.shape[0] == 1 and n_experts != 1:
        if n_experts is None:
            raise WeightsError(
                f"{path}: entry {name}: {s.shape[1]} values for all experts in one row; "
                "splitting them per expert needs the model's config (num_experts)"
            )
        if s.shape[1] % n_experts:
            raise WeightsError(
                f"{path}: entry {name}: {s.shape[1]} values; expected a multiple of the "
                f"config's {n_experts} experts"
            )
        return s.reshape(n_experts, -1), np.repeat(c, n_experts)
    if n_experts is not None and s.shape[0] != n_experts:
        raise WeightsError(
            f"{path}: entry {name}: {s.shape[0]} experts; expected the config's {n_experts}"
        )
    return s, c


def _agree(path: Path, a: tuple, b: tuple) -> None:
    """The two halves of a fused weight were fed the same tokens: same shape, counts, means."""
    (na, sa, ca), (nb, sb, cb) = a, b
    if sa.shape != sb.shape or not np.array_equal(ca, cb):
        raise WeightsError(
            f"{path}: entries {na} and {nb} (one fused weight, the same input): shapes "
            f"{sa.shape} and {sb.shape}, counts {ca.tolist()} and {cb.tolist()}; expected equal"
        )
    if not np.allclose(sa, sb, rtol=AGREE_RTOL, atol=0.0):
        i = int(np.argmax(np.abs(sa - sb).reshape(-1)))
        raise WeightsError(
            f"{path}: entries {na} and {nb} (one fused weight, the same input): sums differ, "
            f"{sa.reshape(-1)[i]} and {sb.reshape(-1)[i]} at value {i}; expected equal"
        )


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
        if bytes(buf[:4]) == b"GGUF":
            raw, meta = _read_gguf(path, buf)
        elif len(buf) > 8 and bytes(buf[8:9]) == b"{":  # a legacy name never starts with '{'
            return _load_ours(path, buf)
        else:
            raw, meta = _read_dat(path, buf)
        return _mapped(path, raw, meta, _arch(path, arch, config), config)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
