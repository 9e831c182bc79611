"""Qwen3-Next (Qwen3-Next-80B-A3B): Gated DeltaNet layers, gated full attention, Qwen2-MoE experts.

Block: norm → token mixer → residual → norm → MLP → residual, all norms Gemma's ``(1 + w)``
form. The mixer is, per ``layer_types`` (by default three ``linear_attention`` layers, then
one ``full_attention``):

- ``linear_attention``: a Gated DeltaNet (``layers/gated_delta.py``), whose conv inputs and
  recurrent state live in a ``StateCache`` of a fixed size;
- ``full_attention``: GQA with a per-head q/k norm, partial RoPE (``partial_rotary_factor``
  of ``head_dim``, 1/4 by default) and an output gate from the doubled ``q_proj``.

The MLP is Qwen2-MoE's (softmax router, top-k renormalised when ``norm_topk_prob``, a
shared expert scaled by ``sigmoid(shared_expert_gate(x))``), or dense on ``mlp_only_layers``.
The checkpoints' multi-token-prediction layers (``mtp.layers.i.*``, a gated full-attention
block with this MLP, plus ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}``, (1 + w)
norms, DeepSeek's [embedding, hidden] order) are kept as the model's MTP heads for ``--mtp``
(``sanitize`` moves them to ``model.mtp_layers.i``; ``layers/mtp.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, LayerCache, StateCache
from ..errors import ConfigError
from . import qwen2_moe
from .base import CausalLM, causal_mask, make_hybrid_caches, per_layer
from .layers import GatedMLP, OffsetRMSNorm, RopeAttention, activation, make_rope
from .layers.gated_delta import GatedDeltaNet, sanitize_conv
from .layers.moe import keep_routers_float, stack_experts
from .layers.mtp import MTPHeads, MTPSpec, extend_block

LINEAR, FULL = "linear_attention", "full_attention"
# Qwen's head: its names for the head's own norms and projection, (1 + w) norms, [e, h].
QWEN = MTPSpec("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", norm=OffsetRMSNorm)


@dataclasses.dataclass
class ModelArgs(qwen2_moe.ModelArgs):
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    norm_topk_prob: bool = True
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    full_attention_interval: int = 4
    shared_expert_intermediate_size: int = 0
    separate_projections: bool = False  # Qwen3.5's Gated DeltaNet inputs (qwen3_5.py)
    mtp_num_hidden_layers: int = 0  # the MTP heads (layers/mtp.py)

    def __post_init__(self):
        head_dim, kinds = self.head_dim, self.layer_types
        self.layer_types = None  # qwen2_moe's rule knows only sliding and full layers
        super().__post_init__()
        self.head_dim = head_dim
        n = self.num_hidden_layers
        if kinds is None:
            every = self.full_attention_interval
            kinds = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
        if len(kinds) != n or not set(kinds) <= {LINEAR, FULL}:
            raise ConfigError(
                f"config.json: 'layer_types' must list {n} entries of '{LINEAR}' or '{FULL}', "
                f"found {kinds!r}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                "config.json: 'linear_num_value_heads' must be a multiple of "
                f"'linear_num_key_heads', found {self.linear_num_value_heads} and "
                f"{self.linear_num_key_heads}"
            )
        self.layer_types = kinds
        self.sliding_window = None


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        assert args.layer_types is not None  # derived by ModelArgs.__post_init__
        self.is_linear = args.layer_types[layer] == LINEAR
        eps = args.rms_norm_eps
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                args.hidden_size,
                n_k=args.linear_num_key_heads,
                n_v=args.linear_num_value_heads,
                head_k=args.linear_key_head_dim,
                head_v=args.linear_value_head_dim,
                width=args.linear_conv_kernel_dim,
                eps=eps,
                separate=args.separate_projections,
            )
        else:
            rotary = int(args.head_dim * args.partial_rotary_factor)
            rope = make_rope(
                rotary, args.rope_theta, args.rope_scaling, args.max_position_embeddings
            )
            self.self_attn = RopeAttention(
                args.hidden_size,
                args.num_attention_heads,
                args.num_key_value_heads,
                args.head_dim,
                rope=rope,
                qkv_bias=args.attention_bias,
                o_bias=args.attention_bias,
                qk_norm=lambda dim: OffsetRMSNorm(dim, eps=eps),
                output_gate=True,
            )
        act = activation(args.hidden_act)
        self.mlp: qwen2_moe.SparseMoE | GatedMLP
        if args.is_sparse(layer):
            self.mlp = qwen2_moe.SparseMoE(args)
        else:
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, act)
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, mask, cache: LayerCache | None) -> mx.array:
        h = self.input_layernorm(x)
        # casts: make_cache gives a linear layer a StateCache, an attention layer a KV cache
        if self.is_linear:
            h = x + self.linear_attn(h, cast("StateCache | None", cache))
        else:
            h = x + self.self_attn(h, mask, cast("Cache | None", cache))
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = OffsetRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # The MTP heads' blocks: gated full attention and the model's MLP (MoE when it has
        # experts), whatever layer_types and mlp_only_layers say of the trunk's layers.
        head_args = copy.copy(args)
        head_args.layer_types, head_args.mlp_only_layers = [FULL], []
        self.mtp_layers = [
            extend_block(DecoderLayer(head_args, 0), QWEN, args.hidden_size, args.rms_norm_eps)
            for _ in range(args.mtp_num_hidden_layers)
        ]

    @property
    def first_attention(self) -> int | None:
        """The first attention layer: its cache makes the mask the attention layers share.
        Read from ``args`` at each call, as the caches are made from them (a model cut to some
        of its layers from the outside gets ``args`` of those layers)."""
        kinds = self.args.layer_types
        assert kinds is not None  # derived by ModelArgs.__post_init__
        return next((i for i, k in enumerate(kinds) if k == FULL), None)

    def __call__(self, inputs: mx.array, cache: list[LayerCache] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        L = inputs.shape[1]
        if cache is None:
            mask = causal_mask(L)
        else:
            first = self.first_attention
            # the first attention layer's cache: a KV cache
            mask = cast(Cache, cache[first]).make_mask(L) if first is not None else None
        for layer, c in zip(self.layers, per_layer(cache, len(self.layers))):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(MTPHeads, CausalLM):
    Inner = Qwen3NextModel
    mtp_spec = QWEN

    quant_predicate = staticmethod(keep_routers_float)

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[LayerCache]:
        """A ``StateCache`` (conv inputs, recurrent state) per Gated DeltaNet layer; the
        attention layers' caches as the flags choose."""
        return make_hybrid_caches(
            [kind == LINEAR for kind in self.args.layer_types],
            2,
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        weights = _mtp_as_heads(weights, args.mtp_num_hidden_layers)
        weights = stack_experts(CausalLM.sanitize(weights, args), qwen2_moe.EXPERT_NAMES)
        return {k: sanitize_conv(k, v) for k, v in weights.items()}


_HEAD_OWN = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.")


def _mtp_as_heads(weights: dict[str, mx.array], heads: int) -> dict[str, mx.array]:
    """``mtp.layers.i.*`` -> ``model.mtp_layers.i.*`` and the head's own ``mtp.fc``, norms ->
    ``model.mtp_layers.0.*`` (one head, as the checkpoints have); none when the config
    announces none."""
    out = {}
    for key, value in weights.items():
        if not key.startswith("mtp."):
            out[key] = value
            continue
        rest = key[len("mtp.") :]
        if rest.startswith("layers."):
            i, _, name = rest[len("layers.") :].partition(".")
            if i.isdigit() and int(i) < heads:
                out[f"model.mtp_layers.{i}.{name}"] = value
        elif rest.startswith(_HEAD_OWN) and heads:
            out[f"model.mtp_layers.0.{rest}"] = value
    return out
