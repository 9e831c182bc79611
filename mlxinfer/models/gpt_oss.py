"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention sinks, alternating windows, clamped-SwiGLU experts.

Block: RMSNorm → GQA attention → residual → RMSNorm → MoE → residual, with:

- attention: biases on all four projections, YaRN RoPE, and a learned *sink* logit per
  head that joins each softmax without a value (so a head may attend to nothing);
  ``layer_types`` alternate sliding-window (``sliding_window`` keys) and full layers;
- MoE: a router with a bias, the top ``num_experts_per_tok`` logits softmaxed among
  themselves, experts with biases and a clamped SwiGLU:
  ``(clip(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.

Checkpoints store the experts fused and transposed (``gate_up_proj`` (E, H, 2I) with gate
and up interleaved along 2I), or as the Hub ships them, MXFP4 (``*_blocks`` of FP4 pairs
and ``*_scales`` of uint8 exponents, one per 32 inputs): those load straight into MLX's
``mxfp4`` quantization, without a float round trip (``sanitize``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import qwen2, qwen2_moe
from .base import FULL_ATTENTION, SLIDING_ATTENTION, BaseArgs, check_layer_types
from .layers import RopeAttention
from .layers.moe import Gate, SwitchGLU, combine, keep_routers_float, top_k_softmax

# transformers' default when a config names no RoPE at all
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_local_experts: int
    num_experts_per_tok: int = 4
    head_dim: int = 64
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    sliding_window: int | None = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    layer_types: list[str] | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        if (
            "rope_scaling" not in config
        ):  # no RoPE settings at all (config.py keeps an explicit null)
            config = {**config, "rope_scaling": DEFAULT_ROPE}
        args = super().from_dict(config)
        if config.get("sliding_window", 0) is None:
            args.sliding_window = None
            args.__post_init__()
        return args

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.layer_types is None:  # transformers' default: even layers slide
            self.layer_types = [
                SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.sliding_window is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        if SLIDING_ATTENTION not in self.layer_types:
            self.sliding_window = None

    def is_sparse(self, layer: int) -> bool:
        return True  # every layer routes


class Experts(SwitchGLU):
    """Routed experts with biases and gpt-oss's clamped SwiGLU."""

    def __init__(self, args: ModelArgs):
        super().__init__(
            args.hidden_size, args.intermediate_size, args.num_local_experts, bias=True
        )
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit

    def combine(self, gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, self.limit)
        up = mx.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * mx.sigmoid(gate * self.alpha))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = Gate(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = Experts(args)

    def __call__(self, x: mx.array) -> mx.array:
        weights, idx = top_k_softmax(self.router(x), self.top_k)  # (B, L, k) each
        return combine(self.experts(x, idx), weights)  # (B, L, hidden)


class TransformerBlock(qwen2_moe.TransformerBlock):
    """Qwen2-MoE's block with gpt-oss's attention (biases, sinks) and MoE in every layer."""

    SparseMoE = MLP

    @staticmethod
    def attention(args: ModelArgs, rope) -> RopeAttention:
        return RopeAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            sinks=True,
        )


class GptOssModel(qwen2.Qwen2Model):
    Block = TransformerBlock


class Model(qwen2.Model):
    """Qwen2's shell: caches and masks follow each layer's type."""

    Inner = GptOssModel

    quant_predicate = staticmethod(keep_routers_float)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        out = {}
        for key, value in qwen2.Model.sanitize(weights, args).items():
            if ".mlp.experts." not in key:
                out[key] = value
                continue
            prefix, name = key.rsplit(".", 1)
            out.update(_expert_weights(prefix, name, value))
        return out


def _deinterleave(w: mx.array, axis: int) -> mx.array:
    """gate_up rows interleaved [g0, u0, g1, u1, …] along ``axis`` -> [gate; up] halves."""
    n = w.shape[axis]
    order = mx.concatenate([mx.arange(0, n, 2), mx.arange(1, n, 2)])
    return mx.take(w, order, axis=axis)


def _expert_weights(prefix: str, name: str, value: mx.array) -> dict[str, mx.array]:
    """One checkpoint tensor of ``<prefix>`` (``….mlp.experts``) in our layout: SwitchLinear's
    (E, out, in) ``weight`` and (E, out) ``bias``, gate rows before up rows; MXFP4 blocks as
    MLX's packed ``mxfp4`` weight (the same FP4 codes, low nibble first) and uint8 ``scales``."""
    gate_up = name.startswith("gate_up_proj")
    proj = "gate_up_proj" if gate_up else "down_proj"
    target = f"{prefix}.{proj}"
    if name in ("gate_up_proj", "down_proj"):  # float, (E, in, out)
        value = value.swapaxes(-1, -2)
        return {f"{target}.weight": _deinterleave(value, 1) if gate_up else value}
    if name.endswith("_bias"):  # (E, out)
        return {f"{target}.bias": _deinterleave(value, 1) if gate_up else value}
    if name.endswith("_blocks"):  # (E, out, in / 32, 16) bytes: 32 FP4 codes per group
        E, rows, groups, n_bytes = value.shape
        value = value.reshape(E, rows, groups * n_bytes).view(mx.uint32)  # (E, out, in / 8)
        return {f"{target}.weight": _deinterleave(value, 1) if gate_up else value}
    if name.endswith("_scales"):  # (E, out, in / 32) uint8 exponents, bias 127: E8M0 as MLX's
        return {f"{target}.scales": _deinterleave(value, 1) if gate_up else value}
    if name in ("weight", "bias", "scales", "biases"):  # already ours (a converted checkpoint)
        return {f"{prefix}.{name}": value}
    raise ValueError(f"{prefix}.{name}: not a gpt-oss expert tensor")
