"""GGUF (ggml) tensor blocks -> MLX affine quantization, and back to floats.

MLX's affine format stores ``w = scale * q + bias`` with ``bits``-bit codes
``q`` packed little-endian into uint32 words (the first code in the lowest
bits) and one float16 scale and bias per ``group_size`` weights along a row.

**Exact types** hold groups of 32 of exactly that form, so they map onto MLX
group 32 without rounding any weight (``to_affine``)::

    Q4_0  x = d (q - 8)     q in [0, 15]  -> bits 4, scale d, bias -8d
    Q4_1  x = d q + m       q in [0, 15]  -> bits 4, scale d, bias m
    Q5_0  x = d (q - 16)    q in [0, 31]  -> bits 5, scale d, bias -16d
    Q5_1  x = d q + m       q in [0, 31]  -> bits 5, scale d, bias m
    Q8_0  x = d q           q in [-128, 127] -> bits 8, codes q + 128, scale d, bias -128d

(``d`` and ``m`` are float16 in the file; -8d, -16d, -128d are exact in
float16: a power of two only moves the exponent.)

**K-quants** pack 256 weights in super-blocks with 6- or 8-bit sub-block scales
multiplied by a float16 super-scale, which float16 cannot hold exactly:

    Q4_K  8 groups of 32: x = (d sc) q - (dmin m)   q in [0, 15]
    Q5_K  8 groups of 32: same, q in [0, 31]
    Q6_K  16 groups of 16: x = (d sc) (q - 32)      q in [0, 63], sc int8

Q4_K and Q5_K keep their codes as MLX 4- and 5-bit groups of 32; only each
group's scale ``d·sc`` and bias ``-dmin·m`` are rounded to float16 (the loss:
at most ~0.05% of each, see :func:`kquant_to_affine`). Q6_K's groups of 16
have no MLX counterpart (MLX groups are 32, 64 or 128), so it is dequantized
and re-quantized (:func:`requantize`), by default to 8 bits in groups of 32.
**MXFP4** (gpt-oss's experts) is MLX's ``mxfp4`` mode as it stands: blocks of
32 FP4 (E2M1) codes under one E8M0 exponent byte ``e``, ``x = 2**(e - 127) *
fp4(q)`` in both (ggml writes it as ``2**(e - 128)`` times doubled E2M1 values).
Only the nibble order differs: ggml puts weight j in the low nibble of byte j
and weight j + 16 in its high nibble, MLX packs weights in order, two per byte
(:func:`to_mxfp4`). Every exponent 0-254 decodes to the same float32 in both
(tests/gguf/test_gguf.py); 255 (NaN in the OCP spec) never comes out of ggml's quantizer.

**IQ4_NL and IQ4_XS** (llama.cpp's non-linear 4-bit) index a fixed table of 16 signed
levels ``K`` = (-127 ... 113) instead of a uniform grid, which no MLX mode holds at 4
bits. Every level is an integer in [-127, 127], so ``x = s K[q]`` is exactly MLX 8-bit
affine with codes ``K[q] + 128``, scale ``s`` and bias ``-128 s`` (as Q8_0)::

    IQ4_NL  blocks of 32:  s = d                          (exact)
    IQ4_XS  256 in 8 groups of 32: s = d (ls - 32), ls a 6-bit sub-block scale

IQ4_NL is exact; IQ4_XS's ``d (ls - 32)`` can need more bits than float16 has, so its
scales round like Q4_K's and its loss is measured (:func:`codebook_to_affine`). The 8-bit
form is twice the file's bytes; ``requantize`` re-codes both types to a smaller grid.

Every decoder here is checked bit for bit against ``gguf.quants.dequantize``
in tests/gguf/test_gguf_quants.py and tests/gguf/test_gguf.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

GROUP = 32  # MLX group size of every exact mapping
SUPER = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class BlockType:
    name: str
    block: int  # weights per block
    nbytes: int  # bytes per block


# ggml type code -> block layout, for the types we read.
TYPES = {
    0: BlockType("F32", 1, 4),
    1: BlockType("F16", 1, 2),
    30: BlockType("BF16", 1, 2),
    2: BlockType("Q4_0", 32, 18),
    3: BlockType("Q4_1", 32, 20),
    6: BlockType("Q5_0", 32, 22),
    7: BlockType("Q5_1", 32, 24),
    8: BlockType("Q8_0", 32, 34),
    12: BlockType("Q4_K", SUPER, 144),
    13: BlockType("Q5_K", SUPER, 176),
    14: BlockType("Q6_K", SUPER, 210),
    39: BlockType("MXFP4", 32, 17),
    20: BlockType("IQ4_NL", 32, 18),
    23: BlockType("IQ4_XS", SUPER, 136),
}
# ...and the names of the others, for error messages only.
OTHER_TYPE_NAMES = {
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    21: "IQ3_S",
    22: "IQ2_S",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
}
FLOATS = ("F32", "F16", "BF16")
EXACT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}
KQUANT_CODE_BITS = {"Q4_K": 4, "Q5_K": 5}  # K-quants whose codes MLX can keep
DEFAULT_REQUANT = {"Q6_K": (8, 32)}  # (bits, group size) for K-quants that are re-quantized
CODEBOOK = ("IQ4_NL", "IQ4_XS")  # non-linear 4-bit: kept as exact 8-bit codes (see above)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


@dataclass
class Affine:
    """An MLX-quantized matrix: packed (rows, cols*bits/32) uint32, (rows, cols/group) scales
    and biases (float16; mode "mxfp4": uint8 exponents and no biases)."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None
    bits: int
    group_size: int = GROUP
    mode: str = "affine"

    def arrays(self) -> dict[str, np.ndarray]:
        """{"weight", "scales"[, "biases"]}: the layer's stored arrays."""
        out = {"weight": self.weight, "scales": self.scales}
        return out if self.biases is None else {**out, "biases": self.biases}


# ---------------------------------------------------------------------------
# small helpers


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as (n_blocks,) float16."""
    return blocks[:, start : start + 2].copy().view("<f2")[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: weight j in the low nibble of byte j, weight j+16 in the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """(blocks, 4) bytes of a little-endian uint32 -> (blocks, 32) bits: bit i belongs to weight i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :n]


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) codes < 2**bits -> (rows, cols*bits/32) uint32 in MLX's order.

    MLX reads the codes of a row as one little-endian bit stream: code i sits at
    bits [i*bits, (i+1)*bits). ``cols * bits`` must be a multiple of 32.
    """
    rows, cols = codes.shape
    codes = codes.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes).view("<u4")
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view("<u4")
    out = np.empty((rows, cols * bits // 32), np.uint32)
    step = max(1, (1 << 22) // cols)  # rows per chunk: bounds the 8x bit-array expansion
    for r in range(0, rows, step):
        bit_array = np.unpackbits(codes[r : r + step, :, None], axis=-1, bitorder="little")[
            ..., :bits
        ]
        packed = np.packbits(bit_array.reshape(bit_array.shape[0], -1), axis=-1, bitorder="little")
        out[r : r + step] = packed.view("<u4")
    return out


# ---------------------------------------------------------------------------
# exact block types: codes, scale, bias per group of 32


def _exact_groups(blocks: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, block bytes) -> codes (n, 32) uint8, scale (n,) f16, bias (n,) f16 with x = scale*q + bias."""
    d = _f16(blocks, 0)
    if name == "Q8_0":
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, d * np.float16(-128)
    if name == "Q4_0":
        return _nibbles(blocks[:, 2:]), d, d * np.float16(-8)
    if name == "Q4_1":
        return _nibbles(blocks[:, 4:]), d, _f16(blocks, 2)
    if name == "Q5_0":
        q = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6], 32) << 4)
        return q, d, d * np.float16(-16)
    if name == "Q5_1":
        q = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8], 32) << 4)
        return q, d, _f16(blocks, 2)
    raise AssertionError(name)


def to_affine(raw: np.ndarray, name: str, rows: int, cols: int) -> Affine:
    """An exact type's raw blocks for a (rows, cols) matrix -> the same values as MLX affine, group 32."""
    blocks = raw.reshape(-1, TYPES_BY_NAME[name].nbytes)  # (rows * cols/32, block bytes)
    q, scale, bias = _exact_groups(blocks, name)
    bits = EXACT_BITS[name]
    return Affine(
        pack(q.reshape(rows, cols), bits), scale.reshape(rows, -1), bias.reshape(rows, -1), bits
    )


# ---------------------------------------------------------------------------
# MXFP4

_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _mxfp4_codes(blocks: np.ndarray) -> np.ndarray:
    """(n, 17) MXFP4 blocks -> (n, 32) FP4 codes in weight order."""
    return _nibbles(blocks[:, 1:])


def to_mxfp4(raw: np.ndarray, rows: int, cols: int) -> Affine:
    """MXFP4 blocks of a (rows, cols) matrix -> MLX mode "mxfp4", group 32: the same codes
    and exponents, so the same values bit for bit."""
    blocks = raw.reshape(-1, TYPES_BY_NAME["MXFP4"].nbytes)  # (rows * cols/32, 17)
    scales = np.ascontiguousarray(blocks[:, 0]).reshape(rows, cols // GROUP)  # E8M0 exponents
    return Affine(pack(_mxfp4_codes(blocks).reshape(rows, cols), 4), scales, None, 4, mode="mxfp4")


def _mxfp4_values(blocks: np.ndarray) -> np.ndarray:
    """(n, 17) MXFP4 blocks -> (n, 32) float32, as ggml computes them: 2**(e-128) * doubled E2M1."""
    e = blocks[:, :1].astype(np.uint32)
    # ggml_e8m0_to_fp32_half: e < 2 is a float32 subnormal
    half = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).view(np.float32)
    return half * _E2M1_DOUBLED[_mxfp4_codes(blocks)]


# ---------------------------------------------------------------------------
# K-quants


def _kquant_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales and mins
    4-7 take their low 4 bits from bytes 8-11 (scale: low nibble, min: high) and
    their top 2 bits from the spare top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales, mins  # (n, 8) each


def _kquant_groups(blocks: np.ndarray, name: str):
    """Q4_K/Q5_K super-blocks -> codes (n, 8, 32), scale (n, 8) f32, min-offset (n, 8) f32:
    x = scale * q - offset, computed in float32 exactly as ggml does."""
    d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
    sc, m = _kquant_scales(blocks[:, 4:16])
    qs = blocks[:, -128:].reshape(
        -1, 4, 32
    )  # 4 chunks of 32 bytes, each 2 groups (low, high nibbles)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    if name == "Q5_K":
        qh = blocks[:, 16:48]  # bit g of byte i: high bit of weight i in group g
        high = np.unpackbits(qh[:, None, :], axis=1, count=8, bitorder="little")  # (n, 8, 32)
        q = q | (high << 4)
    scale = d[:, None] * sc.astype(np.float32)
    offset = dmin[:, None] * m.astype(np.float32)
    return q, scale, offset


def _q6k_values(blocks: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks -> (n, 256) float32.

    Bytes 0-127: low 4 bits (two halves of 128 weights, 64 bytes each: low nibbles
    are weights 0-63 of the half, high nibbles 64-127); bytes 128-191: high 2 bits
    (two halves, 32 bytes each, 4 weights per byte at shifts 0, 2, 4, 6 for the
    four quarters); bytes 192-207: 16 int8 scales; bytes 208-209: float16 d.
    """
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 64)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2)  # (n, half, nibble, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 32)
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # (n, half, quarter, 32)
    q = low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)
    q = q.astype(np.int8) - np.int8(32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208).astype(np.float32)
    scale = (d[:, None] * sc).reshape(n, 16, 1)
    return (scale * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, SUPER)


def kquant_to_affine(raw: np.ndarray, name: str, rows: int, cols: int) -> Affine:
    """Q4_K/Q5_K -> MLX 4/5-bit group 32 with the file's own codes; scales and biases rounded to float16."""
    blocks = raw.reshape(-1, TYPES_BY_NAME[name].nbytes)
    q, scale, offset = _kquant_groups(blocks, name)
    bits = KQUANT_CODE_BITS[name]
    return Affine(
        pack(q.reshape(rows, cols), bits),
        scale.astype(np.float16).reshape(rows, -1),
        (-offset).astype(np.float16).reshape(rows, -1),
        bits,
    )


# ---------------------------------------------------------------------------
# IQ4_NL / IQ4_XS


def _iq4_groups(blocks: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """IQ4 blocks -> level indices (n_groups, 32) and each group's scale (n_groups,) float32,
    x = scale * IQ4_LEVELS[index], computed in float32 as ggml does.

    Both types store a group's 32 indices in 16 bytes as Q4_0 does (weight j in the low
    nibble of byte j, weight j + 16 in its high nibble). IQ4_NL: float16 ``d``, 16 bytes.
    IQ4_XS: float16 ``d``, uint16 ``scales_h`` (2 high bits of each group's ``ls``), 4 bytes
    ``scales_l`` (the low 4 bits, two groups a byte, low nibble first), 128 bytes of indices.
    """
    d = _f16(blocks, 0).astype(np.float32)
    if name == "IQ4_NL":
        return _nibbles(blocks[:, 2:]), d
    n = blocks.shape[0]
    high = blocks[:, 2:4].copy().view("<u2")  # (n, 1)
    low = blocks[:, 4:8]
    ls = np.stack([low & 15, low >> 4], axis=-1).reshape(n, 8).astype(np.int32)
    ls |= ((high.astype(np.int32) >> (2 * np.arange(8))) & 3) << 4
    scale = d[:, None] * (ls - 32).astype(np.float32)  # (n, 8)
    q = _nibbles(blocks[:, 8:].reshape(n * 8, 16))
    return q, scale.reshape(-1)


def codebook_to_affine(raw: np.ndarray, name: str, rows: int, cols: int) -> Affine:
    """IQ4_NL/IQ4_XS -> MLX 8-bit group 32: codes ``level + 128``, scale, bias ``-128 scale``
    (float16; exact for IQ4_NL, IQ4_XS's scales rounded)."""
    blocks = raw.reshape(-1, TYPES_BY_NAME[name].nbytes)
    q, scale = _iq4_groups(blocks, name)
    codes = (IQ4_LEVELS[q] + 128).astype(np.uint8)
    scale16 = scale.astype(np.float16)
    return Affine(
        pack(codes.reshape(rows, cols), 8),
        scale16.reshape(rows, -1),
        (scale16 * np.float16(-128)).reshape(rows, -1),
        8,
    )


# ---------------------------------------------------------------------------
# any type -> float32, and float32 -> MLX affine


def dequantize(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes -> float32 array of ``shape``, bit-identical to ``gguf.quants.dequantize``."""
    if name == "F32":
        return raw.view("<f4").reshape(shape)
    if name == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    blocks = raw.reshape(-1, TYPES_BY_NAME[name].nbytes)
    if name in EXACT:
        q, scale, bias = _exact_groups(blocks, name)
        if name in ("Q4_1", "Q5_1"):  # x = d*q + m
            x = (
                scale.astype(np.float32)[:, None] * q.astype(np.float32)
                + bias.astype(np.float32)[:, None]
            )
        else:  # x = d * (signed q), as ggml writes it
            offset = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}[name]
            x = scale.astype(np.float32)[:, None] * (q.astype(np.float32) - offset)
        return x.reshape(shape)
    if name in ("Q4_K", "Q5_K"):
        q, scale, offset = _kquant_groups(blocks, name)
        return (scale[..., None] * q.astype(np.float32) - offset[..., None]).reshape(shape)
    if name == "Q6_K":
        return _q6k_values(blocks).reshape(shape)
    if name == "MXFP4":
        return _mxfp4_values(blocks).reshape(shape)
    if name in CODEBOOK:
        q, scale = _iq4_groups(blocks, name)
        return (scale[:, None] * IQ4_LEVELS[q].astype(np.float32)).reshape(shape)
    raise AssertionError(name)


def requantize(w: np.ndarray, bits: int, group_size: int) -> Affine:
    """Float weights -> MLX affine (float16 scales), rounding each weight to the new grid."""
    packed, scales, biases = mx.quantize(
        mx.array(w, dtype=mx.float16), group_size=group_size, bits=bits
    )
    return Affine(np.array(packed), np.array(scales), np.array(biases), bits, group_size)


def affine_values(a: Affine) -> np.ndarray:
    """What MLX computes from an :class:`Affine`, in float32 (scales and biases widened first)."""
    w = mx.dequantize(
        mx.array(a.weight),
        mx.array(a.scales.astype(np.float32)),
        mx.array(a.biases.astype(np.float32)),
        group_size=a.group_size,
        bits=a.bits,
    )
    return np.array(w)


def loss(reference: np.ndarray, stored: np.ndarray) -> dict[str, float]:
    """How far the stored weights are from the file's: max |error|, and RMS error relative to RMS weight."""
    err = stored.astype(np.float64) - reference.astype(np.float64)
    rms = float(np.sqrt(np.mean(reference.astype(np.float64) ** 2))) or 1.0
    return {"max_abs": float(np.abs(err).max()), "rel_rmse": float(np.sqrt(np.mean(err**2)) / rms)}


TYPES_BY_NAME = {t.name: t for t in TYPES.values()}
