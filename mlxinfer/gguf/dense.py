"""GGUF import to a float dtype: every tensor dequantized, optionally re-quantized.

``mlxinfer convert model.gguf -o out --dtype float32`` asks for the file's
weights as plain floats: each tensor, whatever its type, is dequantized to
float32 exactly as ``gguf.quants.dequantize`` does, then stored in the dtype
asked for. With ``-q`` the float weights are then quantized as a Hugging Face
checkpoint would be (``quant.quantize_model``'s layers and record, ``bits`` and
``group_size``). The report gives, per tensor stored differently from the
file, how far the stored weights are from the file's (max |error| and relative
RMS error): zero for float32, float rounding for float16/bfloat16, the new grid
for ``-q``. One tensor is in float32 at a time.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..models import build_model
from ..platform.progress import Progress, counted
from ..quant.transform import quantize_model
from . import quants as gq
from .arch import fix_float, fused_part, reorder, split
from .container import tensor_bytes

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def quantized_modules(config: dict, bits: int, group_size: int) -> tuple[dict, set[str]]:
    """The ``quantization`` record and module paths that ``quantize_model`` gives this
    architecture (found on a model whose weights are never computed)."""
    model = build_model(config, "config.json")
    record = quantize_model(model, bits=bits, group_size=group_size)
    return record, {path for path, m in model.named_modules() if "scales" in m}


def write_float(
    buf,
    tensors: dict,
    names: dict,
    arch: str,
    config: dict,
    *,
    dtype: str,
    quantize: tuple[int, int] | None,
    progress: Progress,
) -> tuple[dict, dict]:
    """The weights in ``dtype`` (``quantize``: affine ``(bits, group_size)`` where
    ``quantize_model`` would quantize), and the per-tensor loss; ``config`` gets the
    dtype and quantization record."""
    target = DTYPES[dtype]
    record, to_quantize = quantized_modules(config, *quantize) if quantize else (None, set())
    weights, losses, halves = {}, {}, {}
    for name, t in counted(tensors.items(), "importing tensors", progress):
        module, kind = names[name]
        ref = fix_float(
            arch, module, kind, gq.dequantize(tensor_bytes(buf, t), t.type_name, t.shape), t.name
        )
        ref = reorder(arch, module, kind, config, {"": ref}, t.name)[""]
        type_name = t.type_name
        part = fused_part(name)
        if part is not None:  # gate and up experts: one (E, 2I, ...) tensor, [gate; up]
            pending = halves.setdefault((module, kind), {})
            pending[part] = (ref, t.type_name)
            if len(pending) < 2:
                continue
            pending = halves.pop((module, kind))
            (ref, type0), (ref1, type1) = pending[0], pending[1]
            ref = np.concatenate([ref, ref1], axis=1)
            type_name = type0 if type0 == type1 else f"{type0}+{type1}"
        for stored_as, piece in split(arch, module, {"": ref}, config, name):
            ref = piece[""]
            w = mx.array(np.ascontiguousarray(ref)).astype(target)
            if kind == "weight" and stored_as in to_quantize:
                bits, group_size = quantize
                q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
                stored = mx.dequantize(q, scales, biases, group_size=group_size, bits=bits)
                new = {
                    f"{stored_as}.weight": q,
                    f"{stored_as}.scales": scales,
                    f"{stored_as}.biases": biases,
                }
                entry = {"bits": bits, "group_size": group_size}
            else:
                stored, entry = w, {}
                new = {f"{stored_as}.{kind}": w}
            mx.eval(list(new.values()))
            weights.update(new)
            if type_name != "F32" or target != mx.float32 or entry:
                loss = gq.loss(ref, np.array(stored.astype(mx.float32)))
                losses[f"{stored_as}.{kind}"] = {"type": type_name, "dtype": dtype, **entry, **loss}
    config["torch_dtype"] = dtype
    if record is not None:
        config["quantization"] = record
    return weights, losses
