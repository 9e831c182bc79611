"""GLM-4.5 / GLM-4.6 (and the -Air models): GQA attention with partial RoPE, DeepSeek-V3's MoE.

Block: RMSNorm → attention → residual → RMSNorm → MLP → residual, where

- attention is Llama's GQA with biases on q, k and v (``attention_bias``; never on o),
  an optional per-head RMSNorm of queries and keys before RoPE (``use_qk_norm``, GLM-4.6),
  and RoPE on the first ``partial_rotary_factor`` (default 0.5) of each head only, in
  rotate-half pairs;
- the first ``first_k_dense_replace`` layers have a dense SwiGLU MLP, the rest DeepSeek-V3's
  MoE (deepseek_v2.DeepseekMoE): sigmoid router, experts chosen on score +
  ``e_score_correction_bias`` within the best ``topk_group`` of ``n_group`` groups, weights
  renormalised when ``norm_topk_prob`` and × ``routed_scaling_factor``, plus
  ``n_shared_experts`` always-on experts fused into one MLP.

Checkpoints append ``num_nextn_predict_layers`` multi-token-prediction layers after the last
decoder layer (``model.layers.N.{enorm, hnorm, eh_proj, shared_head.norm}`` + a decoder block,
always MoE; DeepSeek's [embedding, hidden] order: ``layers/mtp.py``). ``sanitize`` moves them to
``model.mtp_layers.i`` (their copies of the embedding and LM head go: the trunk's serve), and
stacks the per-expert weights (see moe.py). ``--mtp`` drafts with them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from ..errors import ConfigError
from . import qwen2, qwen2_moe
from .base import FULL_ATTENTION, BaseArgs
from .deepseek_v2 import EXPERT_NAMES, DeepseekMoE
from .layers import RMSNorm, RopeAttention
from .layers.moe import keep_routers_float, stack_experts
from .layers.mtp import DEEPSEEK, MTPHeads, extend_block, nextn_layers_as_heads


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    head_dim: int = 0  # 0 or absent: hidden_size // num_attention_heads (__post_init__)
    partial_rotary_factor: float = 0.5  # transformers' default for this family
    use_qk_norm: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rotary_dims = int(self.head_dim * self.partial_rotary_factor)
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ConfigError(
                f"config.json: 'n_group' must divide 'n_routed_experts' and 'topk_group' be "
                f"1..n_group (found n_routed_experts={self.n_routed_experts}, "
                f"n_group={self.n_group}, topk_group={self.topk_group})"
            )
        # No sliding window: every layer attends over the whole cache (Qwen2Model's typed masks).
        self.layer_types, self.sliding_window = [FULL_ATTENTION] * self.num_hidden_layers, None
        # What DeepseekMoE reads: V3's router, no biases in the shared experts.
        self.v3, self.mlp_bias = True, False

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


class DecoderLayer(qwen2_moe.TransformerBlock):
    """Qwen2-MoE's block with GLM's attention (q/k/v biases, optional q/k norm, partial RoPE)
    and DeepSeek-V3's MoE after the first ``first_k_dense_replace`` dense layers."""

    SparseMoE = DeepseekMoE

    @staticmethod
    def rotary_dims(args: ModelArgs) -> int:
        return args.rotary_dims  # the first rotary_dims features of each head; the rest pass

    @staticmethod
    def attention(args: ModelArgs, rope) -> RopeAttention:
        qk_norm = (lambda dim: RMSNorm(dim, eps=args.rms_norm_eps)) if args.use_qk_norm else None
        return RopeAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
            qkv_bias=args.attention_bias,
            qk_norm=qk_norm,
        )


class Glm4MoeModel(qwen2.Qwen2Model):
    Block = DecoderLayer

    def __init__(self, args):
        super().__init__(args)
        # The MTP heads' blocks: MoE whatever first_k_dense_replace says (as DeepSeek-V3's).
        n, first_sparse = args.num_hidden_layers, args.first_k_dense_replace
        self.mtp_layers = [
            extend_block(
                self.Block(args, max(n + i, first_sparse)),
                DEEPSEEK,
                args.hidden_size,
                args.rms_norm_eps,
            )
            for i in range(args.num_nextn_predict_layers)
        ]


class Model(MTPHeads, qwen2.Model):
    Inner = Glm4MoeModel
    mtp_spec = DEEPSEEK

    quant_predicate = staticmethod(keep_routers_float)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        weights = nextn_layers_as_heads(
            weights, args.num_hidden_layers, args.num_nextn_predict_layers
        )
        return stack_experts(qwen2.Model.sanitize(weights, args), EXPERT_NAMES)
