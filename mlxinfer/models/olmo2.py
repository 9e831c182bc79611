"""OLMo 2 (AllenAI): Llama's projections and SwiGLU with the norms moved.

- each block normalises its sublayers' outputs, not their inputs:
  ``h = x + norm(attn(x))``, ``out = h + norm(mlp(h))``;
- an RMSNorm over the whole query and the whole key projection (all heads at once),
  before they are split into heads and rotated.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..cache.kv import Cache
from . import llama
from .layers import RMSNorm, RopeAttention


@dataclasses.dataclass
class ModelArgs(llama.ModelArgs):
    rms_norm_eps: float = 1e-5


class Olmo2Attention(RopeAttention):
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
        eps = args.rms_norm_eps
        self.q_norm = RMSNorm(args.num_attention_heads * args.head_dim, eps=eps)
        self.k_norm = RMSNorm(args.num_key_value_heads * args.head_dim, eps=eps)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.self_attn = Olmo2Attention(args, self.self_attn.rope)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(x, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2Model(llama.LlamaModel):
    Block = TransformerBlock


class Model(llama.Model):
    Inner = Olmo2Model
