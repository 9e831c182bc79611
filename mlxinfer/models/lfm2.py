"""LFM2 (LiquidAI): short-convolution blocks interleaved with attention blocks.

Every block is pre-norm: ``operator_norm`` → the operator → residual → ``ffn_norm`` →
SwiGLU ``feed_forward`` → residual; the final norm is ``embedding_norm`` and the head is
tied to the embedding by default. The operator is, per ``layer_types``:

- ``full_attention``: grouped-query attention with RoPE and a per-head RMSNorm on queries
  and keys before it (``RopeAttention`` with ``qk_norm``), over a KV cache;
- ``conv``: a gated short convolution. ``in_proj`` gives three gates b, c, x; b·x runs
  through a depthwise causal convolution of width K = ``conv_L_cache`` (3), and c gates
  its output before ``out_proj``. The only state a conv layer carries from token to
  token is its last K - 1 inputs, kept in a ``StateCache`` (a fixed size, whatever the
  context).

Older configs say ``full_attn_idxs`` instead of ``layer_types``, ``block_ff_dim`` instead
of ``intermediate_size`` and ``tie_embedding``; as in transformers, the feed-forward width
is ⅔ of it, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, LayerCache, StateCache
from ..errors import ConfigError
from .base import BaseArgs, CausalLM, causal_mask, make_hybrid_caches, per_layer
from .layers import GatedMLP, RMSNorm, RopeAttention, make_rope

ATTENTION, CONV = "full_attention", "conv"


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int | None = None
    block_ff_dim: int | None = None  # older configs' name for intermediate_size (it wins)
    num_key_value_heads: int = 0  # 0 or absent: num_attention_heads (__post_init__)
    head_dim: int = 0  # 0 or absent: hidden_size // num_attention_heads (__post_init__)
    norm_eps: float = 1e-5
    max_position_embeddings: int = 128_000
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None
    conv_bias: bool = False
    conv_L_cache: int = 3  # the convolution's width K
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = None
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = True
    tie_embedding: bool | None = None  # older configs' name for tie_word_embeddings (it wins)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        args = super().from_dict(config)
        if "block_ffn_dim_multiplier" in config and config["block_ffn_dim_multiplier"] is None:
            args.block_ffn_dim_multiplier = None  # no multiplier and no rounding (transformers)
        return args

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.block_ff_dim is not None:
            self.intermediate_size = self.block_ff_dim
        if self.intermediate_size is None:
            raise ConfigError(
                "config.json: model_type 'lfm2' needs key 'intermediate_size' (or 'block_ff_dim')"
            )
        if self.tie_embedding is not None:
            self.tie_word_embeddings = self.tie_embedding
        n = self.num_hidden_layers
        if self.layer_types is None:
            attention = range(n) if self.full_attn_idxs is None else self.full_attn_idxs
            self.layer_types = [ATTENTION if i in attention else CONV for i in range(n)]
        if len(self.layer_types) != n or not set(self.layer_types) <= {ATTENTION, CONV}:
            raise ConfigError(
                f"config.json: 'layer_types' must list {n} entries of '{ATTENTION}' or "
                f"'{CONV}', found {self.layer_types!r}"
            )
        if self.conv_L_cache < 2:
            raise ConfigError(
                f"config.json: 'conv_L_cache' must be at least 2, found {self.conv_L_cache}"
            )

    @property
    def ff_dim(self) -> int:
        """The SwiGLU's hidden width, as transformers derives it."""
        dim = self.intermediate_size
        assert dim is not None  # __post_init__ refuses a config without it
        if self.block_auto_adjust_ff_dim:
            dim = int(2 * dim / 3)
            if self.block_ffn_dim_multiplier is not None:
                dim = int(self.block_ffn_dim_multiplier * dim)
                m = self.block_multiple_of
                dim = m * ((dim + m - 1) // m)
        return dim


class ShortConv(nn.Module):
    """out_proj(c · conv(b · x)), with b, c, x the thirds of ``in_proj`` and ``conv`` a
    depthwise causal convolution of width K (one K-tap filter per channel)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.width = args.hidden_size, args.conv_L_cache
        self.in_proj = nn.Linear(dim, 3 * dim, bias=args.conv_bias)
        # weight (hidden, K, 1): MLX's (out, width, in / groups) layout; see Model.sanitize
        self.conv = nn.Conv1d(dim, dim, self.width, groups=dim, bias=args.conv_bias)
        self.out_proj = nn.Linear(dim, dim, bias=args.conv_bias)

    def __call__(self, x: mx.array, cache: StateCache | None) -> mx.array:
        B, L, _ = x.shape
        b, c, x = mx.split(self.in_proj(x), 3, axis=-1)  # (B, L, channels) each
        bx = b * x
        past = None if cache is None else cache.arrays[0]
        if past is None:  # the start of the sequence: zeros before it, as the conv's padding
            # as many channels as in_proj gives (not the config's hidden size: the state
            # follows the layer's own weights)
            past = mx.zeros((B, self.width - 1, bx.shape[-1]), bx.dtype)
        window = mx.concatenate([past, bx], axis=1)  # (B, K - 1 + L, channels)
        if cache is not None:
            positions = None
            if cache.recording:  # a verification pass: the state after each token, on demand

                def positions(i: int) -> list[mx.array]:
                    return [window[:, i + 1 : i + self.width]]

            cache.update([window[:, L:]], L, positions)  # the last K - 1 inputs
        return self.out_proj(c * self.conv(window))  # conv: (B, L, channels), no padding


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        self.is_attention = kind == ATTENTION
        if self.is_attention:
            rope = make_rope(
                args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings
            )
            self.self_attn = RopeAttention(
                args.hidden_size,
                args.num_attention_heads,
                args.num_key_value_heads,
                args.head_dim,
                rope=rope,
                qk_norm=lambda dim: RMSNorm(dim, eps=args.norm_eps),
            )
        else:
            self.conv = ShortConv(args)
        self.feed_forward = GatedMLP(args.hidden_size, args.ff_dim, nn.silu)  # SwiGLU
        self.operator_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)

    def __call__(self, x: mx.array, mask, cache: LayerCache | None) -> mx.array:
        h = self.operator_norm(x)
        # casts: make_cache gives an attention layer a KV cache, a conv layer a StateCache
        if self.is_attention:
            h = x + self.self_attn(h, mask, cast("Cache | None", cache))
        else:
            h = x + self.conv(h, cast("StateCache | None", cache))
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        assert args.layer_types is not None  # derived by ModelArgs.__post_init__
        self.layers = [DecoderLayer(args, kind) for kind in args.layer_types]
        self.embedding_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)

    @property
    def first_attention(self) -> int | None:
        """The first attention layer: its cache makes the mask the attention layers share.
        Read from ``args`` at each call, as the caches are made from them (a model cut to some
        of its layers from the outside gets ``args`` of those layers)."""
        kinds = self.args.layer_types
        assert kinds is not None  # derived by ModelArgs.__post_init__
        return next((i for i, k in enumerate(kinds) if k == ATTENTION), None)

    def __call__(self, inputs: mx.array, cache: list[LayerCache] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        L = inputs.shape[1]
        if cache is None:
            mask = causal_mask(L)
        else:
            first = self.first_attention  # its cache is a KV cache; None: convolutions only
            mask = cast(Cache, cache[first]).make_mask(L) if first is not None else None
        for layer, c in zip(self.layers, per_layer(cache, len(self.layers))):
            h = layer(h, mask, c)
        return self.embedding_norm(h)


class Model(CausalLM):
    Inner = Lfm2Model

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[LayerCache]:
        """A ``StateCache`` per conv layer; the attention layers' caches as the flags choose."""
        return make_hybrid_caches(
            [kind == CONV for kind in self.args.layer_types],
            1,
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )

    # The depthwise conv is no Linear, so quantizing leaves it float by itself: no predicate.

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        """HF's layout onto the shared layers: conv weights (hidden, 1, K) -> MLX's
        (hidden, K, 1); ``out_proj`` / ``q_layernorm`` / ``k_layernorm`` of attention ->
        ``o_proj`` / ``q_norm`` / ``k_norm``; the SwiGLU's ``w1`` / ``w3`` / ``w2`` ->
        ``gate_proj`` / ``up_proj`` / ``down_proj``. Converted weights pass unchanged."""
        renames = (
            (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".feed_forward.w1.", ".feed_forward.gate_proj."),
            (".feed_forward.w3.", ".feed_forward.up_proj."),
            (".feed_forward.w2.", ".feed_forward.down_proj."),
        )
        out = {}
        for key, value in CausalLM.sanitize(weights, args).items():
            for old, new in renames:
                key = key.replace(old, new)
            if key.endswith(".conv.conv.weight") and value.ndim == 3 and value.shape[1] == 1:
                value = value.swapaxes(1, 2)  # (hidden, 1, K) -> (hidden, K, 1)
            out[key] = value
        return out
