"""The Qwen2 family: qwen2, and qwen3 (an alias plus the per-head q/k norm).

Llama's block (RMSNorm → GQA attention with RoPE → RMSNorm → SwiGLU) with:

- qwen2: biases on the q, k and v projections (none on o);
- qwen3: ``attention_bias`` on all four projections, and an RMSNorm over each
  head of the queries and keys before RoPE;
- both: optional sliding-window attention on some layers. transformers 5 writes
  the choice as ``layer_types``; older configs say ``use_sliding_window`` and
  ``max_window_layers`` (layers ``i >= max_window_layers`` slide), and
  ``sliding_window`` counts only when ``use_sliding_window`` is true.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, LayerCache
from . import llama
from .base import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    BaseArgs,
    check_layer_types,
    make_typed_caches,
    per_layer,
    typed_masks,
)
from .layers import GatedMLP, RMSNorm, RopeAttention, activation, make_rope


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
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not self.use_sliding_window:
            self.sliding_window = None
        if self.layer_types is None:
            self.layer_types = [
                SLIDING_ATTENTION
                if self.sliding_window is not None and i >= self.max_window_layers
                else FULL_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if SLIDING_ATTENTION not in self.layer_types:
            self.sliding_window = None
        self.qk_norm = self.model_type == "qwen3"
        # Qwen2 hard-codes q/k/v biases; Qwen3 follows attention_bias everywhere.
        self.qkv_bias = self.attention_bias or self.model_type == "qwen2"
        self.o_bias = self.attention_bias and self.model_type != "qwen2"


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):  # index used by MoE subclasses
        super().__init__()
        rope = make_rope(
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings
        )
        qk_norm = (lambda dim: RMSNorm(dim, eps=args.rms_norm_eps)) if args.qk_norm else None
        self.self_attn = RopeAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm=qk_norm,
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    """Embedding → blocks (each on its layer type's mask) → norm; subclasses set ``Block``."""

    Block: Callable[..., nn.Module] = TransformerBlock  # (args, layer) -> a block

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.Block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        kinds = self.args.layer_types
        assert kinds is not None  # derived by ModelArgs.__post_init__
        masks = typed_masks(kinds, cache, inputs.shape[1], self.args.sliding_window)
        for layer, kind, c in zip(self.layers, kinds, per_layer(cache, len(self.layers))):
            h = layer(h, masks[kind], c)
        return self.norm(h)


class Model(llama.Model):
    """Llama's LM shell; caches follow each layer's type (sliding or full)."""

    Inner = Qwen2Model

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[LayerCache]:
        return make_typed_caches(
            self.args.layer_types,
            self.args.sliding_window,
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )
