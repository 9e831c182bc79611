"""Granite (IBM's granite 3.x dense models): Llama's network with four multipliers.

- the embeddings are multiplied by ``embedding_multiplier``;
- attention scores are scaled by ``attention_multiplier`` instead of 1/√head_dim;
- each block adds its attention and MLP outputs times ``residual_multiplier``;
- the logits are divided by ``logits_scaling``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, LayerCache
from . import llama


@dataclasses.dataclass
class ModelArgs(llama.ModelArgs):
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.self_attn.scale = args.attention_multiplier
        self.residual_multiplier = args.residual_multiplier

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        r = self.residual_multiplier
        h = x + self.self_attn(self.input_layernorm(x), mask, cache) * r
        return h + self.mlp(self.post_attention_layernorm(h)) * r


class GraniteModel(llama.LlamaModel):
    Block: Callable[..., nn.Module] = TransformerBlock

    def embed(self, inputs: mx.array) -> mx.array:
        return self.embed_tokens(inputs) * self.args.embedding_multiplier


class Model(llama.Model):
    Inner = GraniteModel

    def __call__(self, inputs: mx.array, cache: list[LayerCache] | None = None) -> mx.array:
        return super().__call__(inputs, cache) / self.args.logits_scaling
