"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): Qwen3's attention with routed
experts only.

Block: RMSNorm → GQA attention with a per-head q/k RMSNorm before RoPE (``attention_bias``
on all four projections, ``head_dim`` from the config) → residual → RMSNorm → MoE →
residual. The MoE is Qwen2-MoE's without the shared expert: softmax over ``num_experts``
router logits, the top ``num_experts_per_tok`` (renormalised when ``norm_topk_prob``),
through stacked experts on ``gather_qmm``. Layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` stride have a dense MLP.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from . import qwen2_moe
from .layers import RMSNorm, RopeAttention, activation
from .layers.moe import Gate, SwitchGLU, combine, softmax_top_k


@dataclasses.dataclass
class ModelArgs(qwen2_moe.ModelArgs):
    shared_expert_intermediate_size: int = 0
    head_dim: int = 0  # 0 or absent: qwen2_moe's hidden_size // num_attention_heads
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        # transformers 5 writes ``num_experts`` as ``num_local_experts``; the Hub's
        # checkpoints say ``num_experts``
        if "num_experts" not in config and "num_local_experts" in config:
            config = {**config, "num_experts": config["num_local_experts"]}
        return super().from_dict(config)

    def __post_init__(self):
        head_dim = self.head_dim
        super().__post_init__()
        self.head_dim = head_dim or self.head_dim


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = Gate(args.hidden_size, args.num_experts)
        self.experts = SwitchGLU(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            activation(args.hidden_act),
        )

    def __call__(self, x: mx.array) -> mx.array:
        weights, idx = softmax_top_k(self.gate(x), self.top_k, normalize=self.norm_topk_prob)
        return combine(self.experts(x, idx), weights)  # (B, L, hidden)


class TransformerBlock(qwen2_moe.TransformerBlock):
    SparseMoE = SparseMoE

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
            qk_norm=lambda dim: RMSNorm(dim, eps=args.rms_norm_eps),
        )


class Qwen3MoeModel(qwen2_moe.Qwen2MoeModel):
    Block = TransformerBlock


class Model(qwen2_moe.Model):
    Inner = Qwen3MoeModel
