"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention with routed experts plus a shared expert.

Block: RMSNorm → GQA attention with RoPE and q/k/v biases → residual → RMSNorm →
MoE → residual. The MoE takes the softmax over ``num_experts`` router logits,
keeps the top ``num_experts_per_tok`` (renormalised only when
``norm_topk_prob``), and adds a shared SwiGLU expert on every token, scaled by
``sigmoid(shared_expert_gate(x))``. Layers listed in ``mlp_only_layers``, or
not on the ``decoder_sparse_step`` stride, have a dense MLP instead.

Per-expert checkpoint weights are stacked by ``sanitize`` (see moe.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache
from . import qwen2
from .base import FULL_ATTENTION, SLIDING_ATTENTION, BaseArgs, check_layer_types
from .layers import GatedMLP, RMSNorm, RopeAttention, activation, make_rope
from .layers.moe import Gate, SwitchGLU, combine, keep_routers_float, softmax_top_k, stack_experts

EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    qkv_bias: bool = True
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.use_sliding_window:
            self.sliding_window = None
        if (
            self.layer_types is None
        ):  # configs older than transformers 5: its rule (odd-numbered early layers)
            self.layer_types = [
                SLIDING_ATTENTION
                if self.sliding_window and (i + 1) % 2 and i < self.max_window_layers
                else FULL_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if SLIDING_ATTENTION not in self.layer_types:
            self.sliding_window = None

    def is_sparse(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        act = activation(args.hidden_act)
        self.gate = Gate(args.hidden_size, args.num_experts)
        self.experts = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, act
        )
        self.shared_expert = GatedMLP(args.hidden_size, args.shared_expert_intermediate_size, act)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        weights, idx = softmax_top_k(
            self.gate(x), self.top_k, normalize=self.norm_topk_prob
        )  # (B, L, k)
        routed = combine(self.experts(x, idx), weights)  # (B, L, hidden)
        return routed + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class TransformerBlock(nn.Module):
    """A family that differs in its attention, its rotated width or its MoE overrides
    :meth:`attention`, :meth:`rotary_dims` or ``SparseMoE`` (qwen3_moe, gpt_oss, glm4_moe);
    ``args.is_sparse(layer)`` says which layers route."""

    SparseMoE: Callable[..., nn.Module] = SparseMoE  # (args) -> the routed MLP

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        rope = make_rope(
            self.rotary_dims(args), args.rope_theta, args.rope_scaling, args.max_position_embeddings
        )
        self.self_attn = self.attention(args, rope)
        if args.is_sparse(layer):
            self.mlp = self.SparseMoE(args)
        else:
            self.mlp = GatedMLP(
                args.hidden_size, args.intermediate_size, activation(args.hidden_act)
            )
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    # The hooks take Any: a family that overrides one passes its own ModelArgs (glm4_moe's is
    # no subclass of this one).
    @staticmethod
    def rotary_dims(args: Any) -> int:
        """How many features of each head RoPE rotates."""
        return args.head_dim

    @staticmethod
    def attention(args: Any, rope) -> RopeAttention:
        return RopeAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
            qkv_bias=args.qkv_bias,
        )

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2MoeModel(qwen2.Qwen2Model):
    Block = TransformerBlock


class Model(qwen2.Model):
    Inner = Qwen2MoeModel

    quant_predicate = staticmethod(keep_routers_float)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        return stack_experts(qwen2.Model.sanitize(weights, args), EXPERT_NAMES)
