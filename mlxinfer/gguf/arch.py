"""GGUF tensor names to Hugging Face module paths, and the per-architecture weight fixes.

The names and what each architecture's file holds: names.py; config.json from the metadata:
arch_config.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from ..errors import WeightsError
from . import qwen35
from .names import (
    FUSED,
    KIND,
    LAYER,
    NEXTN,
    NEXTN_ARCHS,
    NEXTN_COPIES,
    SETTINGS,
    SHORTCONV,
    SUPPORTED,
    TOP,
)

__all__ = [
    "SETTINGS",
    "SUPPORTED",
    "NEXTN",
    "hf_module",
    "import_names",
    "fused_part",
    "check_fused",
    "needs_float_fix",
    "fix_float",
    "reorder",
    "split",
    "permuted_heads",
    "unpermute_rows",
]


def hf_module(
    arch: str, path: Path, gguf_name: str, n_layers: int | None = None
) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight').

    ``n_layers``: the trunk's layers, for an architecture with MTP layers after them: layer
    ``n_layers + i`` (its block and its ``nextn.*`` tensors) is ``model.mtp_layers.i``.
    """
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in TOP:
        return TOP[parts[0]], parts[1]
    if len(parts) in (3, 4, 5) and parts[0] == "blk" and parts[1].isdigit():
        i = int(parts[1])
        head = n_layers is not None and arch in NEXTN_ARCHS and i >= n_layers
        layer = f"model.mtp_layers.{i - n_layers}" if head else f"model.layers.{i}"
        nextn = qwen35.NEXTN if arch in qwen35.ARCHS else NEXTN
        if arch in qwen35.ARCHS and len(parts) in (3, 4):
            found = qwen35.layer_name(parts[2], parts[3] if len(parts) == 4 else None)
            if found is not None:
                return f"{layer}.{found[0]}", found[1]
        elif len(parts) == 4 and parts[2] in LAYER[arch]:
            return f"{layer}.{LAYER[arch][parts[2]]}", KIND.get(parts[2], parts[3])
        if len(parts) == 5 and parts[2] == "nextn" and parts[3] in nextn and head:
            return f"{layer}.{nextn[parts[3]]}", parts[4]
        if len(parts) == 5 and arch == "lfm2" and parts[2] == "shortconv" and parts[3] in SHORTCONV:
            return f"{layer}.conv.{parts[3]}", parts[4]  # LFM2's gated short convolution
    raise WeightsError(f"{path}: unexpected tensor {gguf_name} for architecture {arch}")


def import_names(arch: str, path: Path, tensors: dict, config: dict) -> dict[str, tuple[str, str]]:
    """The tensors to import, each with its (module, kind): :func:`hf_module` over the file,
    less the MTP layers' copies of the embedding and LM head, and less any MTP layer whose
    ``nextn`` tensors are all absent (and every one after it: heads are kept in order), with
    a warning. A layer with some of its four ``nextn`` tensors but not all is a WeightsError."""
    n_layers = config["num_hidden_layers"]
    heads = config.get("num_nextn_predict_layers", config.get("mtp_num_hidden_layers", 0))
    if arch not in NEXTN_ARCHS:
        return {n: hf_module(arch, path, n) for n in tensors}
    by_layer: dict[int, list[str]] = {}
    names = {}
    for name in tensors:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            i = int(parts[1])
            if i >= n_layers + heads:
                raise WeightsError(
                    f"{path}: tensor {name}: expected layers 0..{n_layers + heads - 1} "
                    f"({arch}.block_count), found layer {i}"
                )
            if len(parts) == 5 and parts[2] == "nextn" and parts[3] in NEXTN_COPIES:
                if i < n_layers:
                    raise WeightsError(
                        f"{path}: tensor {name}: expected nextn tensors only in the MTP layers "
                        f"{n_layers}..{n_layers + heads - 1}, found layer {i}"
                    )
                continue
            by_layer.setdefault(i, []).append(name)
        names[name] = hf_module(arch, path, name, n_layers)
    for i in range(n_layers, n_layers + heads):
        wanted = [f"blk.{i}.nextn.{part}.weight" for part in NEXTN]
        found = [w for w in wanted if w in tensors]
        if found and len(found) < len(wanted):
            missing = next(w for w in wanted if w not in tensors)
            raise WeightsError(
                f"{path}: MTP layer {i} ({arch}.nextn_predict_layers={heads}): expected tensor "
                f"{missing} beside {found[0]}, found none"
            )
        if not found:
            later = [n for j in range(i, n_layers + heads) for n in by_layer.get(j, [])]
            if later:
                warnings.warn(
                    f"{path}: MTP layer {i} has no nextn tensors ({wanted[0]} absent): "
                    f"{len(later)} tensors of layers {i}..{n_layers + heads - 1} not imported; "
                    "the model has no MTP head from there",
                    RuntimeWarning,
                    stacklevel=3,
                )
            for n in later:
                del names[n]
            break
    return names


def fused_part(gguf_name: str) -> int | None:
    """Which half of a fused tensor this one is (0: first rows; None: not fused).

    ``ffn_gate_exps`` and ``ffn_up_exps`` (E, I, ...) become one (E, 2I, ...) tensor,
    stacked along axis 1; the same for their biases (E, I) and quantized arrays.
    """
    parts = gguf_name.split(".")
    return FUSED.get(parts[2]) if len(parts) == 4 else None


def check_fused(path: Path, tensors: dict) -> None:
    """Every fused half has its partner, of the same shape."""
    first = {v: k for k, v in FUSED.items()}
    for name, t in tensors.items():
        if fused_part(name) != 0:
            continue
        parts = name.split(".")
        partner = ".".join([*parts[:2], first[1], parts[3]])
        if partner not in tensors:
            raise WeightsError(f"{path}: tensor {name} has no {partner} to fuse with")
        if tensors[partner].shape != t.shape:
            raise WeightsError(
                f"{path}: tensor {partner} has shape {tensors[partner].shape}, "
                f"expected {t.shape} like {name}"
            )
        if len(t.shape) < 2:  # the halves are stacked along axis 1
            raise WeightsError(
                f"{path}: tensor {name} has shape {t.shape}; expected (experts, rows, ...)"
            )
    for name in tensors:
        if fused_part(name) == 1:
            parts = name.split(".")
            partner = ".".join([*parts[:2], first[0], parts[3]])
            if partner not in tensors:
                raise WeightsError(f"{path}: tensor {name} has no {partner} to fuse with")


def needs_float_fix(arch: str, module: str, kind: str) -> bool:
    """Whether :func:`fix_float` changes this tensor (Gemma's and Qwen3.5's norms, ...)."""
    if arch in qwen35.ARCHS:
        return qwen35.needs_float_fix(module, kind)
    if arch == "lfm2":  # the (C, 1, K) kernel, squeezed to (C, K) by the converter
        return kind == "weight" and module.endswith(".conv.conv")
    gemma = arch in ("gemma2", "gemma3")
    return gemma and kind == "weight" and module.rsplit(".", 1)[-1].endswith("norm")


def fix_float(arch: str, module: str, kind: str, a: np.ndarray, name: str) -> np.ndarray:
    """Per-architecture change to a floating-point tensor (float32 in, float32 out)."""
    if arch in qwen35.ARCHS and needs_float_fix(arch, module, kind):
        return qwen35.fix_float(module, kind, a, name)
    if arch == "lfm2" and needs_float_fix(arch, module, kind):
        if a.ndim != 2:
            raise WeightsError(f"tensor {name} has shape {a.shape}; expected (C, K)")
        return a[:, None, :]
    if needs_float_fix(arch, module, kind):
        return a - np.float32(1.0)  # stored as w + 1
    return a


def reorder(arch: str, module: str, kind: str, config: dict, parts: dict, name: str) -> dict:
    """One tensor's stored arrays with llama.cpp's reordering of rows or columns undone:
    Llama's q/k RoPE pairs (:func:`unpermute_rows`), Qwen3.5's value heads (qwen35.py)."""
    heads = permuted_heads(arch, module, config)
    if heads:
        if parts and next(iter(parts.values())).shape[0] % (2 * heads):
            rows = next(iter(parts.values())).shape[0]
            raise WeightsError(f"{name}: {rows} rows do not split into {heads} heads of even size")
        return {key: unpermute_rows(a, heads) for key, a in parts.items()}
    how = qwen35.value_head_order(config, module, kind) if arch in qwen35.ARCHS else None
    return qwen35.regroup(parts, config, how, name) if how else parts


def split(arch: str, module: str, parts: dict, config: dict, name: str) -> list[tuple[str, dict]]:
    """A tensor stored as several modules (Qwen3-Next's ``ssm_ba``): [(module, parts)]."""
    if arch == "qwen3next":
        return qwen35.split_ba(module, parts, config, name)
    return [(module, parts)]


def permuted_heads(arch: str, module: str, config: dict) -> int | None:
    """How many heads llama.cpp interleaved this tensor's rows by (None: not permuted)."""
    if arch not in ("llama", "smollm3", "mistral3", "granite"):
        return None
    return {
        "self_attn.q_proj": config["num_attention_heads"],
        "self_attn.k_proj": config["num_key_value_heads"],
    }.get(module.split(".", 3)[-1])


def unpermute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) back to HF's rotate-half order.

    llama.cpp's converter did rows.reshape(n_heads, 2, head_dim//2, ...).swapaxes(1, 2);
    rows are output channels and quantization groups run along the input dim, so the
    same row shuffle applies to packed weights, scales and biases alike.
    """
    head_dim = a.shape[0] // n_heads
    rest = a.shape[1:]
    a = a.reshape(n_heads, head_dim // 2, 2, *rest)  # (n_heads, head_dim/2, 2, ...)
    return a.swapaxes(1, 2).reshape(n_heads * head_dim, *rest)  # (n_heads*head_dim, ...)
