"""The Llama family: llama, mistral, and SmolLM-style configs.

Pre-norm decoder blocks: RMSNorm → GQA attention with RoPE → residual →
RMSNorm → SwiGLU MLP → residual; a tied or separate LM head. Mistral is the
same network plus optional sliding-window attention (rotating caches).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache
from .base import BaseArgs, CausalLM, GatedMLP, RMSNorm, attention, causal_mask
from .rope import make_rope


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.rope = make_rope(self.head_dim, args.rope_theta, args.rope_scaling,
                              args.max_position_embeddings, traditional=args.rope_traditional)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        B, L, _ = x.shape
        # (B, L, n_heads * head_dim) -> (B, n_heads, L, head_dim)
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attention(q, k, v, scale=self.scale, mask=mask, cache=cache)  # (B, n_heads, L, head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, nn.silu, bias=args.mlp_bias)  # SwiGLU
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding → blocks → final norm. A family whose blocks differ (e.g. MoE
    MLPs) subclasses this and sets ``Block``."""

    Block = TransformerBlock

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.Block(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        L = inputs.shape[1]
        if cache is None:
            cache = [None] * len(self.layers)
            mask = causal_mask(L, window=self.args.sliding_window)
        else:
            mask = cache[0].make_mask(L)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(CausalLM):
    """The causal LM: ``Inner`` (a :class:`LlamaModel`) plus a tied or separate head."""

    Inner = LlamaModel
