"""llama.cpp's importance matrices: its GGUF imatrix and its legacy ``.dat``, read and mapped onto
our module paths (``imatrix.py``'s :func:`~mlxinfer.loading.imatrix.load_importance` reads them
through :func:`read_llamacpp`; ``imatrix.py`` has the container and our own format).

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
  not tokens (``meta["count_unit"] = "chunks"``; :meth:`~mlxinfer.loading.imatrix.Importance.merge`
  refuses to mix units). Experts share one flat row of ``E * K`` values and one ``ncall``:
  splitting it needs ``E``, the config's ``num_experts`` / ``num_local_experts``.

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
import re
import struct
from pathlib import Path

import numpy as np

from ..errors import WeightsError
from ..gguf.arch import SUPPORTED, fused_part, hf_module
from ..gguf.container import GGUFTensor, read_gguf_header, shown, tensor_bytes

# llama.cpp's tensor-name suffixes; our safetensors format (imatrix.py) names its tensors the same
SUM, COUNT, SUM1 = ".in_sum2", ".counts", ".in_sum"
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

# {module path: sums float32 (K,) / (E, K)}, {module path: counts int64 () / (E,)}, meta
Statistics = tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, str]]


def read_llamacpp(path: Path, buf, *, arch: str | None, config: dict | None) -> Statistics:
    """The GGUF imatrix (``buf`` starts with ``GGUF``) or else the legacy ``.dat`` in ``buf``
    (the file's bytes), its names mapped to module paths for ``arch`` (or config's
    ``model_type``); ``config`` also gives the expert count and layer count.

    Raises WeightsError, naming ``path``, for anything missing, malformed or unmappable."""
    if bytes(buf[:4]) == b"GGUF":
        raw, meta = _read_gguf(path, buf)
    else:
        raw, meta = _read_dat(path, buf)
    return _mapped(path, raw, meta, _arch(path, arch, config), config)


# ---------------------------------------------------------------------------
# Raw entries {gguf name: (sums (n_mat, K) float32, counts (n_mat,) int64)}


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


def _mapped(path: Path, raw: dict, meta: dict, arch: str, config: dict | None) -> Statistics:
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
    return sums, counts, meta


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
