"""The compiled kernels (``backends.kernels``, from ``csrc/``) in the CPU backend's layers.

A layer whose plan says ``kernel`` (``parallel.LayerPlan.kernel``, set by ``kinds.set_plan``
for the kinds ``quantized``, ``head`` and ``matvec``) runs a product of at most
:data:`MAX_ROWS` rows (decode, batched decode, speculative verification) as one kernel
call: ``quantized_matvec`` for an affine 2/3/4/5/6/8-bit, mxfp4, nvfp4 or mxfp8 layer, ``matvec`` for a float one
(float32, bfloat16 or float16 weights, accumulated in float32: MLX's own half-precision product
on the CPU has no BLAS, one row 6-20x (bf16) and 13-44x (f16) the kernel's time on SmolLM2's
shapes, csrc/README.md). The
kernel threads itself (its pool: the ``kernel_threads`` plan), so such a layer never takes
the two-stream split: the pool and MLX's two worker streams would ask for more threads
than there are cores. More rows (prefill), a layer the kernels do not cover, or no kernels
loaded (:func:`loaded` is None: not built, ``MLXINFER_KERNELS=0``, another MLX): the
layer's own path, exactly as without them. The kernels are lazy MLX primitives; on a GPU
stream they hand the product to MLX's own op.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...cache.kv import KVCache
from ...cache.rotating import RotatingKVCache
from ...models import layers as model_layers
from .. import kernels

MAX_ROWS = 16  # the kernels' rows: up to 16 they beat MLX's products by far (csrc/README.md)
QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)  # MLX's affine widths (mx.quantize)
FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)  # the float kernel's weights
GROUP_SIZES = (32, 64, 128)
# MLX's float modes the quantized kernel takes: (bits, group size), no biases (mx.quantize's
# defaults, the only settings MLX has for them).
FLOAT_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


def loaded() -> ModuleType | None:
    """The kernels' module, or None (``kernels.reason()`` says why)."""
    return kernels.load()


def quantized_fits(layer: nn.Module) -> bool:
    """Whether the quantized kernel computes ``layer``'s product: affine (2, 3, 4, 5, 6 or 8
    bits, group 32/64/128, with biases), or one of :data:`FLOAT_MODES` (mxfp4, nvfp4, mxfp8 at
    their bits and group size, no biases) from a module that has the mode (one built before it
    lacks it: affine only, or affine and mxfp4)."""
    mode = getattr(layer, "mode", "affine")
    if mode in FLOAT_MODES:
        return (
            _has_mode(mode)
            and (getattr(layer, "bits", None), getattr(layer, "group_size", None))
            == FLOAT_MODES[mode]
            and layer.get("biases") is None
        )
    return (
        mode == "affine"
        and getattr(layer, "bits", None) in QUANTIZED_BITS
        and getattr(layer, "group_size", None) in GROUP_SIZES
        and layer.get("biases") is not None
    )


def _has_mode(mode: str) -> bool:
    """Whether the loaded module's quantized_matvec takes ``mode`` (not one built before it)."""
    return mode in getattr(kernels.load(), "quantized_modes", ())


def float_fits(weight: mx.array) -> bool:
    """Whether the float kernel computes products with ``weight`` (2-D float32, bfloat16 or
    float16)."""
    return weight.ndim == 2 and weight.dtype in FLOAT_DTYPES


def runs(layer: nn.Module, x: mx.array, max_rows: int | None = MAX_ROWS) -> bool:
    """Whether ``layer``'s product with ``x`` is a kernel call: its plan says so, ``x`` has at
    most ``max_rows`` rows (None: any; a quantized layer's caller stops at its dequantized
    product's crossover) and the kernels are loaded."""
    plan = getattr(layer, "cpu_plan", None)
    return (
        plan is not None
        and plan.kernel
        and (max_rows is None or x.size // x.shape[-1] <= max_rows)
        and kernels.load() is not None
    )


def quantized_product(x: mx.array, layer: nn.Module) -> mx.array:
    """``layer(x)`` for a quantized layer (or a quantized embedding as the LM head), one call."""
    product = layer.__dict__.get("cpu_kernel") or quantized_call(kernels.load(), layer)
    return product(x, layer)


def bind(layer: nn.Module) -> None:
    """Decide once, when the layer's plan is set (``kinds.set_plan``), whether its few-row
    products run on the kernel: its ``cpu_kernel`` becomes ``product(x, layer)`` (the kernel's
    function and the layer's constants bound; the weights are read at each call, so replaced
    parameters are seen) where the plan says ``kernel`` and the kernels are loaded, else None.
    A decode step then asks one attribute instead of :func:`runs`' checks and lookups (211
    quantized products a token in SmolLM2-135M). Only ``x``'s rows are left to check:
    at most :data:`MAX_ROWS` (the caller's)."""
    plan = layer.__dict__.get("cpu_plan")
    k = kernels.load()
    product = None
    if plan is not None and plan.kernel and k is not None and "scales" in layer:
        product = quantized_call(k, layer)
    object.__setattr__(layer, "cpu_kernel", product)


def quantized_call(k: ModuleType, layer: nn.Module):
    """``product(x, layer)``: the quantized kernel's call with ``layer``'s constants bound (its
    mode, group size and bits), its arrays read from the layer at each call."""
    matvec, group_size, bits = k.quantized_matvec, layer.group_size, layer.bits
    mode = getattr(layer, "mode", "affine")
    options = {} if mode == "affine" else {"mode": mode}

    def product(x: mx.array, layer: nn.Module) -> mx.array:
        y = matvec(
            x, layer["weight"], layer["scales"], layer.get("biases"), group_size, bits, **options
        )
        return y + layer["bias"] if "bias" in layer else y

    return product


def int16_fits(layer: nn.Module) -> bool:
    """Whether ``layer``'s many-row products may take the int16 kernel
    (``K.quantized_matmul_i16``: x rounded to int16 per block of 32 inputs, AVX-512 VNNI's
    products; csrc/src/prefill_i16.cpp): affine 2- to 8-bit codes, group 32/64/128, outputs a
    multiple of 32, on a CPU with AVX-512 F, BW, VNNI and VBMI at the kernels' level."""
    k = kernels.load()
    return (
        k is not None
        and hasattr(k, "quantized_matmul_i16")
        and k.vnni_available()
        and quantized_fits(layer)
        and getattr(layer, "mode", "affine") == "affine"
        and layer["weight"].ndim == 2
        and layer["weight"].shape[0] % 32 == 0
    )


def int16_product(x: mx.array, layer: nn.Module) -> mx.array:
    """``layer(x)`` for many rows through the int16 kernel (:func:`int16_fits`). Beyond
    float32's rounding an output is off by at most sum_k |s q_k| times its block's
    max |x| / 65534: about 1.5e-5 of the largest input of a block per unit of weight, far
    below what the weights' own 4- or 5-bit rounding costs (csrc/src/prefill_i16.cpp)."""
    y = kernels.load().quantized_matmul_i16(
        x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits
    )
    return y + layer["bias"] if "bias" in layer else y


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


def matvec(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for an (out, in) float ``weight`` (:func:`float_fits`), one call; the
    output dtype is ``x @ weight.T``'s."""
    return kernels.load().matvec(x, weight)


def decode_kernels(on: bool) -> tuple:
    """``(rms_norm, swiglu)``: the kernels' functions a layer under the ``decode=kernel`` plan
    calls (each None where the loaded module lacks it), bound once when the plan is set
    (``kinds.set_plan``); ``(None, None)`` for ``ops`` or without the kernels."""
    k = kernels.load()
    if not on or k is None:
        return None, None
    return getattr(k, "rms_norm", None), getattr(k, "swiglu", None)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """RMSNorm of ``x``'s rows as one kernel call where the layer's ``decode`` plan is
    ``kernel`` and ``x`` has at most ``MAX_ROWS`` rows; None otherwise (the caller's path)."""
    if x.size // max(1, x.shape[-1]) > MAX_ROWS or kernels.load() is None:
        return None
    return kernels.load().rms_norm(x, weight, eps)


def log_softmax(logits: mx.array) -> mx.array | None:
    """``logits - logsumexp(logits)`` over the last axis of float32 logits as one kernel call
    (a vectorised exp, many times faster than MLX's logsumexp on the CPU: docs/performance.md);
    None without the kernels, for other dtypes, or
    from a module built before the kernel was added (an install not rebuilt since)."""
    k = kernels.load()
    if k is None or logits.dtype != mx.float32 or not hasattr(k, "log_softmax"):
        return None
    return k.log_softmax(logits)


def sample(
    logits: mx.array, key: mx.array, temperature: float, top_k: int, top_p: float, min_p: float
) -> mx.array | None:
    """A token per row of (B, V) (or (V,)) float logits as one kernel call (``K.sample``:
    temperature, top-k, top-p and min-p as ``filtered_logprobs`` applies them, then the row's
    uniform number from ``key`` through the kept tokens' cumulative probabilities), uint32 as
    ``mx.random.categorical`` gives them; None without the kernel (a module built before it)."""
    k = kernels.load()
    if k is None or not hasattr(k, "sample") or logits.ndim not in (1, 2) or logits.size == 0:
        return None
    rows = logits.reshape(-1, logits.shape[-1])
    u = mx.random.uniform(shape=(rows.shape[0],), key=key)
    tokens = k.sample(rows, u, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return tokens.reshape(logits.shape[:-1])


def gated(gate: mx.array, up: mx.array, act) -> mx.array | None:
    """``act(gate) * up`` as one kernel call for ``nn.silu`` (``K.swiglu``) and
    ``nn.gelu_approx`` (``K.gelu_tanh_glu``: GELU's tanh form, Gemma's), float32, any rows (a
    vectorised exp, threaded: 128 x 1,536 SwiGLU 67 us against the fast exponential's 732 us;
    128 x 2,048 GELU 98 us against MLX's 7.1 ms, whose tanh does not vectorise; 2-vCPU EPYC);
    None otherwise, or from a module built before the kernel was added."""
    k = kernels.load()
    if k is None or gate.dtype != mx.float32 or up.dtype != mx.float32:
        return None
    name = "swiglu" if act is nn.silu else "gelu_tanh_glu" if act is nn.gelu_approx else None
    fn = getattr(k, name, None) if name else None
    return None if fn is None else fn(gate, up)


def family(module: nn.Module) -> type:
    """``module``'s own class, under the CPU backend's mixins (``layers.with_mixin``)."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith(__package__))


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
    one kernel call, instead of ``layers.attention.paged_attention``'s ~20 primitives."""
    return kernels.load().paged_attention(
        q, pages.keys, pages.values, pages.blocks, pages.visible, scale=scale
    )


def set_threads(option: str) -> None:
    """The ``kernel_threads`` plan: ``one`` thread, or ``all`` the CPUs this process may use.
    The pool is the process's: the last model loaded sets it."""
    k = kernels.load()
    if k is not None:
        k.set_num_threads(1 if option == "one" else 0)


def int16_decode_fits(model: nn.Module) -> bool:
    """Whether the ``int16_decode`` plan acts on ``model``: the kernels' few-row int16 path is
    built and runs here (AVX-512 VNNI and VBMI), and some layer's products are affine codes it
    takes."""
    k = kernels.load()
    if k is None or not hasattr(k, "set_int16_decode_rows") or not k.vnni_available():
        return False
    return any(
        "scales" in m and quantized_fits(m) and getattr(m, "mode", "affine") == "affine"
        for m in model.modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    )


def set_int16_decode(on: bool) -> None:
    """The ``int16_decode`` plan: every quantized product of up to 4 rows of affine codes (the
    blocks' kernels' and the layers') rounds x to int16 per block of 32 and runs the int16
    product's few-row path (``K.set_int16_decode_rows``), or none does. Process-wide, like the
    kernels' threads: the last model loaded sets it."""
    k = kernels.load()
    if k is not None and hasattr(k, "set_int16_decode_rows"):
        k.set_int16_decode_rows(4 if on else 0)


def key() -> list | None:
    """What the plans cache is keyed on about the kernels: None without them, else the
    instruction set, the usable CPUs and the MLX they were built for."""
    k = kernels.load()
    return None if k is None else [k.isa(), k.available_cpus(), k.mlx_version]
