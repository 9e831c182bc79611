"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama's block with fused projections.

- ``qkv_proj`` holds the q, k and v rows in one matrix and ``gate_up_proj`` the
  gate and up rows; both stay fused (one matmul each) under their HF names.
- RoPE may rotate only the first ``partial_rotary_factor`` of each head, and
  may be LongRoPE ("su"/"longrope"; transformers also reads "yarn" as longrope
  for this family), which picks short or long per-pair factors by length.
- ``sliding_window`` (Phi-3-mini-4k: 2047) applies to every layer.
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


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    head_dim: int = 0  # 0 or absent: hidden_size // num_attention_heads (__post_init__)
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rotary_dims = int(self.head_dim * self.partial_rotary_factor)
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] in (
            "su",
            "yarn",
            "longrope",
        ):
            scaling = {**self.rope_scaling, "rope_type": "longrope"}
            scaling.setdefault(
                "original_max_position_embeddings", self.original_max_position_embeddings
            )
            self.rope_scaling = scaling


class MLP(nn.Module):
    """down(act(gate) * up), with gate and up as the two halves of one ``gate_up_proj``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        rope = make_rope(
            args.rotary_dims, args.rope_theta, args.rope_scaling, args.max_position_embeddings
        )
        self.self_attn = RopeAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
            fused_qkv=True,
        )
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Phi3Model(llama.LlamaModel):
    Block = DecoderLayer


class Model(llama.Model):
    Inner = Phi3Model

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
        if args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
