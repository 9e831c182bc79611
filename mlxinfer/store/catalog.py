"""What the store holds: :func:`entries` (and, read-only, the models other apps downloaded),
:func:`show`, :func:`remove` (never outside the store; not a model a server holds unless
``force``) and :func:`copy` (another name for a model, sharing its files)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import MlxInferError
from ..files.atomic import discard_dir, fsync_path, scratch_dir
from ..files.manifest import (
    MANIFEST_NAME,
    check_sizes,
    read_manifest,
    verify,
)
from ..files.safetensors_check import read_header
from ..loading import memory
from ..models.config import WITH_TOWER
from .layout import (
    SOURCE_NAME,
    inside_store,
    read_source,
    require,
    store_root,
    stored_models,
    stored_name,
    write_source,
)
from .names import StoreError, parse_name
from .others import other_models
from .servers import holds


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def context_length(config: dict) -> int | None:
    c = _text_config(config)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(c.get(key), int) and not isinstance(c.get(key), bool) and c[key] > 0:
            return c[key]
    return None


def _weights(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.glob("*.safetensors") if p.name != "imatrix.safetensors")


def parameters(model_dir: Path, config: dict) -> int | None:
    """Parameters counted from the safetensors headers; a quantized weight by its groups."""
    record = config.get("quantization") if isinstance(config.get("quantization"), dict) else {}
    default_group = record.get("group_size") or 64
    total = 0
    try:
        for f in _weights(model_dir):
            header = read_header(f)
            for key, info in header.items():
                shape = info.get("shape", [])
                if key.endswith((".scales", ".biases")):
                    continue
                n = math.prod(shape)
                base = key.removesuffix(".weight")
                if info.get("dtype") == "U32" and f"{base}.scales" in header:
                    layer = record.get(base) if isinstance(record.get(base), dict) else {}
                    group = layer.get("group_size") or default_group
                    n = math.prod(header[f"{base}.scales"]["shape"]) * group
                total += n
    except MlxInferError:
        return None
    return total or None


def _capabilities(model_dir: Path, config: dict) -> list[str]:
    template = ""
    for name in ("chat_template.jinja", "tokenizer_config.json", "chat_template.json"):
        try:
            template += (model_dir / name).read_text(encoding="utf-8", errors="replace")[: 1 << 20]
        except OSError:
            pass
    found = ["completion"]
    if "tools" in template:
        found.append("tools")
    if "<think>" in template or "enable_thinking" in template or "reasoning" in template:
        found.append("thinking")
    if isinstance(config.get("vision_config"), dict) and config.get("model_type") in WITH_TOWER:
        found.append("vision")  # a tower that runs here (a vision_config alone: text only)
    if (model_dir / "modules.json").is_file():
        found.append("embedding")
    return found


def _quantization(config: dict) -> dict[str, str]:
    """Quantization per layer kind: ``{"default": "4-bit g64", "mlp.down_proj": "6-bit g64"...}``."""
    record = config.get("quantization")
    if not isinstance(record, dict):
        return {"default": "float (not quantized)"}

    def text(entry: dict) -> str:
        if entry is False:
            return "float"
        bits, group = entry.get("bits"), entry.get("group_size")
        mode = entry.get("mode") or record.get("mode") or "affine"
        return f"{bits}-bit g{group}" + ("" if mode == "affine" else f" {mode}")

    kinds: dict[str, set[str]] = {}
    for key, entry in record.items():
        if isinstance(entry, dict) or entry is False:
            kind = ".".join(p for p in key.split(".")[-2:] if not p.isdigit())
            kinds.setdefault(kind, set()).add(text(entry) if entry is not False else "float")
    out = {"default": text(record)}
    out.update({k: ", ".join(sorted(v)) for k, v in sorted(kinds.items())})
    return out


def _describe(model_dir: Path, name: str, source: str) -> dict[str, Any]:
    config = _config(model_dir)
    params = parameters(model_dir, config)
    weights = sum(f.stat().st_size for f in _weights(model_dir))
    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    record = read_source(model_dir) or {}
    return {
        "name": name,
        "path": str(model_dir),
        "source": source,
        "family": _text_config(config).get("model_type") or config.get("model_type"),
        "parameters": params,
        "bits_per_weight": round(weights * 8 / params, 2) if params else None,
        "context_length": context_length(config),
        "bytes": size,
        "repo": record.get("repo"),
        "commit": record.get("commit"),
        "modified": os.stat(model_dir).st_mtime,
    }


def entries(*, cache_dir: Path | None = None, others: bool = True) -> list[dict[str, Any]]:
    """The store's models (``source: "store"``), then (``others``) those other apps keep that
    mlxinfer runs in place, read-only: ``hf-cache``, ``lm-studio``, ``ollama``."""
    root = store_root(cache_dir)
    found = []
    for model_dir in stored_models(root):
        found.append(_describe(model_dir, stored_name(model_dir, root), "store"))
    if others:
        for name, path, source in other_models():
            if path.is_dir():
                found.append(_describe(path, name, source))
            else:
                found.append({"name": name, "path": str(path), "source": source,
                              "bytes": path.stat().st_size, "modified": path.stat().st_mtime,
                              "family": None, "parameters": None, "bits_per_weight": None,
                              "context_length": None, "repo": None, "commit": None})  # fmt: skip
    return found


def show(name: str, *, cache_dir: Path | None = None, check: bool = False) -> dict[str, Any]:
    """What ``name`` is: architecture, context length, parameters, quantization per layer
    kind, capabilities, chat template, licence, source, the manifest check (``check``: every
    file's SHA-256, else sizes only), and whether it fits this machine up to what context."""
    model = parse_name(name)
    root = store_root(cache_dir)
    path = require(model, root)
    info = _describe(path, name, "store")
    config = _config(path)
    record = read_source(path) or {}
    template = None
    for file in ("chat_template.jinja",):
        if (path / file).is_file():
            template = (path / file).read_text(encoding="utf-8", errors="replace")
    if template is None:
        try:
            tok = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            template = tok.get("chat_template") if isinstance(tok, dict) else None
        except (OSError, ValueError):
            pass
    if check:
        v = verify(path)
        status = "ok" if v.ok else "; ".join(v.problems) or "no manifest"
    else:
        try:
            check_sizes(path)
            status = "sizes ok (check=True hashes every file)"
        except MlxInferError as e:
            status = str(e)
    info.update(
        architecture=_text_config(config).get("model_type") or config.get("model_type"),
        quantization=_quantization(config),
        capabilities=_capabilities(path, config),
        chat_template=template if isinstance(template, str) else None,
        license=record.get("license"),
        recipe=record.get("recipe"),
        pulled_at=record.get("pulled_at"),
        verify=status,
        **fits(path, config),
    )
    return info


def fits(model_dir: Path, config: dict) -> dict[str, Any]:
    """Whether the weights fit what this machine can give now (loading/memory.py), and the
    longest context whose KV cache fits beside them (float32 on the CPU backend, else 16-bit)."""
    import types

    import mlx.core as mx

    dtype = mx.float32 if mx.default_device().type == mx.DeviceType.cpu else None
    weights = memory.weights_bytes(_weights(model_dir), dtype)
    room = memory.capacity(memory.recommended_working_set())
    per_token = memory.kv_bytes_per_token_estimate(
        types.SimpleNamespace(**_text_config(config)), dtype
    )
    if room is None:
        return {"fits": None, "fits_context": None, "memory_available": None}
    spare = room.bytes - weights - memory.HEADROOM
    context = context_length(config)
    most = spare // per_token if per_token and spare > 0 else None
    return {
        "fits": spare > 0,
        "fits_context": min(most, context) if most is not None and context else most,
        "memory_available": room.bytes,
        "weights_in_memory": weights,
    }


def remove(name: str, *, force: bool = False, cache_dir: Path | None = None) -> Path:
    """Delete ``name`` from the store (only there: a path or a link out of it is refused).
    A model the running server holds is refused unless ``force``. Returns the removed path."""
    model = parse_name(name)
    root = store_root(cache_dir)
    path = require(model, root)
    if path.is_symlink() or not inside_store(path, root):
        raise StoreError(f"rm {name}: {path} is not inside the store {root}; not removed")
    if not force and holds(model, cache_dir=cache_dir):
        raise StoreError(
            f"rm {name}: the running server holds it; stop it first (mlxinfer stop {name}) or "
            "pass --force"
        )
    discard_dir(path)
    for parent in (path.parent, path.parent.parent):  # empty <name>/ and <org>/ folders
        if parent != root and inside_store(parent, root):
            try:
                parent.rmdir()
            except OSError:
                break
    return path


def copy(src: str, dst: str, *, cache_dir: Path | None = None) -> Path:
    """``dst`` as another name of the stored model ``src``: the same files (hard links, no more
    disk), its own source record. Returns the new model's directory."""
    source, target = parse_name(src), parse_name(dst)
    root = store_root(cache_dir)
    src_dir = require(source, root)
    dst_dir = target.path(root.parent)
    if dst_dir.exists():
        raise StoreError(f"cp {src} {dst}: {target} already exists in the store; rm it first")
    listed = read_manifest(src_dir)  # {path: {size, sha256}}, None without a manifest
    with scratch_dir(root / ".work", f"cp-{target.name}") as work:
        out = work / "model"
        for file in sorted(p for p in src_dir.rglob("*") if p.is_file()):
            rel = file.relative_to(src_dir)
            if rel.as_posix() in (SOURCE_NAME, MANIFEST_NAME):
                continue
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(file, out / rel)
            except OSError:  # another file system, or no hard links: a copy
                shutil.copyfile(file, out / rel)
        record = {k: v for k, v in (read_source(src_dir) or {}).items() if k != "format"}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record.update(name=str(target), copied_from=str(source), copied_at=now)
        write_source(out, record, listed)
        dst_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out, dst_dir)
        fsync_path(dst_dir.parent)
    return dst_dir
