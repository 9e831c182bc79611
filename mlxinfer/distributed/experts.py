"""Tensor parallelism's feed-forward side: a gated MLP's and a mixture of experts' hidden units.

Rank r of s keeps hidden units ``[r·I/s, (r+1)·I/s)``: rows of ``gate_proj`` and ``up_proj``,
the same columns of ``down_proj``. A mixture of experts is split the same way *inside every
expert*: rows of each expert's gate and up (cut apart in the stacked ``gate_up_proj`` (E, 2I,
H), whose gate rows come before its up rows) and columns of each expert's ``down_proj``
(E, H, I). The router stays whole on every rank; its input (the residual stream, after the
attention's all-sum) is the same on every rank (the ring backend's all-sum reduces each
segment on one rank and copies it to the others: the same bits everywhere), so every rank
picks the same experts with the same weights, and the layer's output

    Σ_k w_k · down_k(act(gate_k x) · up_k x) = Σ_r Σ_k w_k · down_k[:, I_r](act(gate_k[I_r] x) · up_k[I_r] x)

is a sum over the ranks' shares, which ``tensor.Summed`` adds (``all_sum``) before the
residual. Shared experts are dense gated MLPs and split as one, whether added (DeepSeek,
GLM-4.5) or times a whole per-token scalar gate (Qwen2-MoE's ``shared_expert_gate``). A bias
of a down projection stays on rank 0 only, so it is added once.

Why not experts partitioned by index (rank r holding experts ``[r·E/s, (r+1)·E/s)``): it is as
exact, but a token's k experts would often sit on one rank, which then does all of that
token's work while the others wait; a share of every expert gives every rank the same work
for any routing, and needs only ``I % s == 0`` (the expert count may be anything).

What counts as a mixture of experts is read from the module, not from its family: its
children are a router (``Gate``), the routed experts (``SwitchGLU``, float), and optionally
dense shared experts (``GatedMLP``) and one-output gates (``nn.Linear`` to width 1). Every MoE
of ``mlxinfer/models`` is ``combine(experts(x, idx), weights)`` plus its shared experts, linear
in each expert's down projection (``tests/distributed/test_distributed_experts.py`` checks the shares' sum
against the whole layer for each). Anything else in such a block makes it run as a pipeline.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..models.layers.mlp import GatedMLP
from ..models.layers.moe import Gate, SwitchGLU


# The shares are copied (``mx.contiguous``): a slice is a view that would keep the whole
# tensor it was cut from alive.
def rows(w: mx.array, r: int, s: int) -> mx.array:
    n = w.shape[0] // s
    return mx.contiguous(w[r * n : (r + 1) * n])


def cols(w: mx.array, r: int, s: int) -> mx.array:
    n = w.shape[-1] // s
    return mx.contiguous(w[..., r * n : (r + 1) * n])


QUANTIZED = ("scales", "biases")  # a quantized layer's arrays beside its packed weight


def split_linears(outputs: list[nn.Linear], final: nn.Linear, r: int, s: int) -> None:
    """Rank r's rows of ``outputs`` (weights and biases), its columns of ``final``; the bias
    of ``final`` on rank 0 only. A quantized layer's scales and biases (per group of inputs)
    split with its packed weight: rows alike, columns at a group boundary (checked by
    ``placement.quantized_split_reason``)."""
    for linear in outputs:
        for key in ("weight", "bias", *QUANTIZED):
            if key in linear:
                linear[key] = rows(linear[key], r, s)
    for key in ("weight", *QUANTIZED):
        if key in final:
            final[key] = cols(final[key], r, s)
    if "bias" in final and r != 0:
        final.bias = mx.zeros_like(final.bias)


def split_fused_rows(linear: nn.Linear, parts: list[int], r: int, s: int) -> None:
    """Rank r's rows of each of the ``parts`` (row counts, in order) of one fused ``linear``
    (Phi-3's ``qkv_proj``: q, k, v; its ``gate_up_proj``: gate, up), put together again."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    for key in ("weight", "bias", *QUANTIZED):
        if key in linear:
            shares = [
                linear[key][a + r * (n // s) : a + (r + 1) * (n // s)]
                for a, n in zip(starts, parts)
            ]
            linear[key] = mx.contiguous(mx.concatenate(shares))


def is_fused_gated_mlp(module: nn.Module) -> bool:
    """A gated MLP whose gate and up are the two halves of one ``gate_up_proj`` (Phi-3), beside
    a ``down_proj``, and nothing else that holds weights."""
    children = module.children()
    linears = ("gate_up_proj", "down_proj")
    if not all(isinstance(children.get(k), (nn.Linear, nn.QuantizedLinear)) for k in linears):
        return False
    others = [v for k, v in children.items() if k not in linears]
    return not any(isinstance(v, nn.Module) and tree_flatten(v.parameters()) for v in others)


def split_gated_mlp(mlp: nn.Module, r: int, s: int) -> None:
    """Rank r's share of a gated MLP's hidden units (separate gate and up, or fused)."""
    if is_fused_gated_mlp(mlp):
        hidden = mlp.gate_up_proj.weight.shape[0] // 2
        split_fused_rows(mlp.gate_up_proj, [hidden, hidden], r, s)
        split_linears([], mlp.down_proj, r, s)
        return
    split_linears([mlp.gate_proj, mlp.up_proj], mlp.down_proj, r, s)


def split_switch_glu(experts: SwitchGLU, r: int, s: int) -> None:
    """Rank r's share of every expert's hidden units."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    hidden = gate_up.weight.shape[1] // 2  # (E, 2I, H): [gate; up]
    n = hidden // s
    gate, up = slice(r * n, (r + 1) * n), slice(hidden + r * n, hidden + (r + 1) * n)
    # (E, 2I, H) weights, or quantized: packed (E, 2I, H·bits/32), scales and biases
    # (E, 2I, H/group); a bias (E, 2I). Each cut along the hidden units, axis 1.
    for key in ("weight", "bias", *QUANTIZED):
        if key in gate_up:
            w = gate_up[key]
            gate_up[key] = mx.contiguous(mx.concatenate([w[:, gate], w[:, up]], axis=1))
    for key in ("weight", *QUANTIZED):  # (E, H, I/s): at a group boundary when quantized
        if key in down:
            down[key] = cols(down[key], r, s)
    if "bias" in down and r != 0:  # (E, H): each routed expert's, added once
        down.bias = mx.zeros_like(down.bias)


def _kind(child: nn.Module) -> str | None:
    """The part of a mixture of experts ``child`` is ("router", "experts", "shared",
    "scalar gate"), or None."""
    if isinstance(child, Gate):
        return "router"
    if isinstance(child, SwitchGLU):
        return "experts"
    if type(child) is GatedMLP:
        return "shared"
    if type(child) is nn.Linear and child.weight.shape[0] == 1:
        return "scalar gate"
    return None


def is_moe(module: nn.Module) -> bool:
    """Whether ``module`` is a mixture of experts this split applies to (see above)."""
    parts = [_kind(c) for c in module.children().values()]  # a list of modules: None
    return parts.count("router") == 1 and parts.count("experts") == 1 and None not in parts


def moe_split_reason(moe: nn.Module, size: int) -> str | None:
    """Why ``moe`` (``is_moe``) cannot be split over ``size`` ranks; None: it can."""
    for name, child in moe.children().items():
        kind = _kind(child)
        if kind == "experts":
            count, what = child.down_proj.weight.shape[-1], "hidden units of each expert"
        elif kind == "shared":
            count, what = child.gate_proj.weight.shape[0], f"hidden units of '{name}'"
        else:
            continue
        if count % size:
            return f"{count} {what} do not divide over {size} ranks"
    return None


def split_moe(moe: nn.Module, r: int, s: int) -> None:
    """Rank r's share of every routed and shared expert; routers and scalar gates stay whole."""
    for child in moe.children().values():
        kind = _kind(child)
        if kind == "experts":
            split_switch_glu(child, r, s)
        elif kind == "shared":
            split_gated_mlp(child, r, s)


def expert_share(model: nn.Module, r: int, s: int) -> str:
    """`` and hidden units a-b of I of each layer's E experts``, for the log line (before the
    split); empty for a model without experts."""
    for layer in model.layers:
        for child in layer.children().values():
            if is_moe(child):
                experts = next(c for c in child.children().values() if _kind(c) == "experts")
                count, hidden = (
                    experts.down_proj.weight.shape[0],
                    experts.down_proj.weight.shape[-1],
                )
                n = hidden // s
                return (
                    f" and hidden units {r * n}-{(r + 1) * n - 1} of {hidden} of each layer's "
                    f"{count} experts"
                )
    return ""
