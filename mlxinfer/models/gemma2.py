"""Gemma 2: Gemma's pieces in a block with four norms, soft-capping and local/global layers.

- Each block norms the attention and MLP outputs as well as their inputs
  (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``).
- Attention logits are capped by ``c * tanh(s / c)`` (``attn_logit_softcapping``),
  and so are the final logits (``final_logit_softcapping``).
- Queries are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
- Layers alternate sliding-window (local) and full (global) attention, as
  ``layer_types`` says (default: local on even layers). Local layers keep a
  rotating cache of ``sliding_window`` tokens; each kind gets its own mask.

gemma3_text reuses this module with a per-head q/k norm and a RoPE per layer kind.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, LayerCache, Mask
from .base import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    CausalLM,
    check_layer_types,
    lm_head,
    make_typed_caches,
    per_layer,
    scaled_embedding,
    typed_masks,
)
from .gemma import ModelArgs as GemmaArgs
from .layers import GatedMLP, OffsetRMSNorm, RopeAttention, activation, make_rope
from .layers.masks import with_blocks

# Keys whose explicit null in config.json means "off", not "use the default".
NULLABLE = ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window")


@dataclasses.dataclass
class ModelArgs(GemmaArgs):
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        args = super().from_dict(config)
        for key in NULLABLE:
            if key in config and config[key] is None:
                setattr(args, key, None)
        args.__post_init__()
        return args

    def __post_init__(self):
        super().__post_init__()
        self.activation = self.hidden_activation  # Gemma 2 and 3 read hidden_activation, unremapped
        if self.layer_types is None:
            self.layer_types = self.default_layer_types()
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.sliding_window is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        self.qk_norm = False

    def default_layer_types(self) -> list[str]:
        return [
            SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
            for i in range(self.num_hidden_layers)
        ]

    def rope_parameters(self, kind: str) -> tuple[float, dict[str, Any] | None]:
        """(base, rope_scaling) for the layers of one kind; Gemma 2 uses one RoPE for all."""
        return self.rope_theta, self.rope_scaling


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        base, scaling = args.rope_parameters(kind)
        rope = make_rope(args.head_dim, base, scaling, args.max_position_embeddings)
        qk_norm = (lambda dim: OffsetRMSNorm(dim, eps=args.rms_norm_eps)) if args.qk_norm else None
        self.self_attn = RopeAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope=rope,
            scale=args.query_pre_attn_scalar**-0.5,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm=qk_norm,
            softcap=args.attn_logit_softcapping,
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, activation(args.activation))
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = residual_add(
            x, self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        )
        return residual_add(
            h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        )


def residual_add(x: mx.array, y: mx.array) -> mx.array:
    """``x + y``; in float16, added in float32 and clipped to float16's range.

    Gemma's residual stream outgrows float16 (it was trained in bfloat16): a
    plain float16 add overflows to inf and the next norm turns it into NaN.
    """
    if x.dtype != mx.float16:
        return x + y
    limit = float(mx.finfo(mx.float16).max)
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -limit, limit).astype(mx.float16)


class Gemma2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        assert args.layer_types is not None  # derived by ModelArgs.__post_init__
        self.layers = [DecoderLayer(args, kind) for kind in args.layer_types]
        self.norm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Cache] | None = None,
        *,
        embeds: mx.array | None = None,
        blocks: mx.array | None = None,
    ) -> mx.array:
        """``embeds``: the input embeddings (B, L, hidden) instead of the ids' own, as given (the
        ids' are scaled by sqrt(hidden); a multimodal model's soft tokens are not). ``blocks``:
        (L,) ids, >= 0 where tokens sharing one see each other both ways (an image's tokens)."""
        if embeds is None:
            embeds = scaled_embedding(self.embed_tokens(inputs), math.sqrt(self.args.hidden_size))
        h = embeds  # (B, L, hidden)
        kinds = self.args.layer_types
        assert kinds is not None  # derived by ModelArgs.__post_init__
        masks = typed_masks(kinds, cache, h.shape[1], self.args.sliding_window)
        if blocks is not None:
            masks = block_masks(masks, blocks, kinds, cache, self.args.sliding_window)
        for layer, kind, c in zip(self.layers, kinds, per_layer(cache, len(self.layers))):
            h = layer(h, masks[kind], c)
        return self.norm(h)


def block_masks(
    masks: dict[str, Mask],
    blocks: mx.array,
    kinds: list[str],
    cache: list[Cache] | None,
    window: int | None,
) -> dict[str, Mask]:
    """Each kind's mask with ``blocks`` seeing themselves both ways (layers/masks.with_blocks);
    sliding layers keep their window over the past (transformers' Gemma 3 mask)."""
    out = {}
    for kind, mask in masks.items():
        i = kinds.index(kind)
        offset = 0 if cache is None else int(cache[i].offset)
        local = window if kind == SLIDING_ATTENTION else None
        out[kind] = with_blocks(mask, blocks, offset, local)
    return out


class Model(CausalLM):
    Inner = Gemma2Model

    def __call__(
        self,
        inputs: mx.array,
        cache: list[LayerCache] | None = None,
        *,
        embeds: mx.array | None = None,
        blocks: mx.array | None = None,
    ) -> mx.array:
        h = self[self.inner_name](inputs, cache, embeds=embeds, blocks=blocks)
        logits = lm_head(h, self.head)  # (B, L, V)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[LayerCache]:
        if kv_bits is not None and self.args.attn_logit_softcapping is not None:
            raise ValueError("--kv-bits is not supported with attention soft-capping (Gemma 2)")
        return make_typed_caches(
            self.args.layer_types,
            self.args.sliding_window,
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        return CausalLM.sanitize({k: v for k, v in weights.items() if "rotary_emb" not in k}, args)
