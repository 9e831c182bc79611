"""A decode step's whole block as four kernel calls, where there were about fifteen.

SmolLM2-135M's decode step was 471 MLX primitives, each ~3 µs of MLX's scheduling on the
CPU (docs/performance.md): ~1.4 ms of a ~9.5 ms token, 15 primitives a block. Under the
``decode=kernel`` plan a pre-norm block of the common families runs as

1. ``norm_products``: the input norm and the q | k | v products in one row (each head's q
   and k normalised too where the family has ``q_norm``/``k_norm``);
2. ``pool_write`` of the token's k (rotated) and v, read from that row, into the cache's
   slot (its buffers read as one block per KV head; both sides in one call);
3. ``attention_output``: attention, ``o_proj`` (and Gemma's post-attention norm) and the
   residual add;
4. ``mlp_output``: the MLP's norm, gate | up, the gated activation, ``down_proj`` (and
   Gemma's post-MLP norm) and the residual add

(csrc/src/block.h). Each kernel does the separate kernels' steps in their order and float
arithmetic, so a block's output is theirs bit for bit (tests/backends/test_cpu_blocks.py).
Over a single request's cache the four are then one node of MLX's graph (``fuse``: run in
order in one evaluation; MLX's scheduling costs each node several µs on the CPU), and so
over the batching engine's pool, its rows' blocks.

Which blocks: those whose forward is one of :data:`FORMS` (Llama/Mistral/SmolLM, Qwen2/3,
Gemma 1's pre-norm block, Gemma 2/3's block with post-norms), whose attention the decode
kernels already take (``attention_kernels.attention_fits``), whose MLP is a plain gated one (SiLU or
GELU's tanh form), and whose products are affine quantized layers on the kernel
(``compiled.bind``) with no bias. Per call: one float32 token over a ``KVCache`` or
``RotatingKVCache`` with no mask. Anything else, the block's own forward (the separate
kernels, or MLX's ops). Models, checkpoints and Metal are untouched: this is the CPU
backend's, applied at load (:func:`swap_blocks`).
"""

from __future__ import annotations

import operator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...cache.kv import KVCache
from ...cache.quantized import QuantizedKVCache
from ...cache.rotating import RotatingKVCache
from ...models import gemma, gemma2, llama, qwen2
from ...models import layers as model_layers
from .. import kernels
from . import attention_kernels, compiled, fused, layers, quantized, tiles

# A block's forward -> whether it has Gemma 2/3's post-norms (post_attention_layernorm after
# attention, pre_/post_feedforward_layernorm around the MLP).
FORMS = {
    llama.TransformerBlock.__call__: False,
    qwen2.TransformerBlock.__call__: False,
    gemma.DecoderLayer.__call__: False,
    gemma2.DecoderLayer.__call__: True,
}
ACTS = {nn.silu: 0, nn.gelu_approx: 1}  # the kernels' act codes
ON = True  # off: every block its own forward (benchmarks compare the two in one process)
FUSE = True  # off: a block's four kernel calls four nodes of MLX's graph, not one (``fuse``)


class CPUDecodeBlock:
    """A block whose decode step may run as the fused kernels (:func:`decode_block`)."""

    cpu_decode_kernel = False  # set by the ``decode`` plan (``kinds``)

    def __call__(self, x: mx.array, mask: Any, cache: Any, *args: Any) -> mx.array:
        if self.cpu_decode_kernel and ON and not args:
            y = decode_block(self, x, mask, cache)
            if y is None:  # the batching engine's step over its pool's pages
                y = decode_rows(self, x, mask, cache)
            if y is not None:
                return y
        return super().__call__(x, mask, cache, *args)  # type: ignore[misc]


def swap_blocks(model: nn.Module) -> int:
    """Give the blocks of :data:`FORMS` :class:`CPUDecodeBlock`; how many."""
    n = 0
    for _, module in model.named_modules():
        if compiled.family(module).__call__ in FORMS:
            layers.with_mixin(module, CPUDecodeBlock)
            n += 1
    return n


def decode_block(block: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
    """``block(x, mask, cache)`` for one float32 token as the fused kernels, or None where they
    do not apply (see the module's docstring); the cache advanced as the block's own forward
    would (``attention_kernels.decode_position``)."""
    if (
        mask is not None
        or x.shape[:2] != (1, 1)
        or x.dtype != mx.float32
        or type(cache) not in (KVCache, RotatingKVCache, QuantizedKVCache)
        or cache.keys is None
        or kernels.load() is None
    ):
        return None
    parts = _parts(block)
    if parts is None:
        return None
    if type(cache) is QuantizedKVCache:
        return _decode_quantized(x, cache, parts)
    attn, qkv_layers, o, gate_up, down, act, norms, head_norms = parts
    k_ = kernels.load()
    n_q, n_kv = attn.n_heads, attn.n_kv_heads
    (w1, eps1), post_attn, (w2, eps2), post_mlp = norms
    qkv = k_.norm_products(x, w1, eps1, qkv_layers, **_head_options(attn, head_norms))
    like = _like(attn, cache)
    slot, seen, cos, sin = attention_kernels.decode_position(attn, cache, like, like)
    rope = attn.rope
    rows = attention_kernels.slot_rows(n_kv, cache.keys.shape[2], slot)
    keys, values = _write(k_, [cache.keys], [cache.values], qkv, rows, cos, sin, attn)
    h = k_.attention_output(
        x,
        qkv,
        keys[0],
        values[0],
        cos,
        sin,
        o,
        n_q=n_q,
        offset=seen - 1,
        scale=attn.scale,
        dims=rope.dims,
        traditional=rope.traditional,
        **_post(post_attn),
    )
    y = k_.mlp_output(h, w2, eps2, gate_up, down, act=act, **_post(post_mlp))
    y, (cache.keys,), (cache.values,) = _fused(k_, y, keys, values)
    return y


def _decode_quantized(x: mx.array, cache: QuantizedKVCache, parts) -> mx.array | None:
    """:func:`decode_block` over a ``QuantizedKVCache`` (``--kv-bits``): the token's key and
    value quantized into the buffers' next slot as the cache's own write would (one
    ``pool_write`` into both sides' codes, scales and biases, the buffers read as one block per
    KV head) and read packed by ``paged_attention_output``; None where the kernels do not read
    the cache."""
    attn, qkv_layers, o, gate_up, down, act, norms, head_norms = parts
    if not attention_kernels.quantized_fits(cache.keys[1].dtype, cache.group_size, cache.bits):
        return None
    k_ = kernels.load()
    n_kv = attn.n_kv_heads
    (w1, eps1), post_attn, (w2, eps2), post_mlp = norms
    qkv = k_.norm_products(x, w1, eps1, qkv_layers, **_head_options(attn, head_norms))
    offset, rope = cache.offset, attn.rope
    cos, sin = rope.table(offset, 1, rope.base_at(offset, 1))
    cache.make_room()
    cap = cache.keys[0].shape[2]
    rows = attention_kernels.slot_rows(n_kv, cap, offset)
    kv = dict(group_size=cache.group_size, bits=cache.bits)
    keys, values = _write(k_, cache.keys, cache.values, qkv, rows, cos, sin, attn, kv)
    cache.offset = offset + 1
    pages = attention_kernels.cache_pages(keys, values, 1, n_kv, cap, offset + 1, cache)
    h = _attention_output(x, qkv, pages, cos, sin, attn, o, post_attn, kv)
    y = k_.mlp_output(h, w2, eps2, gate_up, down, act=act, **_post(post_mlp))
    y, cache.keys, cache.values = _fused(k_, y, keys, values)
    return y


def decode_rows(block: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
    """``block(x, mask, cache)`` for the batching engine's decode step (one float32 token in
    each of up to ``compiled.MAX_ROWS`` rows over its pool's pages) as four kernel calls: the
    rows' q | k | v, their keys (rotated at each row's position) and values written into the
    pool (``pool_write``), attention over the pages with ``o_proj`` and the residual
    (``paged_attention_output``), the MLP; None where it does not apply (another cache, a
    quantized pool of a format the kernels do not read, a mask of the layer's own, dynamic
    NTK's per-length frequencies)."""
    write_with = getattr(cache, "write_rows_with", None)
    if (
        write_with is None
        or x.ndim != 3
        or x.shape[1] != 1
        or x.shape[0] > compiled.MAX_ROWS
        or x.dtype != mx.float32
        or not cache.reads_pages(mask)
        or kernels.load() is None
    ):
        return None
    parts = _parts(block)
    if parts is None:
        return None
    attn, qkv_layers, o, gate_up, down, act, norms, head_norms = parts
    offsets, rope = cache.offset, attn.rope
    if rope.dynamic is not None and isinstance(offsets, mx.array):
        return None
    kv = {}  # a quantized pool: each side [codes, scales, biases], written and read packed
    if cache.quantized:
        scales = cache.slots.pool.keys[cache.layer][1]
        if not attention_kernels.quantized_fits(scales.dtype, cache.group_size, cache.bits):
            return None
        kv = dict(group_size=cache.group_size, bits=cache.bits)
    k_ = kernels.load()
    B = x.shape[0]
    (w1, eps1), post_attn, (w2, eps2), post_mlp = norms
    qkv = k_.norm_products(x, w1, eps1, qkv_layers, **_head_options(attn, head_norms))
    cos, sin = rope.table(offsets, 1, rope.base_at(offsets, 1))
    if cos.size != B * (rope.dims // 2):  # one offset for every row
        cos, sin = (mx.broadcast_to(t.reshape(1, -1), (B, rope.dims // 2)) for t in (cos, sin))

    # The block built where the pool's arrays are written: its pages are this step's tables with
    # the write's keys and values; then one node of MLX's graph (SmolLM2: 1.07x a lone row,
    # 1.03x at 4 rows, 1.065x at 8; docs/performance.md).
    tables = cache.pages(mask)
    out = []

    def write(keys: Any, values: Any, rows: mx.array) -> tuple[Any, Any]:
        ks, vs = _write(k_, keys if kv else [keys], values if kv else [values], qkv, rows, cos,
                        sin, attn, kv)  # fmt: skip
        pages = tables._replace(keys=ks, values=vs)
        h = _attention_output(x, qkv, pages, cos, sin, attn, o, post_attn, kv)
        y = k_.mlp_output(h, w2, eps2, gate_up, down, act=act, **_post(post_mlp))
        y, ks, vs = _fused(k_, y, ks, vs)
        out.append(y)
        return (ks, vs) if kv else (ks[0], vs[0])

    write_with(write)
    return out[0]


def _write(k_, keys, values, qkv, rows, cos, sin, attn, kv: dict | None = None) -> tuple:
    """``pool_write``: the rows' k (rotated) and v from their q | k | v rows written at
    ``rows`` of ``keys`` and ``values`` (lists: a float pool each, or a quantized pool's
    [codes, scales, biases] with ``kv``'s group_size and bits) in one call; the two updated
    lists."""
    n_q, n_kv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    out = k_.pool_write(
        keys,
        values,
        qkv,
        rows,
        cos,
        sin,
        k_start=n_q * D,
        v_start=(n_q + n_kv) * D,
        dims=attn.rope.dims,
        traditional=attn.rope.traditional,
        **(kv or {}),
    )
    half = len(out) // 2
    return out[:half], out[half:]


def _fused(k_, y: mx.array, keys: list, values: list) -> tuple[mx.array, list, list]:
    """The block's kernel calls that make ``y`` and the updated ``keys`` and ``values`` (lists)
    as one node of MLX's graph (``fuse``: MLX's scheduling costs each node several µs on the
    CPU, a step of 30 blocks 120 of them); the same three back."""
    if not FUSE:
        return y, keys, values
    out = k_.fuse([y, *keys, *values])
    n = len(keys)
    return out[0], out[1 : 1 + n], out[1 + n :]


def _attention_output(x, qkv, pages, cos, sin, attn, o, post_attn, kv: dict) -> mx.array:
    """``paged_attention_output`` over ``pages`` (float, or a quantized pool's triples with
    ``kv``'s group_size and bits), queries rotated by the rows' cos/sin."""
    return kernels.load().paged_attention_output(
        x,
        qkv,
        pages.keys,
        pages.values,
        pages.blocks,
        pages.visible,
        cos,
        sin,
        o,
        n_q=attn.n_heads,
        scale=attn.scale,
        dims=attn.rope.dims,
        traditional=attn.rope.traditional,
        **_post(post_attn),
        **{f"kv_{k}": v for k, v in kv.items()},
    )


def _head_options(attn: nn.Module, head_norms) -> dict[str, Any]:
    """``norm_products``' per-head q/k norm arguments (none without them)."""
    if head_norms is None:
        return {}
    (qn, q_eps), (kn, _) = head_norms
    return dict(
        q_norm=qn,
        k_norm=kn,
        n_q=attn.n_heads,
        n_kv=attn.n_kv_heads,
        head_dim=attn.head_dim,
        head_eps=q_eps,
    )


def _post(norm) -> dict[str, Any]:
    """A kernel's post-norm arguments (none without one)."""
    return {} if norm is None else dict(post_norm=norm[0], post_eps=norm[1])


EPOCH = 0  # bumped by ``kinds.set_plan``: a block's parts, read under older plans, are re-read


def _parts(block: nn.Module):
    """What the kernels read of ``block`` (its child modules, weights and norms), or None where
    one part does not fit. Read once and kept with every (module, key, value) it read; kept
    while each is still what its module holds and no plan was set since (:data:`EPOCH`), so
    replaced parameters or modules are seen at the next call, for ~25 lookups instead of the
    whole reading (~1 ms a SmolLM2 step)."""
    kept = block.__dict__.get("_cpu_parts")
    if kept is not None and kept[0] == EPOCH:
        modules, keys, values = kept[1]
        if all(map(operator.is_, map(operator.getitem, modules, keys), values)):  # no frames
            return kept[2]
    reads = _Reads()
    parts = _read_parts(block, reads)
    object.__setattr__(block, "_cpu_parts", (EPOCH, tuple(zip(*reads)) or ((), (), ()), parts))
    return parts


class _Reads(list):
    """The (module, key, value) a block's parts were read from."""

    def get(self, module: nn.Module, key: str) -> Any:
        value = module[key]
        self.append((module, key, value))
        return value


def _read_parts(block: nn.Module, reads: _Reads):
    if not hasattr(kernels.load(), "mlp_output"):  # a module built before the fused blocks
        return None
    sandwich = FORMS[compiled.family(block).__call__]
    attn, mlp = reads.get(block, "self_attn"), reads.get(block, "mlp")
    if (
        not isinstance(attn, layers.CPUAttention)
        or not (attn.cpu_decode_kernel and attn.cpu_decode_fits)
        or attn.fused_qkv
    ):
        return None
    gated = compiled.family(mlp)
    if (
        not isinstance(mlp, layers.CPUGatedMLP)
        or gated.__call__ is not model_layers.GatedMLP.__call__
        or gated.combine is not model_layers.GatedMLP.combine
        or ACTS.get(mlp.act) is None
    ):
        return None
    qkv_layers = _siblings(attn, ("q_proj", "k_proj", "v_proj"), reads)
    gate_up = _siblings(mlp, ("gate_proj", "up_proj"), reads)
    o, down = _layer(reads.get(attn, "o_proj"), reads), _layer(reads.get(mlp, "down_proj"), reads)
    if qkv_layers is None or gate_up is None or o is None or down is None:
        return None
    names = (
        ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
        if sandwich
        else ("input_layernorm", None, "post_attention_layernorm")
    )
    if sandwich:
        names += ("post_feedforward_layernorm",)
    norms = [None if name is None else _norm(reads.get(block, name), reads) for name in names]
    norms += [None] * (4 - len(norms))
    if (
        norms[0] is None
        or norms[2] is None
        or (sandwich and (norms[1] is None or norms[3] is None))
    ):
        return None
    head_norms = None
    if attn.has_qk_norm:
        head_norms = (
            _norm(reads.get(attn, "q_norm"), reads),
            _norm(reads.get(attn, "k_norm"), reads),
        )
        if None in head_norms or head_norms[0][1] != head_norms[1][1]:
            return None
    return attn, qkv_layers, o, gate_up, down, ACTS[mlp.act], norms, head_norms


def _layer(layer: nn.Module, reads: _Reads, tile: bool = True) -> tuple | None:
    """(w, scales, biases, group_size, bits) of an affine quantized layer on the kernel with no
    bias (its tiles' arrays where they are made: ``tile``), else None."""
    if (
        not isinstance(layer, quantized.CPUQuantizedLinear)
        or layer.__dict__.get("cpu_kernel") is None
        or getattr(layer, "mode", "affine") != "affine"
        or "bias" in layer
        or layer.bits not in compiled.QUANTIZED_BITS
        or layer.group_size not in compiled.GROUP_SIZES
    ):
        return None
    arrays = (*(reads.get(layer, key) for key in ("weight", "scales", "biases")),)
    return (
        _tiled(layer, arrays, layer.group_size, layer.bits)
        if tile
        else (*arrays, layer.group_size, layer.bits)
    )


def _tiled(owner: Any, arrays: tuple, group_size: int, bits: int) -> tuple:
    """(w, scales, biases, group_size, bits) as the kernels take them: ``owner``'s tiles where
    they are made (``tiles.of``), else the arrays."""
    return (*(tiles.of(owner, *arrays, group_size, bits) or arrays), group_size, bits)


def _siblings(module: nn.Module, names: tuple[str, ...], reads: _Reads) -> list[tuple] | None:
    """The siblings as the kernels take them: their stacked arrays where they are one
    :class:`fused.QuantizedGroup` (one product), else each layer's."""
    modules = [reads.get(module, name) for name in names]
    # each one's arrays read (a block is made again when one changes), its tiles not yet: where
    # the group's product runs, its tiles are the ones read (each layer's would be a copy, unread)
    found = [_layer(layer, reads, tile=False) for layer in modules]
    if any(layer is None for layer in found):
        return None
    group = modules[0].__dict__.get("cpu_fused", (None, 0))[0]
    if (
        isinstance(group, fused.QuantizedGroup)
        and group.on
        and len(group.bounds) == len(names)
        and all(m.__dict__.get("cpu_fused", (None,))[0] is group for m in modules)
        and group.mode == "affine"
        and "bias" not in group.arrays
    ):
        a = group.arrays
        return [
            _tiled(group, (a["weight"], a["scales"], a["biases"]), group.group_size, group.bits)
        ]
    return [_tiled(m, f[:3], *f[3:]) for m, f in zip(modules, found)]  # type: ignore[index]


def _norm(norm: nn.Module, reads: _Reads) -> tuple[mx.array, float] | None:
    """(weight, eps) the kernels multiply by: an RMSNorm's float32 weight, or Gemma's kept
    ``1 + w`` (``layers.CPUOffsetNorm``); None for any other norm."""
    form = compiled.family(norm)
    if isinstance(norm, layers.CPUOffsetNorm) and form is model_layers.OffsetRMSNorm:
        kept = norm.__dict__.get("_cpu_one_plus")
        if kept is None or kept[0] is not reads.get(norm, "weight"):
            return None
        weight = kept[1]
    elif isinstance(norm, layers.CPUNorm) and form is model_layers.RMSNorm:
        weight = reads.get(norm, "weight")
    else:
        return None
    return (weight, norm.eps) if weight.dtype == mx.float32 else None


def _like(attn: nn.Module, cache: Any) -> mx.array:
    """A (1, n_kv, 1, head_dim) array of the cache's dtype: what a cache grows its buffers
    like (only its shape and dtype are read)."""
    dtype = cache.keys.dtype
    kept = attn.__dict__.get("_cpu_like")
    if kept is None or kept[0] != dtype:
        kept = (dtype, mx.zeros((1, attn.n_kv_heads, 1, attn.head_dim), dtype))
        mx.eval(kept[1])
        object.__setattr__(attn, "_cpu_like", kept)
    return kept[1]
