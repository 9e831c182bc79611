"""The Gemma family (first generation); its pieces serve gemma2 and gemma3_text too.

Llama's pre-norm decoder with four differences:

- RMSNorm weights are stored as offsets from 1: ``x / rms(x) * (1 + w)``;
- the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
- embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the
  embedding dtype first as transformers does;
- the LM head is the embedding (``tie_word_embeddings``, true for every release).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache
from ..errors import ConfigError
from .base import BaseArgs, CausalLM, causal_mask, per_layer, scaled_embedding
from .layers import GatedMLP, OffsetRMSNorm, RopeAttention, activation, make_rope


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    head_dim: int = 256
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    use_bidirectional_attention: bool | None = None

    def __post_init__(self):
        if self.use_bidirectional_attention:
            raise ConfigError(
                "config.json: 'use_bidirectional_attention' is true (an embedding model such as "
                "EmbeddingGemma); only causal text generation is supported"
            )
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        # Early Gemma configs say "gelu" but mean the tanh approximation (transformers remaps it too).
        self.activation = "gelu_pytorch_tanh" if self.hidden_act == "gelu" else self.hidden_act


class DecoderLayer(nn.Module):
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
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation(args.activation))
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class GemmaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        h = scaled_embedding(
            self.embed_tokens(inputs), math.sqrt(self.args.hidden_size)
        )  # (B, L, hidden)
        L = inputs.shape[1]
        mask = causal_mask(L) if cache is None else cache[0].make_mask(L)
        for layer, c in zip(self.layers, per_layer(cache, len(self.layers))):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(CausalLM):
    Inner = GemmaModel
