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
stream they hand the product to MLX's own op. The kernels' attention is
``attention_kernels.py``.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from . import tiles

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
        arrays = (layer["weight"], layer["scales"], layer.get("biases"))
        y = tiles.product(x, layer, *arrays, group_size, bits) if tiles.on() else None
        if y is None:
            y = matvec(x, *arrays, group_size, bits, **options)
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
    arrays = (layer["weight"], layer["scales"], layer["biases"])
    y = tiles.product(x, layer, *arrays, layer.group_size, layer.bits) if tiles.on() else None
    if y is None:  # with tiles: the same arithmetic, no tiles laid out per product
        y = kernels.load().quantized_matmul_i16(x, *arrays, layer.group_size, layer.bits)
    return y + layer["bias"] if "bias" in layer else y


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


def log_softmax_argmax(logits: mx.array) -> tuple[mx.array, mx.array] | None:
    """``log_softmax`` and each row's ``mx.argmax`` (uint32, the same index) in one kernel call
    over the rows on the kernels' threads (MLX's argmax runs a batch's rows on one thread); None
    where ``log_softmax`` is, or from a module built before this kernel."""
    k = kernels.load()
    if k is None or logits.dtype != mx.float32 or not hasattr(k, "log_softmax_argmax"):
        return None
    normalised, index = k.log_softmax_argmax(logits)
    return normalised, index


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


def set_threads(option: str) -> None:
    """The ``kernel_threads`` plan: ``one`` thread, or ``all`` the CPUs this process may use.
    The pool is the process's: the last model loaded sets it."""
    k = kernels.load()
    if k is not None:
        k.set_num_threads(1 if option == "one" else 0)


def int16_decode_fits(model: nn.Module) -> bool:
    """Whether the ``int16_decode`` plan acts on ``model``: the kernels' few-row int16 path is
    built and runs here (AVX-512 VNNI and VBMI), and some layer's products are affine codes it
    takes; or, without VBMI (AVX2, or Cascade Lake's AVX-512 VNNI), some layer can be tiled."""
    k = kernels.load()
    if k is None or not hasattr(k, "set_int16_decode_rows"):
        return False
    if not k.vnni_available():  # the few-row path needs VBMI; the tiles run without
        return tiles.available() and tiles.model_fits(model)
    return any(
        "scales" in m and quantized_fits(m) and getattr(m, "mode", "affine") == "affine"
        for m in model.modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    )


def set_int16_decode(on: bool) -> None:
    """The ``int16_decode`` plan: decode's quantized products of affine codes (the blocks'
    kernels' and the layers') round x to int16 per block of 32, 4-, 5-, 6- and 8-bit layers through
    their tiles (``tiles``), other widths' products of up to 4 rows through the int16 product's
    few-row path (``K.set_int16_decode_rows``); or none does (their tiles dropped).
    Process-wide, like the kernels' threads: the last model loaded sets it."""
    k = kernels.load()
    if k is not None and hasattr(k, "set_int16_decode_rows"):
        k.set_int16_decode_rows(4 if on else 0)
    tiles.set_on(on)


def key() -> list | None:
    """What the plans cache is keyed on about the kernels: None without them, else the
    instruction set (with AVX-VNNI or not), the usable CPUs and the MLX they were built for,
    and ``int8`` where int8 activations run (MLXINFER_INT8_ACTIVATIONS=1: other products, so
    plans timed with them are not the default's)."""
    k = kernels.load()
    if k is None:
        return None
    int8 = ["int8"] if kernels.int8_on(k) else []
    return [kernels.level(k), k.available_cpus(), k.mlx_version, *int8]
