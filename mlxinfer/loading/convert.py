"""Hugging Face checkpoint (or GGUF file) → mlxinfer model directory.

``read → sanitize → (quantize) → write``. The output is written into a
temporary directory beside the destination, flushed to disk and renamed only
when complete (:mod:`mlxinfer.files.atomic`), so a failed or killed conversion leaves
nothing behind; the last file written is the manifest of every file's size and
SHA-256 (:mod:`mlxinfer.files.manifest`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import ConfigError
from ..files.atomic import writing_dir
from ..files.manifest import existing_output_error, write_manifest
from ..models import build_model, get_family
from ..models.base import language_model_weights
from ..models.config import read_config
from ..platform.progress import Progress, finished, resolve
from ..quant.transform import (
    apply_quantization,
    bits_per_weight,
    quantization_record,
    quantize_model,
)
from .loader import load_weights_into, read_weights, resolve_model_path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tiktoken.model",
)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
SHARD_BYTES = 2 << 30  # 2 GiB per safetensors shard


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    quantize: bool = False,
    bits: int = 4,
    group_size: int = 64,
    rounding: str = "minmax",
    dtype: str | None = None,
    progress: bool | Progress = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert ``src`` (HF directory, Hub repo id or ``.gguf`` file) into ``dst``.

    Args:
        quantize: store Linear/Embedding weights as affine ``bits``-bit groups.
        rounding: ``"minmax"`` (each group's scale and bias from its min and max, as
            ``mx.quantize``) or ``"mse"`` (fitted to the least squared error; same format).
            A HF checkpoint only, for now.
        dtype: float16, bfloat16 or float32 for the float weights; default: the
            checkpoint's own dtype (``torch_dtype`` / ``dtype``), else float16.
        progress: True: progress bars on stderr; a callback: ``(stage, done, total)`` for
            reading and writing the weights (bytes) or importing a GGUF's tensors
            (:mod:`mlxinfer.platform.progress`).
    Returns:
        A report: parameters, bits per weight, bytes on disk, output path.
    """
    dst = Path(dst).expanduser()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(existing_output_error(dst))
    if str(src).endswith(".gguf"):
        from ..gguf import import_gguf

        if rounding != "minmax":
            raise ConfigError(
                f"--rounding {rounding} is not supported for a GGUF source yet; convert it with "
                "--dtype float32 first, then quantize that directory"
            )
        # Without --dtype the file's own types are kept, and -q re-quantizes only its K-quant tensors;
        # with --dtype every tensor is dequantized to it, and -q quantizes as for a HF checkpoint.
        return import_gguf(
            Path(src),
            dst,
            requantize=(bits, group_size) if quantize else None,
            dtype=dtype,
            progress=progress,
            log=log,
        )
    src_dir = resolve_model_path(src)
    config = read_config(src_dir)
    source = src_dir / "config.json"
    family = get_family(config, str(source))
    model = build_model(config, str(source))
    target = _target_dtype(config, dtype, source)
    from ..tokenization import Tokenizer

    Tokenizer.from_dir(src_dir)  # a missing or broken tokenizer fails before any work

    settings = dict(bits=bits, group_size=group_size, rounding=rounding) if quantize else None
    report = resolve(progress)
    try:
        return _convert_hf(src_dir, dst, config, family, model, target, settings, report)
    finally:
        finished(report)


def _convert_hf(src_dir, dst, config, family, model, target, settings, report):
    weights = read_weights(src_dir, report)
    if config.get("language_model_of"):
        weights = language_model_weights(weights)
    weights = family.Model.sanitize(weights, model.args)
    if (stored := quantization_record(config)) is not None:  # e.g. MXFP4 experts, kept as they are
        apply_quantization(model, stored, weights)
    weights = {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    load_weights_into(model, weights, src_dir)
    drop = ("quantization_config", "language_model_of")
    out_config = {k: v for k, v in config.items() if k not in drop}
    out_config["torch_dtype"] = _dtype_name(target)
    if "dtype" in out_config:  # transformers 5's name for the same field
        out_config["dtype"] = _dtype_name(target)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    if settings is not None:  # -q: bits, group_size, rounding
        out_config["quantization"] = quantize_model(model, **settings)
    elif stored is not None:
        out_config["quantization"] = stored
    params = dict(tree_flatten(model.parameters()))

    with writing_dir(dst) as tmp:
        _write_weights(tmp, params, report)
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2, default=str))
        for name in TOKENIZER_FILES + tuple(p.name for p in src_dir.glob("*.tiktoken")):
            if (src_dir / name).is_file():
                shutil.copy2(src_dir / name, tmp / name)
        write_manifest(tmp)  # last: it lists every file above
    n_bytes = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    return {
        "path": str(dst),
        "parameters": n_params,
        "bits_per_weight": bits_per_weight(model),
        "bytes": n_bytes,
    }


def _target_dtype(config: dict, dtype: str | None, source: Path) -> mx.Dtype:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype: expected one of {', '.join(DTYPES)}, found '{dtype}'")
        return DTYPES[dtype]
    name = config.get("torch_dtype") or config.get("dtype") or "float16"
    return DTYPES.get(str(name).replace("torch.", ""), mx.float16)


def _dtype_name(dtype: mx.Dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _write_weights(out: Path, params: dict[str, mx.array], progress: Progress) -> None:
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for k, v in params.items():
        if size and size + v.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    total = sum(v.nbytes for v in params.values())
    done = 0
    progress("writing weights", 0, total)
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
            weight_map.update({k: name for k in shard})
            done += sum(v.nbytes for v in shard.values())
            progress("writing weights", done, total)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    progress("writing weights", total, total)
