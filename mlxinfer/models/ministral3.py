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

from ..cache import Cache
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

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        # The queries' scale depends on their positions, known here (the cache's offset
        # before this step); project() applies it. Scaling before RoPE equals scaling after:
        # the rotation is linear and the scale one number per position.
        offset = cache.offset if cache is not None else 0
        p = positions(offset, x.shape[1]).astype(mx.float32)  # (L,) or a batch's (B, L)
        scale = 1 + self.beta * mx.log(1 + mx.floor(p / self.original_max))
        self._query_scale = scale[..., None]  # (…, L, 1) against (B, L, n_heads * head_dim)
        return super().__call__(x, mask, cache)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project(x)
        return q * self._query_scale.astype(q.dtype), k, v


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.llama_4_scaling_beta:
            self.self_attn = Ministral3Attention(args, self.self_attn.rope)


class Ministral3Model(llama.LlamaModel):
    Block = TransformerBlock


class Model(llama.Model):
    Inner = Ministral3Model
