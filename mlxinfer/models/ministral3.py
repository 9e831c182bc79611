"""Ministral 3 (the text model of the Ministral-3 3B, 8B and 14B checkpoints): Mistral's network
with Llama 4's position-dependent query scaling.

Each query at position p is multiplied by ``1 + β · log(1 + ⌊p / original_max⌋)``, with
β = ``llama_4_scaling_beta`` and ``original_max_position_embeddings`` from the RoPE parameters
(YaRN, as the checkpoints ship): 1 inside the original context, growing slowly past it, so
attention stays sharp over long contexts. Without a β the network is Mistral's.

Multimodal ``mistral3`` checkpoints with a ``ministral3`` text model run here too (config.py).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..errors import ConfigError
from . import llama
from .base import positions
from .layers import RopeAttention


@dataclasses.dataclass
class ModelArgs(llama.ModelArgs):
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        scaling = self.rope_scaling or {}
        self.llama_4_scaling_beta = scaling.get("llama_4_scaling_beta")
        self.original_max_position_embeddings = scaling.get("original_max_position_embeddings")
        if self.llama_4_scaling_beta and not self.original_max_position_embeddings:
            raise ConfigError(
                "config.json: rope_parameters 'llama_4_scaling_beta' needs "
                "'original_max_position_embeddings' (expected a positive int, found "
                f"{self.original_max_position_embeddings!r})"
            )


class Ministral3Attention(RopeAttention):
    def __init__(self, args: ModelArgs, rope):
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
        )
        self.beta, self.original_max = (
            args.llama_4_scaling_beta,
            args.original_max_position_embeddings,
        )

    def rotate(self, q: mx.array, k: mx.array, offset) -> tuple[mx.array, mx.array]:
        q, k = super().rotate(q, k, offset)
        p = positions(offset, q.shape[2]).astype(mx.float32)  # (L,) or a batch's (B, L)
        scale = 1 + self.beta * mx.log(1 + mx.floor(p / self.original_max))
        # (L, 1) against (B, heads, L, head_dim); a batch's (B, L) as (B, 1, L, 1)
        scale = scale[:, None, :, None] if scale.ndim == 2 else scale[:, None]
        return q * scale.astype(q.dtype), k


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.llama_4_scaling_beta:
            self.self_attn = Ministral3Attention(args, self.self_attn.rope)


class Ministral3Model(llama.LlamaModel):
    Block = TransformerBlock


class Model(llama.Model):
    Inner = Ministral3Model
