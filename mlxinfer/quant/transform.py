"""Weight quantization: a transform on the model plus a record in config.json.

``quantize_model`` turns Linear/Embedding layers into their affine-quantized
forms (``bits``-bit integers, one scale and bias per ``group_size`` inputs) and
returns the record to store under ``config["quantization"]``. Loading reads
that record back through ``apply_quantization`` before the weights go in.

A checkpoint quantized elsewhere is read as it is stored where MLX has the same
format: gpt-oss's MXFP4 experts (``quantization_config.quant_method: mxfp4``)
are MLX's ``mxfp4`` mode as they are. Which record counts and what each entry means
(mlx-lm's per-layer records, MLX's float modes) is ``record.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .gptq import gptq_quantize, inverse_hessian_factor
from .record import MXFP4 as MXFP4  # re-exported: the record is read in record.py
from .record import layer_settings
from .record import quantization_record as quantization_record
from .rounding import ROUNDINGS, channel_weights, fit_affine

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


def quantized_layers(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{path: {group_size, bits, mode}}`` of the layers ``model`` already holds quantized."""
    return {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
        for path, m in model.named_modules()
        if "scales" in m and hasattr(m, "bits")
    }


def _quantizable(module: nn.Module, group_size: int) -> bool:
    return hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0


def quantize_model(
    model: nn.Module,
    *,
    bits: int = 4,
    group_size: int = 64,
    rounding: str = "minmax",
    layers: dict[str, tuple[int, int]] | None = None,
    importance: Callable[[str], np.ndarray | None] | None = None,
    covariance: Callable[[str], np.ndarray | None] | None = None,
    scale_dtype: mx.Dtype | None = None,
    done: Callable[[str, nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Quantize ``model`` in place; returns the config.json record.

    ``rounding="minmax"`` takes each group's scale and bias from its min and max (MLX's
    ``mx.quantize``); ``"mse"`` fits them to the least squared error (``rounding.fit_affine``),
    in the same format, each input channel weighted by ``importance(path)`` (mean ``x**2`` of
    calibration tokens) when given; ``"gptq"`` rounds the columns in order, each one's error
    compensated in the later ones through ``covariance(path)`` (the layer's mean ``x x^T``,
    ``gptq.py``), each group's scale and bias fitted as for ``mse``. A layer without a
    covariance (an embedding read only by lookup, stacked experts, per-head matrices) gets
    ``mse``.

    ``done(path, layer)``: called with each layer rounded here (every layer unless rounding is
    ``minmax`` with no ``scale_dtype``) once its arrays are evaluated, to write it out, say.

    ``layers``: ``{path: (bits, group_size)}`` for a mixed plan (``plan.py``); only those layers
    are quantized, each listed in the record. Without it every quantizable layer gets
    ``bits``/``group_size``. ``scale_dtype``: the dtype of scales and biases (default: the
    weights').

    Layers whose input width is not a multiple of ``group_size`` stay in float
    and are listed in the record as ``{path: False}``; layers quantized already (an MXFP4
    checkpoint's experts) keep their format, listed as ``{path: {group_size, bits, mode}}``.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"--bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"--group-size must be 32, 64 or 128, got {group_size}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"--rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if layers:  # the record's defaults: the plan's most common setting
        bits, group_size = Counter(layers.values()).most_common(1)[0][0]
    record: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    record.update(quantized_layers(model))
    skipped = []
    floats: dict[str, tuple[mx.array, int, int]] = {}  # path -> float weight, bits, group

    # A family may keep some layers in float (routers, tiny projections) by
    # defining `quant_predicate(path, module) -> bool` on its Model.
    family_rule = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        b, g = layers[path] if layers and path in layers else (bits, group_size)
        if (layers is not None and path not in layers) or (
            not _quantizable(module, g)
            or (family_rule is not None and not family_rule(path, module))
        ):
            skipped.append(path)
            return False
        if rounding != "minmax" or scale_dtype is not None:
            floats[path] = (module.weight, b, g)
        return {"group_size": g, "bits": b, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)
    modules = dict(model.named_modules()) if floats else {}
    hessians = {
        p: h
        for p, (w, _, _) in floats.items()
        if rounding == "gptq" and covariance is not None and w.ndim == 2
        if (h := covariance(p)) is not None
    }
    # Layers reading one input share one H (q/k/v, gate/up): its factor is computed once and
    # kept until the last of them is quantized.
    uses = Counter(id(h) for h in hessians.values())
    factors: dict[int, np.ndarray] = {}
    for path in list(floats):
        # Popped: a float weight (a lazy load, read when first evaluated) is dropped once its
        # layer is quantized, so the float model is never held beside the quantized one.
        weight, b, g = floats.pop(path)
        layer = modules[path]
        h = hessians.get(path)
        if h is not None:
            imp = importance(path) if importance is not None else None
            if id(h) not in factors:
                factors[id(h)] = inverse_hessian_factor(h)
            factor = factors[id(h)]
            uses[id(h)] -= 1
            if not uses[id(h)]:
                del factors[id(h)]
            layer.weight, layer.scales, layer.biases = gptq_quantize(
                weight,
                h,
                factor=factor,
                group_size=g,
                bits=b,
                weights=channel_weights(imp, weight.shape),
                scale_dtype=scale_dtype,
            )
        elif rounding != "minmax":
            imp = importance(path) if importance is not None else None
            layer.weight, layer.scales, layer.biases = fit_affine(
                weight,
                group_size=g,
                bits=b,
                weights=channel_weights(imp, weight.shape),
                scale_dtype=scale_dtype,
            )
        else:
            layer.scales = layer.scales.astype(scale_dtype)
            layer.biases = layer.biases.astype(scale_dtype)
        mx.eval(layer.weight, layer.scales, layer.biases)
        if done is not None:
            done(path, layer)
    record.update({path: False for path in skipped})
    if layers:
        record.update(
            {p: {"group_size": g, "bits": b, "mode": "affine"} for p, (b, g) in layers.items()}
        )
    return record


def apply_quantization(
    model: nn.Module, record: dict[str, Any], weights: dict[str, mx.array]
) -> None:
    """Re-create the quantized layers that ``weights`` hold (those with ``.scales``).

    A per-layer entry ``{path: {"bits": b, "group_size": g, "mode": m}}`` overrides the
    defaults for that layer (mlx-lm's mixed recipes, GGUF imports, MXFP4 experts beside affine
    layers); ``{path: false}`` keeps it in float. Null settings are the mode's defaults
    (``record.layer_settings``).
    """
    default = layer_settings(record)

    def predicate(path: str, module: nn.Module):
        entry = record.get(path)
        if entry is False or f"{path}.scales" not in weights:
            return False
        if isinstance(entry, dict):
            return layer_settings(record, entry)
        return _from_shapes(module, weights, path, default)

    nn.quantize(model, class_predicate=predicate)


def _from_shapes(
    module: nn.Module, weights: dict[str, mx.array], path: str, default: dict[str, Any]
) -> dict[str, Any]:
    """A layer the record does not list: the record's defaults, unless the stored shapes say
    otherwise (a record that lost a mixed recipe's entries, say). The float layer knows its
    input width K; the packed weight has ``K * bits / 32`` columns and the scales ``K / group``,
    so both follow from the shapes (affine only: the float modes fix their group and bits)."""
    weight = getattr(module, "weight", None)
    packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
    if default["mode"] != "affine" or weight is None or packed is None or packed.ndim < 1:
        return dict(default)
    k = weight.shape[-1]
    bits, rem = divmod(packed.shape[-1] * 32, k)
    if rem or not scales.shape[-1] or k % scales.shape[-1]:
        return dict(default)
    group = k // scales.shape[-1]
    if bits in SUPPORTED_BITS and group in (32, 64, 128) and f"{path}.biases" in weights:
        return {"group_size": group, "bits": bits, "mode": "affine"}
    return dict(default)


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits per original weight element (packed ints + scales + biases)."""
    total_bits, n_weights = 0, 0
    for module in model.modules():
        # Any quantized layer (Linear, Embedding, stacked experts...) holds packed weight + scales.
        if "scales" in module and hasattr(module, "bits"):
            n_weights += module.weight.size * 32 // module.bits
            total_bits += sum(a.nbytes * 8 for _, a in tree_flatten(module.parameters()))
        elif hasattr(module, "to_quantized") and "weight" in module:
            n_weights += module.weight.size
            total_bits += module.weight.nbytes * 8
    return total_bits / max(n_weights, 1)
