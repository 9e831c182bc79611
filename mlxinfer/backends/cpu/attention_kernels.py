"""The compiled kernels' attention in the CPU backend's layers (``backends.kernels``, csrc/).

A prompt's attention as one kernel call (:func:`prefill_attention`); a decode token's over a
plain or rotating cache (:func:`decode_attention`: the key and value written RoPE'd and the
attention, three calls between the projections) where :func:`attention_fits` says the layer is
plain RoPE attention; the batching engine's decode step over its pool's pages
(:func:`paged_decode_attention`). Each returns None where it does not apply, and the layer
takes its own path, exactly as without the kernels. The products' side is ``compiled.py``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...cache.kv import KVCache, Pages
from ...cache.quantized import QuantizedKVCache
from ...cache.rotating import RotatingKVCache
from ...models import layers as model_layers
from ...models.layers import attention as model_attention
from .. import kernels
from . import ops
from .compiled import family


def prefill_attention(q: mx.array, k: Any, v: Any, scale: float, mask: Any) -> mx.array | None:
    """Prompts' attention in one kernel call (``K.prefill_attention``: each query position the
    decode path's vector attention over the keys it sees; 4.5-7x ``ops.attention`` on SmolLM2's
    and Gemma-3's shapes at 127-511 tokens), or None where it does not apply. It takes several
    queries, float32, head dims multiples of 16, and a causal mask, none, or a boolean one of
    shape (L, T) or (B or 1, 1, L, T) (a window, a batch's rows: every key scored, the mask's
    flags kept); an additive mask (ALiBi) or one per head takes ``ops.attention``."""
    if q.ndim != 4 or q.shape[2] < 2:  # a decode step (its own kernels): checked first, cheaply
        return None
    k_ = kernels.load()
    if (
        k_ is None
        or not hasattr(k_, "prefill_attention")
        or not isinstance(k, mx.array)
        or not isinstance(v, mx.array)
        or q.dtype != mx.float32
        or k.dtype != mx.float32
        or v.dtype != mx.float32
        or q.shape[3] % 16
        or v.shape[3] % 16
    ):
        return None
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return k_.prefill_attention(q, k, v, scale=scale, causal=mask == "causal")
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        return None
    if mask.ndim == 2:
        mask = mask[None, None]
    if (
        mask.ndim != 4
        or mask.shape[1] != 1
        or mask.shape[0] not in (1, q.shape[0])
        or mask.shape[2:] != (q.shape[2], k.shape[2])
    ):
        return None
    return k_.prefill_attention(q, k, v, scale=scale, causal=False, mask=mask)


def attention_fits(layer: nn.Module) -> bool:
    """Whether ``layer`` is plain RoPE attention that :func:`decode_attention` computes: the
    shared ``RopeAttention`` steps (its projection, rotation and call not a family's own), an
    unscaled ``RoPE`` rotating an even number of features, no soft-capping, sinks or output
    gate."""
    if not isinstance(layer, model_layers.RopeAttention) or kernels.load() is None:
        return False
    base = model_layers.RopeAttention
    rope = layer.rope
    return (
        all(
            getattr(family(layer), f) is getattr(base, f) for f in ("__call__", "project", "rotate")
        )
        and layer.softcap is None
        and "sinks" not in layer
        and not layer.output_gate
        and isinstance(rope, model_layers.RoPE)
        and family(rope) is model_layers.RoPE  # not a subclass (LongRoPE)
        and rope.input_scale == 1.0
        and rope.dims % 2 == 0
        and rope.dims <= layer.head_dim
    )


def decode_attention(layer: nn.Module, x: mx.array, mask, cache) -> mx.array | None:
    """``layer(x, mask, cache)`` for one token over a plain ``KVCache`` or a
    ``RotatingKVCache`` (a sliding window, or ``--max-kv-size``), its steps between the
    projections as three kernel calls (the key written RoPE'd, the value written, attention);
    None where that does not apply (more tokens or rows, another cache, an empty one, a mask).
    A rotating cache's token goes to the slot its ring gives (``decode_slot``), rotated at its
    own position, and the query sees every stored entry (their order does not matter to one
    query: each key was rotated at its own position)."""
    if (
        mask is not None
        or type(cache) not in (KVCache, RotatingKVCache)
        or cache.keys is None
        or x.shape[:2] != (1, 1)
    ):
        return None
    k_ = kernels.load()
    n_q, n_kv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q, k, v = layer.project(x)
    if layer.has_qk_norm:
        q = layer.q_norm(q.reshape(1, 1, n_q, D)).reshape(1, 1, -1)
        k = layer.k_norm(k.reshape(1, 1, n_kv, D))
    rope = layer.rope
    dims, traditional = rope.dims, rope.traditional
    heads = (1, n_kv, 1, -1)  # only their shapes and dtype matter
    slot, seen, cos, sin = decode_position(layer, cache, k.reshape(heads), v.reshape(heads))
    cache.keys = k_.cache_write(
        cache.keys, k, cos, sin, offset=slot, dims=dims, traditional=traditional
    )
    cache.values = k_.cache_write(cache.values, v, cos, sin, offset=slot)  # not rotated
    out = k_.decode_attention(
        q,
        cache.keys,
        cache.values,
        cos,
        sin,
        n_q=n_q,
        offset=seen - 1,  # the entries it attends to: the first seen
        scale=layer.scale,
        dims=dims,
        traditional=traditional,
    )
    return layer.o_proj(out)  # (1, 1, n_q * Dv), as q


def decode_position(layer: nn.Module, cache, k: mx.array, v: mx.array) -> tuple:
    """``(slot, seen, cos, sin)`` for one more token of ``layer`` in ``cache`` (a ``KVCache``
    or ``RotatingKVCache``), the cache advanced: the slot its key and value go to (a rotating
    cache's ring gives it, ``decode_slot``), how many entries its query sees, and RoPE's table
    at its position. ``k``, ``v``: (1, n_kv, 1, D) arrays whose shape and dtype the buffers
    grow like where they are full (only read then)."""
    offset, rope = cache.offset, layer.rope
    cos, sin = rope.table(offset, 1, rope.base_at(offset, 1))
    if type(cache) is RotatingKVCache:
        slot, seen = cache.decode_slot(k, v)
    else:
        if offset >= cache.keys.shape[2]:  # full: grow (else make_room does nothing)
            cache.make_room(k, v)
        slot, seen = offset, offset + 1
        cache.offset = offset + 1
    return slot, seen, cos, sin


def paged_decode_attention(layer: nn.Module, x: mx.array, mask, cache) -> mx.array | None:
    """``layer(x, mask, cache)`` for the batching engine's decode step (one token a row) over
    its pool's pages, without the model path's transposes: each row's q, k, v as (B, heads, 1,
    D) by reshapes alone (one token: the same order), q and k rotated at the rows' own
    positions, k and v written into the pool as rows (``LayerView.write_rows``), attention over
    the pages as one kernel call, its (B, heads, 1, Dv) output reshaped for ``o_proj``. None
    where that does not apply (more tokens, a cache without pages, a quantized pool, a mask
    of the layer's own, dynamic NTK's per-length frequencies)."""
    reads_pages = getattr(cache, "reads_pages", None)  # a batch's pool view (batch/views.py)
    if reads_pages is None or x.shape[1] != 1 or not reads_pages(mask):
        return None
    offsets, rope = cache.offset, layer.rope
    if rope.dynamic is not None and isinstance(offsets, mx.array):
        return None
    B = x.shape[0]
    n_q, n_kv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q, k, v = layer.project(x)
    q, k = q.reshape(B, n_q, 1, D), k.reshape(B, n_kv, 1, D)
    if layer.has_qk_norm:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = rope(q, offset=offsets), rope(k, offset=offsets)
    cache.write_rows(k.reshape(B, n_kv, D), v.reshape(B, n_kv, -1))
    out = paged_attention(q, cache.pages(mask), layer.scale)  # (B, n_q, 1, Dv)
    return layer.o_proj(out.reshape(B, 1, -1))


def paged_attention(q: mx.array, pages, scale: float) -> mx.array:
    """Decode attention of (B, n_heads, 1, D) queries over a batch's pool pages (``Pages``) as
    one kernel call, instead of ``layers.attention.paged_attention``'s ~20 primitives. A
    quantized pool's blocks are dequantized as the kernel reads them where they fit
    (:func:`quantized_pages_fit`), else they take the model path's ``gather_qmm``."""
    k_ = kernels.load()
    if pages.bits is None:
        return k_.paged_attention(
            q, pages.keys, pages.values, pages.blocks, pages.visible, scale=scale
        )
    if not quantized_pages_fit(q, pages):
        return model_attention.paged_attention(q, pages, scale=scale, exp=ops.exp)
    return k_.paged_attention_quantized(
        q,
        pages.keys,
        pages.values,
        pages.blocks,
        pages.visible,
        scale=scale,
        group_size=pages.group_size,
        bits=pages.bits,
    )


def quantized_decode_attention(q: mx.array, cache: Any, scale: float, mask: Any) -> mx.array | None:
    """Decode attention of (B, n_heads, 1, D) queries over a ``QuantizedKVCache`` (``--kv-bits``)
    with the quantized pages' kernel, instead of MLX's quantized matmul (a scalar loop on the
    CPU: 3-4x slower than float keys, measured): the cache's buffers are one block per (row,
    KV head), its tokens the visible slots. None where that does not apply (a mask: several
    query tokens or padded rows; another cache; what the kernel does not read)."""
    if (
        type(cache) is not QuantizedKVCache
        or mask is not None
        or q.shape[2] != 1
        or cache.keys is None
        or cache.values is None
    ):
        return None
    B, _, cap, _ = cache.keys[0].shape
    n_kv = cache.keys[0].shape[1]
    pages = cache_pages(cache.keys, cache.values, B, n_kv, cap, cache.offset, cache)
    if not quantized_pages_fit(q, pages):
        return None
    return paged_attention(q, pages, scale)


_PLAIN: dict[tuple, Any] = {}  # cache_pages' tables and slot_rows' rows, per shape and offset


def _kept(key: tuple, make: Any) -> Any:
    value = _PLAIN.get(key)
    if value is None:
        if len(_PLAIN) > 128:
            _PLAIN.clear()
        value = _PLAIN[key] = make()
    return value


def cache_pages(keys, values, B: int, n_kv: int, cap: int, offset: int, cache: Any) -> Pages:
    """A plain cache's (B, n_kv, cap, ...) buffers as pool pages: block b · n_kv + h is row b's
    head h, all ``cap`` slots of it, the first ``offset`` visible (the tables kept per shape:
    every layer of a step asks for the same)."""

    def tables() -> tuple[mx.array, mx.array]:
        blocks = np.arange(B * n_kv, dtype=np.uint32).reshape(B, n_kv, 1)
        visible = np.broadcast_to(np.arange(cap) < offset, (B, 1, 1, 1, cap))
        return mx.array(blocks), mx.array(np.ascontiguousarray(visible))

    blocks, visible = _kept(("pages", B, n_kv, cap, offset), tables)
    return Pages(keys, values, blocks, blocks, blocks, visible, cache.bits, cache.group_size)


def slot_rows(n_kv: int, cap: int, offset: int) -> mx.array:
    """The flat rows (``pool_write``'s) of slot ``offset`` of each KV head in a (1, n_kv, cap,
    ...) buffer read as :func:`cache_pages`."""
    return _kept(
        ("rows", n_kv, cap, offset),
        lambda: mx.array([h * cap + offset for h in range(n_kv)], mx.uint32),
    )


def quantized_fits(scales_dtype: mx.Dtype, group_size: int, bits: int) -> bool:
    """Whether the kernels write and read quantized keys and values of this format: float32
    scales, 4 or 8 bits in groups of a power of two from 16, and a module built with the
    quantized pool ops."""
    return (
        hasattr(kernels.load(), "paged_attention_quantized")
        and bits in (4, 8)
        and group_size >= 16
        and group_size & (group_size - 1) == 0
        and scales_dtype == mx.float32
    )


def quantized_pages_fit(q: mx.array, pages) -> bool:
    """Whether ``paged_attention_quantized`` takes these queries and quantized pages: float32
    queries, a format :func:`quantized_fits` takes, head widths of whole groups."""
    gs, bits = pages.group_size, pages.bits
    sides = (pages.keys, pages.values)
    return (
        q.dtype == mx.float32
        and all(quantized_fits(side[1].dtype, gs, bits) for side in sides)
        and all(side[2].dtype == mx.float32 for side in sides)
        and all(side[0].shape[-1] * 32 // bits % gs == 0 for side in sides)
    )
