"""BLOOM: ALiBi attention biases instead of position embeddings.

- No position embeddings: each head h adds ``slope_h * (j - i)`` to the logit of
  query i on key j (ALiBi). transformers adds ``slope_h * j``, which differs by
  a per-row constant that softmax ignores; the relative form keeps the bias
  small, so it stays exact in float16 for long sequences.
- The bias rides in the additive mask of the fused attention, together with
  the causal -inf, so a standard KV cache serves (its keys are positions
  0..offset). Rotating and quantized caches are not offered: their keys are
  not in position order / they group heads, which this bias does not follow.
- ``query_key_value`` is fused per head: its output splits as
  (n_head, 3, head_dim), i.e. q, k, v interleaved head by head; kept as is.
- LayerNorm on the embeddings (``word_embeddings_layernorm``), pre-norm blocks
  (optionally with the residual taken after the norm), tanh-GELU MLP, tied head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, LayerCache
from . import layers
from .base import BaseArgs, CausalLM, alibi_slopes, make_layer_caches, per_layer


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    n_layer: int
    n_head: int
    vocab_size: int
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    tie_word_embeddings: bool = True
    max_position_embeddings: int | None = None
    seq_length: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        if config.get("hidden_size") is None and config.get("n_embed") is not None:
            config = {**config, "hidden_size": config["n_embed"]}  # older BLOOM configs
        return super().from_dict(config)

    def __post_init__(self):
        # ALiBi has no position table; the context is the training length.
        self.max_position_embeddings = self.max_position_embeddings or self.seq_length or 2048


def alibi_mask(slopes: mx.array, n_queries: int, offset: int, dtype: mx.Dtype) -> mx.array:
    """ALiBi bias plus causal mask for ``n_queries`` after ``offset`` cached keys: (n_heads, L, T)."""
    q = mx.arange(offset, offset + n_queries)[:, None]
    k = mx.arange(offset + n_queries)[None]
    bias = slopes[:, None, None] * (k - q).astype(mx.float32)  # (n_heads, L, T), <= 0 where visible
    return mx.where(k <= q, bias, -mx.inf).astype(dtype)


def alibi_rows_mask(
    slopes: mx.array, offsets: mx.array, visible: mx.array, dtype: mx.Dtype
) -> mx.array:
    """:func:`alibi_mask` for a batch whose rows start at ``offsets`` (B,): the bias over the keys
    that ``visible`` (B, 1, L, T), the cache's own mask, lets each row see. (B, n_heads, L, T)."""
    L, T = visible.shape[-2:]
    q = offsets[:, None, None, None] + mx.arange(L)[:, None]  # (B, 1, L, 1)
    bias = slopes[None, :, None, None] * (mx.arange(T) - q).astype(mx.float32)
    return mx.where(visible, bias, -mx.inf).astype(dtype)


class Attention(layers.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_head
        self.head_dim = args.hidden_size // args.n_head
        self.scale = self.head_dim**-0.5
        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array, cache: Cache | None) -> mx.array:
        B, L, D = x.shape
        qkv = self.query_key_value(x).reshape(B, L, self.n_heads, 3, self.head_dim)
        # (B, L, n_heads, head_dim) each -> (B, n_heads, L, head_dim)
        q, k, v = (qkv[..., i, :].transpose(0, 2, 1, 3) for i in range(3))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = self.attend(q, k, v, scale=self.scale, mask=mask, cache=cache)
        return self.dense(out.transpose(0, 2, 1, 3).reshape(B, L, D))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(args.hidden_size, 4 * args.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.dense_4h_to_h(nn.gelu_approx(self.dense_h_to_4h(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.self_attention = Attention(args)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.mlp = MLP(args)
        self.residual_after_norm = args.apply_residual_connection_post_layernorm

    def __call__(self, x: mx.array, mask: mx.array, cache: Cache | None) -> mx.array:
        normed = self.input_layernorm(x)
        h = (normed if self.residual_after_norm else x) + self.self_attention(normed, mask, cache)
        normed = self.post_attention_layernorm(h)
        return (normed if self.residual_after_norm else h) + self.mlp(normed)


class BloomModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.h = [Block(args) for _ in range(args.n_layer)]
        self.ln_f = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self._slopes = alibi_slopes(args.n_head)  # (n_heads,); underscore: not a parameter

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        h = self.word_embeddings_layernorm(self.word_embeddings(inputs))  # (B, L, hidden)
        offset = cache[0].offset if cache is not None else 0
        if isinstance(offset, int):
            mask = alibi_mask(self._slopes, inputs.shape[1], offset, h.dtype)
        else:  # a batch's rows, each at its own position
            visible = cache[0].make_mask(inputs.shape[1])
            mask = alibi_rows_mask(self._slopes, offset, visible, h.dtype)
        for block, c in zip(self.h, per_layer(cache, len(self.h))):
            h = block(h, mask, c)
        return self.ln_f(h)


class Model(CausalLM):
    Inner = BloomModel
    inner_name, embed_name, layers_name = "transformer", "word_embeddings", "h"

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[LayerCache]:
        if max_kv_size is not None or kv_bits is not None:
            raise ValueError(
                "--max-kv-size and --kv-bits are not supported with ALiBi attention (BLOOM)"
            )
        return make_layer_caches(len(self.layers))

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        # Checkpoints saved from BloomModel (bigscience/bloom-560m) lack the "transformer." prefix.
        out = {}
        for k, v in weights.items():
            if k.startswith("lm_head.") and args.tie_word_embeddings:
                continue
            out[k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"] = v
        return out
