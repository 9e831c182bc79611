"""Tiled layers: a 4-, 5-, 6- or 8-bit affine layer's codes laid out once for AVX-512 VNNI's int16
products (csrc/src/tiles.cpp), so decode's few rows run as 32-output tiles with no per-product
layout and no float dequantizing: the ``int16_decode`` plan's ``int16`` option. A CPU with AVX2
but not AVX-512 VNNI (Intel's client cores, AMD's before Zen 4) runs the same tiles in 256-bit
vectors (``vpmaddwd``, or AVX-VNNI's ``vpdpwssd`` where the CPU has it), two rows a pass, the
outputs bit for bit the same; there they also take a prompt's rows up to ``AVX2_ROWS`` (the
dequantized weight and BLAS beyond: ``quantized.CPUQuantizedLinear``).

A layer's tiles are made the first time a product asks for them while the plan is on, kept on
the layer (or on its fused group) beside MLX's arrays, which every other path still reads, and
dropped when the plan is set off. They take the codes' bytes again (a 4-bit layer's 0.5 bytes a
weight) and the scales and biases (float16 where every value is one, else float32; no biases
where each is -2^(bits - 1) times its scale, GGUF's Q4_0, Q5_0 and Q8_0): SmolLM2-135M 96 MB,
Gemma-3-270M 252 MB (its 262,144-row head's 178 MB among them). A fused group's siblings are
tiled once, as the group (blocks.py).

A second copy must not push the machine into paging: a layer is tiled only while what the
machine can still give (``platform.memory.available``: MemAvailable, a cgroup's room) stays above
``RESERVE`` after its tiles; past that its products keep the float kernel (correct, slower),
and ``skipped_bytes`` counts what was not tiled.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...platform import memory
from .. import kernels

BITS = (4, 5, 6, 8)
TILE = 32  # outputs a tile
_on = False
_keep = 0  # inside kept(): set_on(False) keeps the tiles
_owners: list[weakref.ref] = []  # what keeps tiles, to drop them when the plan is set off
# Without AVX-512 VNNI, up to how many rows each width's tiles (two rows a pass; 5- and 6-bit
# codes widened once a tile from 4 rows) beat the caller's path: the float kernel below
# ``CPUQuantizedLinear.MIN_ROWS``, the dequantized weight and BLAS from there (docs/performance.md,
# the Xeon VM capped at AVX2: 1.1-2.7x the float kernel at 1-31 rows, 6-bit 0.97-1.14x at one;
# 1.0-2.1x the BLAS at 128 rows, 0.75-0.87x at 512, 8-bit's up to 1.15x). With AVX-VNNI's
# ``vpdpwssd`` 1.04-1.54x the BLAS at 512 rows, a prefill chunk's most (4-bit's 1.03-1.07x a tie).
AVX2_ROWS = {4: 128, 5: 256, 6: 128, 8: 256}
AVX_VNNI_ROWS = {4: 256, 5: 512, 6: 512, 8: 512}
DECODE_ROWS = 8  # every path's tiles take this many rows (each table's least is 128)
# Left free after a layer's tiles: a request's KV cache, a prefill chunk's activations, logits.
RESERVE = 1 << 30
skipped_bytes = 0  # layers' tiles not made for want of memory (their float kernel runs)


def available() -> bool:
    """Whether the kernels run tiled layers here: AVX-512 F and BW, or else AVX2 (256-bit
    ``vpmaddwd`` or AVX-VNNI's ``vpdpwssd``, the same outputs bit for bit; tiles.cpp)."""
    k = kernels.load()
    return k is not None and hasattr(k, "tiles_available") and k.tiles_available()


def wide() -> bool:
    """Whether the tiles run their 512-bit path here (AVX-512 F and BW: Skylake-SP and later;
    VNNI's ``vpdpwssd`` where the CPU has it), else the AVX2 one."""
    k = kernels.load()
    return k is not None and getattr(k, "tiles_wide_available", k.vnni_available)()


def takes(rows: int, bits: int) -> bool:
    """Whether a product of ``rows`` rows of a ``bits``-bit layer runs on its tiles here while
    the plan is on: any rows on the 512-bit path (its callers choose: decode's, and a prompt's
    under the ``int16_rows`` plan or, without VBMI, all), else up to ``AVX2_ROWS``
    (``AVX_VNNI_ROWS``) rows."""
    if not _on:
        return False
    if rows <= DECODE_ROWS or wide():  # a decode's rows: asked once a product, no lookups
        return True
    k = kernels.load()
    avx_vnni = getattr(k, "avx_vnni_available", None)
    limits = AVX_VNNI_ROWS if avx_vnni is not None and avx_vnni() else AVX2_ROWS
    return rows <= limits.get(bits, 0)


def takes_prompt(rows: int, bits: int) -> bool:
    """Whether a prompt's ``rows`` (from ``CPUQuantizedLinear.MIN_ROWS``) take the tiles rather
    than the dequantized weight and BLAS: on AVX2 within :func:`takes`' rows, on AVX-512
    without VBMI (Cascade Lake; Skylake-SP, without VNNI too) all; with VBMI the ``int16_rows``
    plan decides
    (``compiled.int16_product``)."""
    return _on and not kernels.load().vnni_available() and takes(rows, bits)


def set_on(on: bool) -> None:
    """Whether products take tiled layers (process-wide, like the ``int16_decode`` plan); off
    drops the tiles made, unless inside :func:`kept`."""
    global _on
    _on = on and available()
    if not _on and not _keep:
        _drop()


@contextmanager
def kept() -> Iterator[None]:
    """The tiles kept while the plan is switched on and off (its timing: each layout made once,
    not every round); dropped at the end if the plan is then off."""
    global _keep
    _keep += 1
    try:
        yield
    finally:
        _keep -= 1
        if not _on and not _keep:
            _drop()


def _drop() -> None:
    global skipped_bytes
    skipped_bytes = 0
    for ref in _owners:
        owner = ref()
        if owner is not None:
            owner.__dict__.pop("_cpu_tiles", None)
    _owners.clear()


def on() -> bool:
    return _on


def fits(w: mx.array, bits: int, group_size: int, mode: str = "affine") -> bool:
    return (
        mode == "affine"
        and bits in BITS
        and group_size in (32, 64, 128)
        and w.dtype == mx.uint32
        and w.ndim == 2
        and w.shape[0] % TILE == 0
        and w.shape[1] * 32 // bits % group_size == 0
    )


def model_fits(model: Any) -> bool:
    """Whether some quantized layer of ``model`` (a Linear, or a tied head's embedding) can be
    tiled."""
    return any(
        "scales" in m and fits(m["weight"], m.bits, m.group_size, getattr(m, "mode", "affine"))
        for m in model.modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    )


def layout(
    w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int
) -> tuple[mx.array, mx.array, mx.array]:
    """MLX's affine arrays (codes (N, K * bits / 32) uint32, scales and biases (N, G)) laid out
    as tiles.cpp reads them (``K.tile_layer``): codes uint8 (N, K * bits / 8) in
    [tile][block][pair] order (4-bit: byte 2 j + e of a pair holds output j's code of input
    2 p + e in its low nibble and output 16 + j's in its high one; 5- and 6-bit: those bytes of
    the low 4 bits, then each higher bit as two 32-bit masks; 8-bit: byte 32 v + 2 j + e
    output 16 v + j's), scales and biases [tile][group][32 outputs], float16 where every value
    is one (exact), else float32. Only where :func:`available`."""
    k = kernels.load()
    if k is None:
        raise RuntimeError(f"tiled layers need the compiled kernels: {kernels.reason()}")
    # float16 where every scale and bias is one (the CPU backend widens a checkpoint's float16
    # to float32 at load): an eighth of a byte a weight read instead of a quarter
    half = all(_half(a) for a in (scales, biases))
    return k.tile_layer(w, scales, biases, group_size, bits, half)


def _half(a: mx.array) -> bool:
    """Whether ``a``'s values are float16's, exactly."""
    return a.dtype == mx.float16 or (
        a.dtype == mx.float32 and mx.array_equal(a.astype(mx.float16).astype(mx.float32), a).item()
    )


def of(
    owner: Any, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int
) -> tuple[mx.array, mx.array, mx.array] | None:
    """``owner``'s tiles for these arrays while the plan is on and they fit, else None; made on
    the first call and kept on ``owner`` while its codes are the same array."""
    if not _on or biases is None or not fits(w, bits, group_size):
        return None
    if not takes(1, bits):
        return None
    kept = owner.__dict__.get("_cpu_tiles")
    if kept is not None and kept[0] is w and kept[1] is scales and kept[2] is biases:
        return kept[3]
    # None where the machine has no room for them: asked once (kept as None), not every product
    tiles = layout(w, scales, biases, bits, group_size) if room_for(w, scales) else None
    if kept is None:
        _owners[:] = [ref for ref in _owners if ref() is not None]
        _owners.append(weakref.ref(owner))
    object.__setattr__(owner, "_cpu_tiles", (w, scales, biases, tiles))
    return tiles


def bytes_not_read(model: nn.Module) -> int:
    """How many fewer bytes a decode step of ``model`` reads than its parameters hold, where its
    products read tiles: each tiled layer's, fused group's or tied head's arrays (scales and
    biases widened to float32 at load) less its tiles' (float16 where exact, a symmetric layer's
    biases dropped). 0 where nothing is tiled (the plan off, or before the first decode step)."""
    saved, seen = 0, set()
    for module in model.modules():
        group = module.__dict__.get("cpu_fused", (None,))[0]
        for owner in (module, group):
            kept = None if owner is None else owner.__dict__.get("_cpu_tiles")
            if kept is None or kept[3] is None or id(owner) in seen:
                continue
            seen.add(id(owner))
            saved += sum(a.nbytes for a in kept[:3]) - sum(a.nbytes for a in kept[3])
    return saved


def room_for(w: mx.array, scales: mx.array) -> bool:
    """Whether the machine can hold a layer's tiles (its codes' bytes again, scales and biases
    at most float32) and still give ``RESERVE``; counts ``skipped_bytes`` where not."""
    global skipped_bytes
    need = w.nbytes + 2 * scales.size * 4
    can = memory.available()
    if can is None or can.bytes - need >= RESERVE:
        return True
    skipped_bytes += need
    return False


def product(
    x: mx.array,
    owner: Any,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    gs: int,
    bits: int,
) -> mx.array | None:
    """``x @ dequantize(w, scales, biases).T`` through ``owner``'s tiles (``K.quantized_matvec``
    takes them), in the dtype MLX's arrays would give; None where the plan is off or they do
    not fit, or for more rows than :func:`takes` (the caller's path)."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if not takes(rows, bits):
        return None  # on AVX2, more rows than the tiles win at: the caller's path
    tiled = of(owner, w, scales, biases, gs, bits)
    if tiled is None:
        return None
    y = kernels.load().quantized_matvec(x, *tiled, gs, bits)
    # MLX's promotion of two float dtypes: the same one, else float32 (float16 with bfloat16 too)
    dtype = x.dtype if x.dtype == scales.dtype else mx.float32
    return y if y.dtype == dtype else y.astype(dtype)
