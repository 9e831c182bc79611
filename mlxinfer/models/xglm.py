"""XGLM: fairseq's decoder with sinusoidal absolute positions.

- Input: ``embed_tokens(ids) * sqrt(d_model)`` (``scale_embedding``) plus a fixed
  sinusoidal table indexed by position + 2 (fairseq reserves rows for padding:
  the table's row ``pad_token_id`` is zero). Row p is
  ``[sin(p w_0) .. sin(p w_{h-1}), cos(p w_0) .. cos(p w_{h-1})]`` with
  ``w_i = exp(-i ln(10000) / (h - 1))`` and h = d_model / 2 (tensor2tensor's form).
- Pre-norm blocks with LayerNorm (eps 1e-5): ``self_attn_layer_norm`` → MHA with
  biases (``q_proj k_proj v_proj out_proj``) → residual → ``final_layer_norm`` →
  ``fc1`` → GELU → ``fc2`` → residual; a final ``layer_norm``; tied head.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.kv import Cache
from . import layers
from .base import BaseArgs, CausalLM, causal_mask, per_layer, positions
from .layers import activation
from .layers.rope import reach

POSITION_OFFSET = 2  # fairseq's padding offset, as transformers implements it


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    d_model: int
    num_layers: int
    attention_heads: int
    ffn_dim: int
    vocab_size: int
    max_position_embeddings: int = 2048
    activation_function: str = "gelu"
    scale_embedding: bool = True
    pad_token_id: int | None = 1
    tie_word_embeddings: bool = True


def sinusoidal_table(n_positions: int, dim: int, padding_idx: int | None) -> np.ndarray:
    """(n_positions, dim) float32 table, as described in the module doc."""
    half = dim // 2
    rate = math.log(10000) / (half - 1)
    freqs = np.exp(np.arange(half, dtype=np.float32) * -rate)  # float32 like transformers' table
    angles = np.arange(n_positions, dtype=np.float32)[:, None] * freqs[None]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    if dim % 2:
        table = np.concatenate([table, np.zeros((n_positions, 1), np.float32)], axis=1)
    if padding_idx is not None:
        table[padding_idx] = 0
    return table.astype(np.float32)


class Attention(layers.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.d_model
        self.n_heads = args.attention_heads
        self.scale = (d // self.n_heads) ** -0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        B, L, D = x.shape
        # (B, L, D) -> (B, n_heads, L, head_dim)
        q, k, v = (
            p(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = self.attend(q, k, v, scale=self.scale, mask=mask, cache=cache)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(args.d_model)
        self.self_attn = Attention(args)
        self.final_layer_norm = nn.LayerNorm(args.d_model)
        self.fc1 = nn.Linear(args.d_model, args.ffn_dim)
        self.fc2 = nn.Linear(args.ffn_dim, args.d_model)
        self.act = activation(args.activation_function)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.self_attn_layer_norm(x), mask, cache)
        return h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))


class XGLMModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_scale = math.sqrt(args.d_model) if args.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = [DecoderLayer(args) for _ in range(args.num_layers)]
        self.layer_norm = nn.LayerNorm(args.d_model)
        self.n_positions = args.max_position_embeddings
        # Underscore: a fixed table, not a parameter (transformers does not save it either).
        self._positions = mx.array(
            sinusoidal_table(
                args.max_position_embeddings + POSITION_OFFSET, args.d_model, args.pad_token_id
            )
        )

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        L = inputs.shape[1]
        offset = cache[0].offset if cache is not None else 0
        if reach(offset, L) > self.n_positions:
            raise ValueError(
                f"XGLM has {self.n_positions} positions; this input reaches {reach(offset, L)}"
            )
        h = self.embed_tokens(inputs) * self.embed_scale  # (B, L, d_model)
        h = h + self._positions[positions(offset, L) + POSITION_OFFSET].astype(h.dtype)
        mask = causal_mask(L) if cache is None else cache[0].make_mask(L)
        for layer, c in zip(self.layers, per_layer(cache, len(self.layers))):
            h = layer(h, mask, c)
        return self.layer_norm(h)


class Model(CausalLM):
    Inner = XGLMModel

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        # The sinusoidal table is a buffer some checkpoints still carry.
        weights = {k: v for k, v in weights.items() if "embed_positions" not in k}
        return CausalLM.sanitize(weights, args)
