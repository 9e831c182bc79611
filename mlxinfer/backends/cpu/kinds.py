"""The kinds of CPU decode plan, the layers each acts on, and how to set and read them.

Which option each kind takes on this machine is decided in ``plans`` (by ``timing``). The
``kernel`` options (and the kinds ``matvec``, ``kernel_threads``) are the compiled kernels'
(``compiled``): offered only where they are loaded and cover some of the kind's layers.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...models import layers as model_layers
from . import attention_kernels, blocks, compiled, layers, ops, parallel, quantized

NEVER = 1 << 30  # a threshold never reached: the plainer form always

# kind -> options, plainest first.
OPTIONS: dict[str, tuple[str, ...]] = {
    "cut": ("one", "two"),
    "halves": ("one", "two"),
    "head": ("one", "two", "kernel"),
    "fuse": ("separate", "fused"),
    "quantized": ("one", "halves", "siblings", "balanced", "kernel"),
    "matvec": ("blas", "kernel"),  # the blocks' float Linears: MLX's matmul, or the kernel
    "kernel_threads": ("all", "one"),  # the kernels' pool: every usable CPU, or one thread
    "decode": ("ops", "kernel"),  # decode's norms, attention, SwiGLU: MLX's ops, or fused kernels
    "int16_decode": ("float", "int16"),  # few-row quantized products: float32, or x in int16
}
MOST_PARALLEL = {  # MLXINFER_CPU_PLANS=on: the two-stream plans, MLX's ops (no kernels)
    "cut": "two",
    "halves": "two",
    "head": "two",
    "fuse": "fused",
    "quantized": "siblings",
    "matvec": "blas",
    "kernel_threads": "all",
    "decode": "ops",
    "int16_decode": "float",
}
KERNELS = {  # MLXINFER_CPU_PLANS=kernels: every kernel plan (the rest as ``on``)
    **MOST_PARALLEL,
    "head": "kernel",
    "quantized": "kernel",
    "matvec": "kernel",
    "decode": "kernel",
}


def plan_layers(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The layers each kind of plan acts on (empty lists for kinds the model lacks)."""
    found: dict[str, list[nn.Module]] = {kind: [] for kind in OPTIONS}
    head = getattr(model, "head", None)
    for module in model.modules():
        if isinstance(module, parallel.TransposedLinear):
            found["halves"].append(module)
        elif isinstance(module, parallel.CPULinear):
            found["cut"].append(module)
        elif isinstance(module, quantized.CPUQuantizedLinear):
            found["quantized"].append(module)
        if getattr(module, "cpu_fused", (None, 1))[1] == 0:  # the first of its siblings
            found["fuse"].append(module)
    if (
        head is not None
        and "scales" not in head
        and head["weight"].shape[0] > 2 * parallel.HEAD_CHUNK
    ):
        found["head"].append(head)
    elif head is not None and "scales" in head and not isinstance(head, nn.QuantizedLinear):
        found["quantized"].append(head)  # a quantized tied embedding, by parts
    if compiled.loaded() is not None:
        float_kinds = (parallel.CPULinear, parallel.PaddedLinear, parallel.TransposedLinear)
        found["matvec"] = [
            m
            for m in model.modules()
            if m is not head and isinstance(m, float_kinds) and compiled.float_fits(_weight(m))
        ]
        found["decode"] = [
            m
            for m in model.modules()
            if isinstance(
                m,
                (
                    model_layers.RMSNorm,
                    model_layers.Attention,
                    model_layers.GatedMLP,
                    blocks.CPUDecodeBlock,
                ),
            )
        ]
        if found["matvec"] or any(
            kernel_fits(kind, m) for kind in ("head", "quantized") for m in found[kind]
        ):
            found["kernel_threads"] = [model]  # the pool is the process's, not a layer's
        if compiled.int16_decode_fits(model):
            found["int16_decode"] = [model]  # the kernels' setting, as their threads
    return found


def _weight(layer: nn.Module) -> mx.array:
    return layer["weight"] if "weight" in layer else layer["weight_t"]


def kernel_fits(kind: str, layer: nn.Module) -> bool:
    """Whether the compiled kernels compute ``layer``'s products (of a kind with a ``kernel``
    option)."""
    if kind == "quantized":
        return compiled.quantized_fits(layer)
    if kind == "decode":
        return True  # plan_layers lists only the layers the kernels compute
    return kind in ("head", "matvec") and compiled.float_fits(_weight(layer))


def options_of(model: nn.Module, kind: str, found: dict | None = None) -> tuple[str, ...]:
    """The options of ``kind`` timed on this model: ``kernel`` only where the kernels are loaded
    and cover one of the kind's layers."""
    layers_of = (found or plan_layers(model))[kind]
    if "kernel" in OPTIONS[kind] and not (
        compiled.loaded() is not None and any(kernel_fits(kind, m) for m in layers_of)
    ):
        return tuple(o for o in OPTIONS[kind] if o != "kernel")
    return OPTIONS[kind]


def attention_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, model_layers.Attention)]


def quantized_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, quantized.CPUQuantizedLinear)]


def int16_linears(model: nn.Module) -> list[nn.Module]:
    """The quantized Linears whose many-row products the int16 kernel can take, and a quantized
    tied LM head it can take (its prompt positions' logits: ``perplexity``)."""
    found = [m for m in quantized_linears(model) if compiled.int16_fits(m)]
    head = getattr(model, "head", None)
    if isinstance(head, layers.CPUTiedHead) and "scales" in head and compiled.int16_fits(head):
        found.append(head)
    return found


def int16_heads(model: nn.Module) -> list[nn.Module]:
    """A quantized tied LM head whose few-row products (decode) the int16 kernel can take."""
    head = getattr(model, "head", None)
    if isinstance(head, layers.CPUTiedHead) and "scales" in head and compiled.int16_fits(head):
        return [head]
    return []


def exponential_users(model: nn.Module) -> list[nn.Module]:
    """The layers that choose between MLX's ops and the fast exponential (``ops.SMALL``)."""
    kinds = (model_layers.Attention, model_layers.GatedMLP)
    return [m for m in model.modules() if isinstance(m, kinds)]


def float_products(model: nn.Module) -> list[nn.Module]:
    """The float Linears, which may pad their products (a float LM head last): the head follows
    the threshold timed on the blocks' products (it is the same sgemm, taller)."""
    kinds = (parallel.CPULinear, parallel.PaddedLinear, parallel.TransposedLinear)
    head = getattr(model, "head", None)
    found = [
        m
        for m in model.modules()
        if m is not head
        and (
            isinstance(m, kinds)
            or (getattr(m, "cpu_fused", None) is not None and "scales" not in m)
        )
    ]
    if found and head is not None and "scales" not in head:
        found.append(head)
    return found


# Threshold kinds -> (the layers that read it, the attribute they read, its default). A layer
# without the attribute uses the default (the class's MIN_ROWS, the ops module's constants).
THRESHOLDS = {
    "long_keys": (attention_layers, "cpu_long_keys", ops.DECODE_LONG_KEYS),
    "dequantize_rows": (quantized_linears, "MIN_ROWS", quantized.CPUQuantizedLinear.MIN_ROWS),
    "int16_rows": (int16_linears, "cpu_int16_rows", quantized.INT16_NEVER),
    # (up to how many rows, not from how many: 0 never)
    "int16_head": (int16_heads, "cpu_int16_head_rows", 0),
    "small": (exponential_users, "cpu_small", ops.SMALL),
    "dequantized_attention": (
        attention_layers,
        "cpu_dequantized_attention_rows",
        ops.DEQUANTIZED_ATTENTION_ROWS,
    ),
    "pad_rows": (float_products, "cpu_pad_rows", ops.NO_PADDING),
}
NUMERIC = tuple(THRESHOLDS)  # kinds whose option is a threshold


def numeric_kinds(model: nn.Module) -> list[str]:
    """The threshold kinds that act on this model."""
    return [kind for kind, (layers_of, _, _) in THRESHOLDS.items() if layers_of(model)]


def set_plan(model: nn.Module, kind: str, option: str | int) -> None:
    """Set one kind of plan on every layer it acts on; outputs stay the same (up to rounding).
    The model keeps what was set, for :func:`current`."""
    if kind in THRESHOLDS:
        layers_of, attribute, _ = THRESHOLDS[kind]
        for module in layers_of(model):
            object.__setattr__(module, attribute, int(option))
    elif option not in OPTIONS[kind]:
        raise ValueError(
            f"MLXINFER_CPU_PLANS: '{kind}' takes one of {', '.join(OPTIONS[kind])}, not '{option}'"
        )
    else:
        for layer in plan_layers(model)[kind]:
            if kind == "fuse":
                layer.cpu_fused[0].on = option == "fused"
                continue
            if kind == "kernel_threads":
                compiled.set_threads(option)
                continue
            if kind == "int16_decode":
                compiled.set_int16_decode(option == "int16")
                continue
            if kind == "decode":
                object.__setattr__(layer, "cpu_decode_kernel", option == "kernel")
                norm, swiglu = compiled.decode_kernels(option == "kernel")
                object.__setattr__(layer, "cpu_rms_norm", norm)
                object.__setattr__(layer, "cpu_swiglu", swiglu)
                if isinstance(layer, model_layers.Attention):  # plain RoPE attention: fused
                    object.__setattr__(
                        layer, "cpu_decode_fits", attention_kernels.attention_fits(layer)
                    )
                continue
            plan = parallel.plan_of(layer)
            if "kernel" in OPTIONS[kind]:
                plan.kernel = option == "kernel" and kernel_fits(kind, layer)
                compiled.bind(layer)  # the decision, cached on the layer for its calls
            if kind == "matvec":  # the kernel reads (out, in); the MLP in halves (in, out)
                if isinstance(layer, parallel.TransposedLinear):
                    layer.hold_transposed(not plan.kernel)
                continue
            plan.two_streams = option not in ("one", "kernel")
            if kind == "quantized":
                parts = {"siblings": plan.sibling_parts, "balanced": plan.balanced_parts}
                plan.parts = parts.get(option)
    if getattr(model, "cpu_plans", None) is None:
        object.__setattr__(model, "cpu_plans", {})
    model.cpu_plans[kind] = option
    blocks.EPOCH += 1  # what the fused blocks read under the old plans is read again


def current(model: nn.Module) -> dict[str, str | int]:
    """The plans last set on the model, {kind: option} (empty if none was)."""
    return dict(getattr(model, "cpu_plans", None) or {})


def set_plans(model: nn.Module, plans: dict[str, str | int]) -> None:
    for kind, option in plans.items():
        set_plan(model, kind, option)
