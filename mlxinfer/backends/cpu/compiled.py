"""The compiled kernels (``backends.kernels``, from ``csrc/``) in the CPU backend's layers.

A layer whose plan says ``kernel`` (``parallel.LayerPlan.kernel``, set by ``kinds.set_plan``
for the kinds ``quantized``, ``head`` and ``matvec``) runs a product of at most
:data:`MAX_ROWS` rows (decode, batched decode, speculative verification) as one kernel
call: ``quantized_matvec`` for an affine 4-/8-bit layer, ``matvec`` for a float one (float32,
bfloat16 or float16 weights, accumulated in float32: MLX's own half-precision product on the
CPU has no BLAS, one row 6-20x (bf16) and 13-44x (f16) the kernel's time on SmolLM2's shapes,
csrc/README.md). The
kernel threads itself (its pool: the ``kernel_threads`` plan), so such a layer never takes
the two-stream split: the pool and MLX's two worker streams would ask for more threads
than there are cores. More rows (prefill), a layer the kernels do not cover, or no kernels
loaded (:func:`loaded` is None: not built, ``MLXINFER_KERNELS=0``, another MLX): the
layer's own path, exactly as without them. The kernels are lazy MLX primitives; on a GPU
stream they hand the product to MLX's own op.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from .. import kernels

MAX_ROWS = 16  # the kernels' rows: up to 16 they beat MLX's products by far (csrc/README.md)
QUANTIZED_BITS = (4, 8)
FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)  # the float kernel's weights
GROUP_SIZES = (32, 64, 128)


def loaded() -> ModuleType | None:
    """The kernels' module, or None (``kernels.reason()`` says why)."""
    return kernels.load()


def quantized_fits(layer: nn.Module) -> bool:
    """Whether the quantized kernel computes ``layer``'s product (affine, 4 or 8 bits, group
    32/64/128, with biases)."""
    return (
        getattr(layer, "mode", "affine") == "affine"
        and getattr(layer, "bits", None) in QUANTIZED_BITS
        and getattr(layer, "group_size", None) in GROUP_SIZES
        and layer.get("biases") is not None
    )


def float_fits(weight: mx.array) -> bool:
    """Whether the float kernel computes products with ``weight`` (2-D float32, bfloat16 or
    float16)."""
    return weight.ndim == 2 and weight.dtype in FLOAT_DTYPES


def runs(layer: nn.Module, x: mx.array) -> bool:
    """Whether ``layer``'s product with ``x`` is a kernel call: its plan says so, ``x`` has at
    most ``MAX_ROWS`` rows and the kernels are loaded."""
    plan = getattr(layer, "cpu_plan", None)
    return (
        plan is not None
        and plan.kernel
        and x.size // x.shape[-1] <= MAX_ROWS
        and kernels.load() is not None
    )


def quantized_product(x: mx.array, layer: nn.Module) -> mx.array:
    """``layer(x)`` for a quantized layer (or a quantized embedding as the LM head), one call."""
    y = kernels.load().quantized_matvec(
        x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits
    )
    return y + layer["bias"] if "bias" in layer else y


def matvec(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for an (out, in) float ``weight`` (:func:`float_fits`), one call; the
    output dtype is ``x @ weight.T``'s."""
    return kernels.load().matvec(x, weight)


def set_threads(option: str) -> None:
    """The ``kernel_threads`` plan: ``one`` thread, or ``all`` the CPUs this process may use.
    The pool is the process's: the last model loaded sets it."""
    k = kernels.load()
    if k is not None:
        k.set_num_threads(1 if option == "one" else 0)


def key() -> list | None:
    """What the plans cache is keyed on about the kernels: None without them, else the
    instruction set, the usable CPUs and the MLX they were built for."""
    k = kernels.load()
    return None if k is None else [k.isa(), k.available_cpus(), k.mlx_version]
