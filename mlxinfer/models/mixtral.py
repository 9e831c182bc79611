"""Mixtral: Mistral's decoder with a routed mixture of SwiGLU experts in place of the MLP.

Block: RMSNorm → GQA attention with RoPE (optionally sliding-window) → residual →
RMSNorm → sparse MoE → residual. The router takes the softmax over all
``num_local_experts``, keeps the top ``num_experts_per_tok`` and renormalises
them to sum 1; the token's output is the weighted sum of those experts.

Checkpoints name the MoE ``block_sparse_moe`` with per-expert ``w1`` (gate),
``w3`` (up) and ``w2`` (down); transformers 5 renames it ``mlp`` and fuses the
experts. ``sanitize`` does the same (see moe.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache
from . import llama
from .base import BaseArgs
from .layers import RMSNorm, RopeAttention, activation, make_rope
from .layers.moe import Gate, SwitchGLU, combine, keep_routers_float, softmax_top_k, stack_experts

EXPERT_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    head_dim: int = 0  # 0 or absent: hidden_size // num_attention_heads (__post_init__)
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = Gate(args.hidden_size, args.num_local_experts)
        self.experts = SwitchGLU(
            args.hidden_size,
            args.intermediate_size,
            args.num_local_experts,
            activation(args.hidden_act),
        )

    def __call__(self, x: mx.array) -> mx.array:
        weights, idx = softmax_top_k(self.gate(x), self.top_k, normalize=True)  # (B, L, k) each
        return combine(self.experts(x, idx), weights)  # (B, L, hidden)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        rope = make_rope(
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings
        )
        self.self_attn = RopeAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
        )
        self.mlp = SparseMoE(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MixtralModel(llama.LlamaModel):
    Block = TransformerBlock


class Model(llama.Model):
    Inner = MixtralModel

    quant_predicate = staticmethod(keep_routers_float)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        weights = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in weights.items()}
        return stack_experts(llama.Model.sanitize(weights, args), EXPERT_NAMES)
