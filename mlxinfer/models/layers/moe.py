"""Routed experts: stacked expert weights, top-k routing, and the checkpoint fix-up.

A mixture-of-experts layer keeps all experts of one projection in a single
(n_experts, out, in) tensor and multiplies each token only by the experts its
router picked, with ``mx.gather_mm`` (float) or ``mx.gather_qmm`` (quantized):
only the rows of the routed experts are read, and 4-bit experts are never
dequantized as a whole.

Routing follows transformers 5 for each family (see the functions below);
the experts' outputs are summed with the routing weights.

Checkpoints store the experts two ways, both handled by :func:`stack_experts`:
per expert (``experts.3.w1.weight`` Mixtral, ``experts.3.gate_proj.weight``
Qwen2-MoE/DeepSeek — what transformers 5 still writes) or fused 3-D
(``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj`` (E, H, I) —
transformers 5's in-memory form). Ours is the fused form plus ``.weight``:
``experts.gate_up_proj.weight`` and ``experts.down_proj.weight``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

# Below this many (token, expert) pairs, sorting tokens by expert costs more than it saves.
_SORT_THRESHOLD = 64


def _add_bias(module: nn.Module, y: mx.array, indices: mx.array) -> mx.array:
    """``y`` (..., 1, out) plus each routed expert's bias row (gpt-oss), if the layer has one."""
    if "bias" not in module:
        return y
    return y + mx.expand_dims(module["bias"][indices], -2)  # bias[indices]: (..., out)


class SwitchLinear(nn.Module):
    """``num_experts`` Linear layers stacked as one (num_experts, out, in) weight, and with
    ``bias`` one (num_experts, out) bias."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = in_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        # x (..., 1, in) with batch dims broadcast against indices (...) -> (..., 1, out)
        y = mx.gather_mm(
            x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
        )
        return _add_bias(self, y, indices)

    def to_quantized(
        self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_
    ) -> "QuantizedSwitchLinear":
        """Called by ``nn.quantize`` (quant.py's transform and its re-application on load)."""
        return QuantizedSwitchLinear.from_switch_linear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """:class:`SwitchLinear` with quantized experts, multiplied with ``mx.gather_qmm``.

    ``mode`` "affine" (a scale and a bias per group) or "mxfp4" (gpt-oss's checkpoints: FP4
    values with one power-of-two uint8 scale per 32, no quantization biases).
    """

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        num_experts: int,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
        bias: bool = False,
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        # Placeholders of the stored shapes (lazy zeros: loading replaces them).
        self.weight = mx.zeros((num_experts, out_dims, in_dims * bits // 32), mx.uint32)
        groups = (num_experts, out_dims, in_dims // group_size)
        if mode == "affine":
            self.scales, self.biases = mx.zeros(groups), mx.zeros(groups)
        else:
            self.scales = mx.zeros(groups, mx.uint8)
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        return _add_bias(self, y, indices)

    @classmethod
    def from_switch_linear(
        cls, layer: SwitchLinear, group_size: int, bits: int, mode: str = "affine"
    ) -> "QuantizedSwitchLinear":
        num_experts, out_dims, in_dims = layer.weight.shape
        q = cls(in_dims, out_dims, num_experts, group_size, bits, mode, bias="bias" in layer)
        q.weight, q.scales, *biases = mx.quantize(layer.weight, group_size, bits, mode=mode)
        if biases:  # affine only
            q.biases = biases[0]
        if "bias" in layer:
            q.bias = layer.bias
        q.freeze()
        return q


class SwitchGLU(nn.Module):
    """Routed gated MLPs: ``down(act(gate(x)) * up(x))`` with each token's own top-k experts.

    ``gate_up_proj`` holds gate and up rows stacked ([gate; up] along the output
    dim, as transformers 5 fuses them), so a routed token needs two gathers.
    ``bias``: each expert's projections have biases (gpt-oss). A family whose gating
    differs overrides :meth:`combine`.
    """

    def __init__(
        self,
        dims: int,
        hidden: int,
        num_experts: int,
        act: Callable[[mx.array], mx.array] = nn.silu,
        bias: bool = False,
    ):
        super().__init__()
        self.gate_up_proj = SwitchLinear(dims, 2 * hidden, num_experts, bias=bias)
        self.down_proj = SwitchLinear(hidden, dims, num_experts, bias=bias)
        self.act = act

    def combine(self, gate: mx.array, up: mx.array) -> mx.array:
        return self.act(gate) * up

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (..., dims), indices (..., k) -> (..., k, dims): each routed expert's output, unweighted."""
        *lead, dims = x.shape
        k = indices.shape[-1]
        x = x.reshape(
            -1, 1, 1, dims
        )  # (N, 1, 1, dims): one row per token, broadcast over its k experts
        idx = indices.reshape(-1, k)  # (N, k)
        if idx.size >= _SORT_THRESHOLD:
            # Many tokens (prefill): group the (token, expert) pairs by expert so each
            # expert's weights are streamed once, then restore the order.
            flat = idx.flatten()
            order = mx.argsort(flat)
            x, idx = x.reshape(-1, 1, dims)[order // k], flat[order]  # (N*k, 1, dims), (N*k,)
            h = self._mlp(x, idx, sorted_indices=True)  # (N*k, 1, dims)
            h = h[mx.argsort(order)]
        else:
            h = self._mlp(x, idx)  # (N, k, 1, dims)
        return h.reshape(*lead, k, dims)

    def _mlp(self, x: mx.array, idx: mx.array, sorted_indices: bool = False) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x, idx, sorted_indices), 2, axis=-1)
        return self.down_proj(self.combine(gate, up), idx, sorted_indices)


class Gate(nn.Linear):
    """A router: logits over experts, (num_experts, hidden) as HF's ``mlp.gate.weight``.

    ``correction_bias`` adds DeepSeek-V3's ``e_score_correction_bias`` (E,), which
    shifts which experts are chosen but not their weights. Families keep gates
    out of quantization (their ``quant_predicate``): routing decisions are
    sensitive and the layer is tiny.
    """

    def __init__(
        self, dims: int, num_experts: int, correction_bias: bool = False, bias: bool = False
    ):
        super().__init__(dims, num_experts, bias=bias)
        if correction_bias:
            self.e_score_correction_bias = mx.zeros((num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        # Routing in float32, as transformers does, whatever the weights' dtype.
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # (..., num_experts)
        return logits + self.bias.astype(mx.float32) if "bias" in self else logits


# ---------------------------------------------------------------------------
# Routing: logits (..., E) -> (weights (..., k), indices (..., k))


def _top_k(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores along the last axis (in no particular order)."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def softmax_top_k(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Mixtral / Qwen2-MoE: softmax over all experts, keep the top k, optionally renormalise them to sum 1."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    idx = _top_k(probs, k)
    weights = mx.take_along_axis(probs, idx, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, idx


def top_k_softmax(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """gpt-oss: the k largest logits, and a softmax over those k only."""
    logits = logits.astype(mx.float32)
    idx = _top_k(logits, k)
    return mx.softmax(mx.take_along_axis(logits, idx, axis=-1), axis=-1, precise=True), idx


def _keep_top_groups(
    scores: mx.array, group_scores: mx.array, topk_group: int, fill: float
) -> mx.array:
    """Set the scores of every expert outside the ``topk_group`` best groups to ``fill``."""
    n_group = group_scores.shape[-1]
    if topk_group >= n_group:
        return scores
    *lead, E = scores.shape
    drop = mx.argpartition(group_scores, kth=n_group - topk_group - 1, axis=-1)[
        ..., : n_group - topk_group
    ]
    grouped = scores.reshape(*lead, n_group, E // n_group)  # (..., n_group, experts per group)
    grouped = mx.put_along_axis(grouped, drop[..., None], mx.array(fill, scores.dtype), axis=-2)
    return grouped.reshape(*lead, E)


def deepseek_v2_route(
    logits: mx.array,
    k: int,
    *,
    method: str,
    n_group: int | None,
    topk_group: int | None,
    scaling: float,
) -> tuple[mx.array, mx.array]:
    """DeepSeek-V2: softmax; ``greedy`` top-k, or ``group_limited_greedy`` (only experts in the
    ``topk_group`` groups with the highest best-expert score); weights × ``routed_scaling_factor``.

    transformers 5 does not renormalise here, whatever ``norm_topk_prob`` says (V2 and
    V2-Lite ship it false).
    """
    scores = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    choice = scores
    if method == "group_limited_greedy":
        assert n_group is not None and topk_group is not None  # this method's config gives both
        *lead, E = scores.shape
        group_best = scores.reshape(*lead, n_group, E // n_group).max(axis=-1)  # (..., n_group)
        choice = _keep_top_groups(scores, group_best, topk_group, 0.0)
    idx = _top_k(choice, k)
    return mx.take_along_axis(choice, idx, axis=-1) * scaling, idx


def deepseek_v3_route(
    logits: mx.array,
    k: int,
    *,
    correction_bias: mx.array,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[mx.array, mx.array]:
    """DeepSeek-V3: sigmoid scores; experts chosen on scores + ``e_score_correction_bias`` within the
    ``topk_group`` groups whose two best (biased) scores sum highest; weights are the unbiased scores,
    optionally renormalised, × ``routed_scaling_factor``."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + correction_bias.astype(mx.float32)
    *lead, E = choice.shape
    grouped = choice.reshape(*lead, n_group, E // n_group)
    group_top2 = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (..., n_group)
    choice = _keep_top_groups(choice, group_top2, topk_group, -float("inf"))
    idx = _top_k(choice, k)
    weights = mx.take_along_axis(scores, idx, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, idx


def combine(expert_out: mx.array, weights: mx.array) -> mx.array:
    """(..., k, dims) expert outputs, (..., k) weights -> (..., dims) weighted sum."""
    return (expert_out * weights[..., None].astype(expert_out.dtype)).sum(axis=-2)


# ---------------------------------------------------------------------------
# Checkpoint fix-up

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


def stack_experts(weights: dict[str, mx.array], names: dict[str, str]) -> dict[str, mx.array]:
    """Per-expert or fused-3-D expert weights -> ``<prefix>.gate_up_proj.weight`` (E, 2I, H) and
    ``<prefix>.down_proj.weight`` (E, H, I).

    ``names`` maps a checkpoint's per-expert projection names onto ``gate``,
    ``up`` and ``down`` (Mixtral: ``{"w1": "gate", "w3": "up", "w2": "down"}``).
    Already stacked weights pass through, so this is safe to run twice.
    """
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[str, dict[int, mx.array]]] = defaultdict(lambda: defaultdict(dict))
    for key, value in weights.items():
        m = _PER_EXPERT.match(key)
        if m and m["proj"] in names:
            experts[m["prefix"]][names[m["proj"]]][int(m["e"])] = value
        elif key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[f"{key}.weight"] = value  # transformers 5's fused parameters
        else:
            out[key] = value
    for prefix, parts in experts.items():
        stacked = {}
        for role in ("gate", "up", "down"):
            found = parts.get(role, {})
            if not found or sorted(found) != list(range(len(found))):
                raise ValueError(
                    f"{prefix}: expert '{role}' weights are missing or not numbered 0..n-1"
                )
            stacked[role] = mx.stack([found[e] for e in range(len(found))])
        out[f"{prefix}.gate_up_proj.weight"] = mx.concatenate(
            [stacked["gate"], stacked["up"]], axis=1
        )
        out[f"{prefix}.down_proj.weight"] = stacked["down"]
    return out


def keep_routers_float(path: str, module: nn.Module) -> bool:
    """A ``quant_predicate``: every layer except routers (``mlp.gate``, ``mlp.router``,
    ``mlp.shared_expert_gate``)."""
    return not path.endswith((".mlp.gate", ".mlp.router", ".shared_expert_gate"))
