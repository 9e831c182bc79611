"""The Llama family: llama, mistral, and SmolLM-style configs.

Pre-norm decoder blocks: RMSNorm → GQA attention with RoPE → residual →
RMSNorm → SwiGLU MLP → residual; a tied or separate LM head. Mistral is the
same network plus optional sliding-window attention (rotating caches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache
from .base import BaseArgs, CausalLM, causal_mask, per_layer
from .layers import GatedMLP, RMSNorm, RopeAttention, make_rope


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    head_dim: int = 0  # 0 or absent: hidden_size // num_attention_heads (__post_init__)
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_traditional: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.model_type == "llama":
            self.sliding_window = None  # llama configs may carry the key, unused by HF


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        rope = make_rope(
            args.head_dim,
            args.rope_theta,
            args.rope_scaling,
            args.max_position_embeddings,
            traditional=args.rope_traditional,
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
        self.mlp: nn.Module = GatedMLP(
            args.hidden_size, args.intermediate_size, nn.silu, bias=args.mlp_bias
        )  # SwiGLU
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding → blocks → final norm. A family whose blocks differ (e.g. MoE
    MLPs) subclasses this and sets ``Block``."""

    Block: Callable[..., nn.Module] = TransformerBlock  # (args) -> a block

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.Block(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def embed(self, inputs: mx.array) -> mx.array:
        return self.embed_tokens(inputs)  # (B, L, hidden)

    def __call__(
        self, inputs: mx.array, cache: list[Cache] | None = None, *, embeds: mx.array | None = None
    ) -> mx.array:
        # embeds (B, L, hidden): given instead of the ids' (an image-text model's merged inputs)
        h = self.embed(inputs) if embeds is None else embeds
        L = h.shape[1]
        if cache is None:
            mask = causal_mask(L, window=self.args.sliding_window)
        else:
            mask = cache[0].make_mask(L)
        for layer, c in zip(self.layers, per_layer(cache, len(self.layers))):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(CausalLM):
    """The causal LM: ``Inner`` (a :class:`LlamaModel`) plus a tied or separate head."""

    Inner: type[nn.Module] = LlamaModel
