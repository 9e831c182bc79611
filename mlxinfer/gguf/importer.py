"""Import a llama.cpp GGUF file into an mlxinfer model directory.

``import_gguf(src, dst)`` reads the GGUF container itself (no ``gguf`` package at
run time; ``mx.load`` is not used either: on mlx 0.32 it decodes Q4_K wrongly
and refuses Q5_0), then writes the same HF-like directory ``convert`` produces:
``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``,
``generation_config.json``.

Supported: the architectures names.py lists (``SUPPORTED``: Llama, Mistral, Qwen2.5/3/3.5,
Qwen3-Next, Gemma 2/3, Phi-3/4, SmolLM3, LFM2, OLMo 2/3, Granite, gpt-oss, GLM-4.5,
DeepSeek-V2/V3 and GLM-4.7-Flash; their MTP layers become ``model.mtp_layers``); tensor types
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL (exact), Q4_K, Q5_K, Q6_K, IQ4_XS
(quants.py); ``gpt2`` (byte-level BPE, split as ``tokenizer.ggml.pre`` names: vocab.py) and
``llama`` (SentencePiece) vocabularies
(vocab.py).

Quantized tensors stay quantized, each as tensors.py describes (exact types bit for bit,
K-quants keeping their codes or re-quantized with ``requantize=(bits, group_size)``); the
report lists, per K-quant tensor, how far the stored weights are from the file's (max |error|
and relative RMS error).

A file may mix types (Gemma 3's Q4_K_M mixes Q5_0, Q4_K, Q6_K and Q8_0), so the
``quantization`` record in config.json carries the most common (bits, group
size) at the top level plus one entry per module that differs, keyed by module
path (``{"bits": 8, "group_size": 32, "mode": "affine"}``, ``"mode": "mxfp4"``
for MXFP4 experts, or ``false`` for a module left in floating point).

Stacked experts (``ffn_*_exps``, (E, out, in)) are quantized per row like any
matrix; gate and up are fused into one ``experts.gate_up_proj`` (arch.py, tensors.py).
"""

from __future__ import annotations

import json
import mmap
import os
from collections import Counter
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError, WeightsError
from ..files.atomic import writing_dir
from ..files.manifest import existing_output_error, write_manifest
from ..platform.progress import Progress, counted, finished, resolve
from . import quants as gq
from .arch import SETTINGS, SUPPORTED, check_fused, fused_part, import_names, split
from .arch_config import make_config
from .container import read_gguf_header, tensor_bytes
from .dense import DTYPES, write_float
from .tensors import fuse_halves, stored_parts
from .vocab import build_tokenizer


def import_gguf(
    src: Path,
    dst: Path,
    *,
    requantize: tuple[int, int] | None = None,
    dtype: str | None = None,
    progress: bool | Progress = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Convert a GGUF file into a model directory at ``dst``.

    Args:
      src: the .gguf file.
      dst: the directory to create; must not exist (or be empty). Files are written to a
        temporary sibling and renamed into place, so a failure leaves nothing behind.
      requantize: ``(bits, group_size)`` for every K-quant and IQ4 tensor; default: keep
        Q4_K/Q5_K codes, Q6_K -> 8-bit group 32, IQ4 levels as 8-bit codes (module docs). Exact types are never re-rounded.
      dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``: every tensor dequantized to that
        dtype instead (dense.py); ``requantize`` then quantizes the float weights as
        ``convert -q`` quantizes a Hugging Face checkpoint.
      progress: True: a tqdm bar over tensors (on stderr); a callback: (stage, done, total).
      log: receives one summary line about K-quant losses.

    Returns:
      ``{"path", "parameters", "n_params", "bits_per_weight", "bytes", "quantization", "kquant_loss"}``:
      parameter count (dequantized), stored weight bits per parameter, total bytes written,
      the config.json record, and ``{module: {"type", "bits", "group_size", "codes_kept",
      "max_abs", "rel_rmse"}}`` per K-quant tensor. With ``dtype``, ``"loss"`` instead of
      ``"kquant_loss"``: ``{tensor: {"type", "dtype", ["bits", "group_size"], "max_abs",
      "rel_rmse"}}`` per tensor stored differently from the file.

    Raises:
      WeightsError: not GGUF, truncated, unsupported architecture or tensor type.
      TokenizerError: a vocabulary other than byte-level BPE or SentencePiece.
    """
    report = resolve(progress)
    try:
        return _import(Path(src), Path(dst), requantize, dtype, report, log)
    finally:
        finished(report)


def _import(src: Path, dst: Path, requantize, dtype, progress: Progress, log) -> dict:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise MlxInferError(existing_output_error(dst))
    if dtype is not None and dtype not in DTYPES:
        raise MlxInferError(f"dtype: expected one of {', '.join(DTYPES)}, found '{dtype}'")
    if requantize is not None:
        bits, group = requantize
        if bits not in (2, 3, 4, 5, 6, 8) or group not in (32, 64, 128):
            raise MlxInferError(
                f"requantize: bits must be 2-6 or 8 and group size 32, 64 or 128, "
                f"found bits={bits}, group size={group}"
            )
    try:
        f = open(src, "rb")
    except OSError as e:
        raise WeightsError(f"{src}: cannot open GGUF file: {e.strerror}") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            raise WeightsError(f"{src}: not a GGUF file: it is empty")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            md, tensors = read_gguf_header(src, buf)
            arch = md.get("general.architecture")
            if arch not in SUPPORTED:
                raise WeightsError(
                    f"{src}: general.architecture is {arch!r}; only "
                    f"{', '.join(repr(a) for a in SUPPORTED)} are supported"
                )
            if "token_embd.weight" not in tensors:
                raise WeightsError(f"{src}: no token_embd.weight tensor")
            read: set[str] = set()

            def values(t):
                read.add(t.name)
                return gq.dequantize(tensor_bytes(buf, t), t.type_name, t.shape)

            config = make_config(arch, src, md, tensors, values)
            unread = [n for n in SETTINGS if n in tensors and n not in read]
            if unread:  # a setting the model would otherwise silently lose
                raise WeightsError(f"{src}: tensor {unread[0]} is not supported for {arch} files")
            tensors = {n: t for n, t in tensors.items() if n not in SETTINGS}  # read just now
            check_fused(src, tensors)
            tok_json, tok_config = build_tokenizer(src, md)
            names = import_names(arch, src, tensors, config)
            tensors = {n: t for n, t in tensors.items() if n in names}  # less MTP copies

            with writing_dir(dst) as tmp:
                if dtype is None:
                    report = _write(tmp, buf, tensors, names, arch, config, requantize, progress)
                else:
                    report = _write_float(
                        tmp, buf, tensors, names, arch, config, dtype, requantize, progress
                    )
                _write_tokenizer(tmp, tok_json, tok_config, config)
                write_manifest(tmp)  # last: it lists every file above
        finally:
            buf.close()
    report["bytes"] = sum(p.stat().st_size for p in dst.iterdir())
    report["path"] = str(dst)
    if log is not None and report.get("kquant_loss"):
        worst = max(report["kquant_loss"].items(), key=lambda kv: kv[1]["rel_rmse"])
        log(
            f"{len(report['kquant_loss'])} K-quant tensors stored as affine groups; largest relative RMS "
            f"error {worst[1]['rel_rmse']:.2e} ({worst[0]}, {worst[1]['type']} -> {worst[1]['bits']}-bit "
            f"group {worst[1]['group_size']})"
        )
    if log is not None and report.get("loss"):
        worst = max(report["loss"].items(), key=lambda kv: kv[1]["rel_rmse"])
        form = (
            f"{worst[1]['bits']}-bit group {worst[1]['group_size']}"
            if "bits" in worst[1]
            else dtype
        )
        log(
            f"{len(report['loss'])} tensors dequantized to {dtype}"
            + (" and re-quantized" if requantize else "")
            + f"; largest relative RMS error {worst[1]['rel_rmse']:.2e} ({worst[0]}, {worst[1]['type']} -> {form})"
        )
    return report


def _write_float(
    tmp: Path,
    buf,
    tensors: dict,
    names: dict,
    arch: str,
    config: dict,
    dtype: str,
    quantize: tuple[int, int] | None,
    progress: Progress,
) -> dict:
    """model.safetensors and config.json with every tensor dequantized to ``dtype``; the report."""
    weights, losses = write_float(
        buf,
        tensors,
        names,
        arch,
        config,
        dtype=dtype,
        quantize=quantize,
        progress=progress,
    )
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(tmp / "config.json", config)
    n_params = sum(int(np.prod(t.shape)) for t in tensors.values())
    n_bits = sum(a.nbytes * 8 for a in weights.values())
    return {
        "n_params": n_params,
        "parameters": n_params,
        "bits_per_weight": round(n_bits / n_params, 3),
        "quantization": config.get("quantization"),
        "loss": losses,
    }


def _write(
    tmp: Path,
    buf,
    tensors: dict,
    names: dict,
    arch: str,
    config: dict,
    requantize,
    progress: Progress,
) -> dict:
    """model.safetensors and config.json; returns the report."""
    weights, module_format, losses, n_params, n_bits = {}, {}, {}, 0, 0
    halves: dict[tuple[str, str], dict[int, tuple]] = {}  # fused tensors waiting for their pair
    for name, t in counted(tensors.items(), "importing tensors", progress):
        module, kind = names[name]
        parts, fmt, loss = stored_parts(buf, t, module, kind, arch, config, requantize)
        n_params += int(np.prod(t.shape))
        part = fused_part(name)
        loss_key = f"{module}.{kind}" if part is None else f"{module}.{kind} ({name})"
        if loss is not None:
            losses[loss_key] = loss
        if part is not None:
            pending = halves.setdefault((module, kind), {})
            pending[part] = (t, parts, fmt, loss_key)
            if len(pending) < 2:
                continue
            parts, fmt = fuse_halves(buf, halves.pop((module, kind)), module, kind, losses)
        for stored, some in split(arch, module, parts, config, name):
            for key, a in some.items():
                arr = mx.array(np.ascontiguousarray(a))
                if a.dtype == np.uint16:  # BF16 bits
                    arr = arr.view(mx.bfloat16)
                weights[key] = arr
                n_bits += arr.nbytes * 8
            if kind == "weight" and len(t.shape) >= 2:  # a Linear, Embedding or stacked experts
                module_format[stored] = fmt

    quantization = None
    counts = Counter(fmt for fmt in module_format.values() if fmt)
    if counts:
        bits, group, mode = counts.most_common(1)[0][0]
        quantization = {"group_size": group, "bits": bits, "mode": mode}
        for module, fmt in sorted(module_format.items()):
            if fmt != (bits, group, mode):
                quantization[module] = (
                    {"group_size": fmt[1], "bits": fmt[0], "mode": fmt[2]} if fmt else False
                )
        config["quantization"] = quantization
        config["torch_dtype"] = "float16"  # the scales' dtype
    else:
        config["torch_dtype"] = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(
            weights["model.embed_tokens.weight"].dtype, "float32"
        )

    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(tmp / "config.json", config)
    return {
        "n_params": n_params,
        "parameters": n_params,
        "bits_per_weight": round(n_bits / n_params, 3),
        "quantization": quantization,
        "kquant_loss": losses,
    }


def _write_tokenizer(tmp: Path, tok_json: str, tok_config: dict, config: dict) -> None:
    (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    _write_json(tmp / "tokenizer_config.json", tok_config)
    specials = ("bos_token", "eos_token", "unk_token", "pad_token")
    _write_json(
        tmp / "special_tokens_map.json", {k: tok_config[k] for k in specials if tok_config.get(k)}
    )
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    _write_json(tmp / "generation_config.json", {k: config[k] for k in ids if k in config})


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
