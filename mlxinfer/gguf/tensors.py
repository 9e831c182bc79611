"""One GGUF tensor into the arrays an mlxinfer checkpoint stores, for the import (importer.py).

Quantized tensors stay quantized. The exact types become MLX affine groups of
32 with no weight rounded twice; MXFP4 (gpt-oss's experts) becomes MLX's
``mxfp4`` mode with the file's own codes and exponents, bit for bit. K-quants,
by default: Q4_K and Q5_K keep their codes (4- and 5-bit groups of 32; only the
per-group scale and bias round to float16), Q6_K is re-quantized to 8-bit groups
of 32 (its groups of 16 have no MLX form; 8 bits keep the re-rounding error a
small fraction of Q6_K's own); IQ4_NL and IQ4_XS become 8-bit groups of 32 holding their
levels (quants.py). ``requantize=(bits, group_size)`` re-quantizes every K-quant and IQ4
tensor to that format instead. Either way each K-quant tensor's
loss is measured: how far the stored weights are from the file's (max |error|
and relative RMS error).

Then the architecture's fixes (arch.py): llama's q/k rows back in HF's order, Gemma's
norms less 1. Stacked experts (``ffn_*_exps``, (E, out, in)) are quantized per row like any
matrix; gate and up are fused into one ``experts.gate_up_proj`` (:func:`fuse_halves`).
"""

from __future__ import annotations

import numpy as np

from . import quants as gq
from .arch import fix_float, needs_float_fix, reorder
from .container import GGUFTensor, tensor_bytes

_ROWS_PER_CHUNK_ELEMS = 1 << 22  # K-quant decoding works on ~4M weights at a time


def _convert_kquant(raw: np.ndarray, t: GGUFTensor, requantize: tuple[int, int] | None):
    """A K-quant or IQ4 matrix -> (Affine, loss), decoded a chunk of rows at a time."""
    rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]
    block = gq.TYPES_BY_NAME[t.type_name]
    raw = raw.reshape(rows, cols // block.block * block.nbytes)
    codebook = t.type_name in gq.CODEBOOK
    keep_codes = requantize is None and (t.type_name in gq.KQUANT_CODE_BITS or codebook)
    bits, group = requantize or gq.DEFAULT_REQUANT.get(t.type_name, (None, None))
    keep = gq.codebook_to_affine if codebook else gq.kquant_to_affine
    parts, max_abs, sq_err, sq_ref = [], 0.0, 0.0, 0.0
    step = max(1, _ROWS_PER_CHUNK_ELEMS // cols)
    for r in range(0, rows, step):
        chunk = raw[r : r + step]
        n = chunk.shape[0]
        ref = gq.dequantize(chunk, t.type_name, (n, cols))
        a = keep(chunk, t.type_name, n, cols) if keep_codes else gq.requantize(ref, bits, group)
        err = gq.affine_values(a) - ref
        max_abs = max(max_abs, float(np.abs(err).max()))
        sq_err += float(np.sum(err.astype(np.float64) ** 2))
        sq_ref += float(np.sum(ref.astype(np.float64) ** 2))
        parts.append(a)
    a = gq.Affine(
        *(np.concatenate([getattr(p, f) for p in parts]) for f in ("weight", "scales", "biases")),
        parts[0].bits,
        parts[0].group_size,
    )
    loss = {
        "type": t.type_name,
        "bits": a.bits,
        "group_size": a.group_size,
        "codes_kept": keep_codes,
        "max_abs": max_abs,
        "rel_rmse": (sq_err / (sq_ref or 1.0)) ** 0.5,
    }
    return a, loss


def convert_tensor(buf, t: GGUFTensor, requantize):
    """-> (float32/float16/bfloat16 numpy array, None, None) or (None, Affine, loss or None)."""
    raw = tensor_bytes(buf, t)
    if t.type_name == "F16":
        return raw.view("<f2").reshape(t.shape), None, None
    if t.type_name == "BF16":
        return raw.view("<u2").reshape(t.shape), None, None  # viewed as bfloat16 when written
    if t.type_name == "F32":
        return raw.view("<f4").reshape(t.shape), None, None
    if len(t.shape) == 1:  # a quantized vector (never seen in practice): plain floats
        return gq.dequantize(raw, t.type_name, t.shape), None, None
    rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]  # stacked experts: (E * out, in)
    if t.type_name in gq.EXACT:
        a, loss = gq.to_affine(raw, t.type_name, rows, cols), None
    elif t.type_name == "MXFP4":
        a, loss = gq.to_mxfp4(raw, rows, cols), None
    else:
        a, loss = _convert_kquant(raw, t, requantize)
    if len(t.shape) > 2:  # back to (E, out, ...)
        lead = t.shape[:-1]
        a = gq.Affine(
            a.weight.reshape(*lead, -1),
            a.scales.reshape(*lead, -1),
            None if a.biases is None else a.biases.reshape(*lead, -1),
            a.bits,
            a.group_size,
            a.mode,
        )
    return None, a, loss


def stored_parts(buf, t: GGUFTensor, module: str, kind: str, arch: str, config: dict, requantize):
    """One tensor as the arrays we store: ({key: array}, (bits, group, mode) or None, loss or None)."""
    dense, affine, loss = convert_tensor(buf, t, requantize)
    if affine is not None and not needs_float_fix(arch, module, kind):
        parts = {f"{module}.{kind if k == 'weight' else k}": a for k, a in affine.arrays().items()}
        fmt = (affine.bits, affine.group_size, affine.mode)
    else:
        if needs_float_fix(arch, module, kind):  # in float32, whatever the stored type
            dense = fix_float(
                arch,
                module,
                kind,
                gq.dequantize(tensor_bytes(buf, t), t.type_name, t.shape),
                t.name,
            )
        parts, fmt = {f"{module}.{kind}": dense}, None
    return reorder(arch, module, kind, config, parts, t.name), fmt, loss


def fuse_halves(buf, pending: dict, module: str, kind: str, losses: dict):
    """Two halves (see arch.fused_part) -> one tensor, stacked along axis 1: (E, 2I, ...).

    Halves of one format are stacked as stored (codes, scales and biases alike). Halves
    of different types (a file may mix them) have no common MLX form, so both are stored
    as float32, exactly the file's values.
    """
    (t0, p0, f0, k0), (t1, p1, f1, k1) = pending[0], pending[1]
    if f0 == f1 and all(p0[key].dtype == p1[key].dtype for key in p0):
        return {key: np.concatenate([p0[key], p1[key]], axis=1) for key in p0}, f0
    for key in (k0, k1):  # no longer stored as those K-quant groups
        losses.pop(key, None)
    halves = [gq.dequantize(tensor_bytes(buf, t), t.type_name, t.shape) for t in (t0, t1)]
    return {f"{module}.{kind}": np.concatenate(halves, axis=1)}, None
