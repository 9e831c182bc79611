"""DeepSeek-V2 and DeepSeek-V3 (``deepseek_v3`` is an alias plus its router), and GLM-4.7-Flash
(``glm4_moe_lite``: DeepSeek-V3's attention, router and MoE under GLM's name; its dense and MoE
layers listed in ``mlp_layer_types``, dense first by default).

Block: RMSNorm → multi-head latent attention (models/layers/mla.py) → residual →
RMSNorm → MLP → residual. The first ``first_k_dense_replace`` layers have a
dense SwiGLU MLP; the rest a MoE: ``n_routed_experts`` routed SwiGLU experts
(top ``num_experts_per_tok``) plus ``n_shared_experts`` always-on experts fused
into one MLP of ``n_shared_experts × moe_intermediate_size``.

Routing, as transformers 5 does it (moe.py):

- V2: softmax; ``topk_method`` greedy or group_limited_greedy (``n_group``,
  ``topk_group``); weights × ``routed_scaling_factor``.
- V3: sigmoid; choice on scores + ``e_score_correction_bias`` within the best
  ``topk_group`` of ``n_group`` groups; weights renormalised when
  ``norm_topk_prob``; × ``routed_scaling_factor``.

RoPE acts on the ``qk_rope_head_dim`` part only, on interleaved pairs (V2
always; V3 when ``rope_interleave``, the default). Yarn scaling sets both the
rotation's attention factor and, through ``mscale_all_dim``, the softmax scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, LatentKVCache, LayerCache
from ..errors import ConfigError, WeightsError
from .base import BaseArgs, CausalLM, causal_mask, per_layer
from .layers import GatedMLP, RMSNorm, activation, make_rope
from .layers.mla import MultiHeadLatentAttention, make_latent_caches, split_kv_b_proj
from .layers.moe import (
    Gate,
    SwitchGLU,
    combine,
    deepseek_v2_route,
    deepseek_v3_route,
    keep_routers_float,
    stack_experts,
)
from .layers.mtp import DEEPSEEK, MTPHeads, extend_block, nextn_layers_as_heads

EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


@dataclasses.dataclass
class ModelArgs(BaseArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # null in config.json (V2-Lite) means no query bottleneck
    moe_intermediate_size: int = 1407
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # V2 only
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False  # V3 only (transformers' V2 ignores it)
    rope_interleave: bool = True  # V3 only
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False  # V2's dense and shared MLPs
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # V3's MTP layers (layers/mtp.py)
    mlp_layer_types: list[str] | None = None  # GLM-4.7-Flash: "dense" or "sparse" per layer
    k_b_proj_transposed: bool = False  # a GGUF import's attn_k_b (layers/mla.py)

    def __post_init__(self):
        self.v3 = self.model_type in ("deepseek_v3", "glm4_moe_lite")
        kinds, n = self.mlp_layer_types, self.num_hidden_layers
        if self.model_type == "glm4_moe_lite" and kinds is None:
            kinds = ["dense"] * min(n, self.first_k_dense_replace or 1)
            kinds += ["sparse"] * (n - len(kinds))  # transformers' default: the first dense
        if kinds is not None and (len(kinds) < n or not set(kinds[:n]) <= {"dense", "sparse"}):
            raise ConfigError(
                f"config.json: 'mlp_layer_types' must list {n} entries of 'dense' or 'sparse', "
                f"found {kinds!r:.200}"
            )
        self.mlp_layer_types = None if kinds is None else list(kinds[:n])
        if self.v3:
            self.mlp_bias = False
            self.n_group, self.topk_group = self.n_group or 1, self.topk_group or 1
        elif self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(
                f"config.json: topk_method '{self.topk_method}' not supported "
                "(expected greedy or group_limited_greedy)"
            )

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer`` has experts (an MTP block's index, past the trunk's: always)."""
        if self.mlp_layer_types is not None and layer < self.num_hidden_layers:
            return bool(self.n_routed_experts) and self.mlp_layer_types[layer] == "sparse"
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling
        if s and s.get("mscale_all_dim") and s.get("factor", 1) > 1:
            mscale = 0.1 * s["mscale_all_dim"] * math.log(s["factor"]) + 1.0
            scale *= mscale * mscale
        return scale


class DeepseekMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.n_routed_experts  # an MoE layer's (ModelArgs.is_moe)
        self.args = args
        act = activation(args.hidden_act)
        self.gate = Gate(args.hidden_size, args.n_routed_experts, correction_bias=args.v3)
        self.experts = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, act
        )
        if args.n_shared_experts:
            self.shared_experts = GatedMLP(
                args.hidden_size,
                args.moe_intermediate_size * args.n_shared_experts,
                act,
                bias=args.mlp_bias,
            )

    def __call__(self, x: mx.array) -> mx.array:
        a, logits = self.args, self.gate(x)
        assert a.num_experts_per_tok is not None  # checked with the experts (config_check)
        if a.v3:
            assert a.n_group is not None and a.topk_group is not None  # V3's default 1
            weights, idx = deepseek_v3_route(
                logits,
                a.num_experts_per_tok,
                correction_bias=self.gate.e_score_correction_bias,
                n_group=a.n_group,
                topk_group=a.topk_group,
                normalize=a.norm_topk_prob,
                scaling=a.routed_scaling_factor,
            )
        else:
            weights, idx = deepseek_v2_route(
                logits,
                a.num_experts_per_tok,
                method=a.topk_method,
                n_group=a.n_group,
                topk_group=a.topk_group,
                scaling=a.routed_scaling_factor,
            )
        out = combine(self.experts(x, idx), weights)  # (B, L, hidden)
        if a.n_shared_experts:
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        # V2's rotation multiplies complex pairs (x0, x1), (x2, x3)...; V3's interleaved form is the
        # same up to a shared permutation of q and k dims, which leaves q·k unchanged.
        traditional = args.rope_interleave or not args.v3
        rope = make_rope(
            args.qk_rope_head_dim,
            args.rope_theta,
            args.rope_scaling,
            args.max_position_embeddings,
            traditional=traditional,
        )
        self.self_attn = MultiHeadLatentAttention(
            args.hidden_size,
            args.num_attention_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            bias=args.attention_bias,
            rope=rope,
            scale=args.softmax_scale,
            k_b_transposed=args.k_b_proj_transposed,
        )
        self.mlp: DeepseekMoE | GatedMLP
        if args.is_moe(layer):
            self.mlp = DeepseekMoE(args)
        else:
            self.mlp = GatedMLP(
                args.hidden_size,
                args.intermediate_size,
                activation(args.hidden_act),
                bias=args.mlp_bias,
            )
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # V3's MTP heads' blocks: MLA + MoE whatever first_k_dense_replace says.
        n, first_sparse = args.num_hidden_layers, args.first_k_dense_replace
        self.mtp_layers = [
            extend_block(
                DecoderLayer(args, max(n + i, first_sparse)),
                DEEPSEEK,
                args.hidden_size,
                args.rms_norm_eps,
            )
            for i in range(args.num_nextn_predict_layers)
        ]

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        L = inputs.shape[1]
        mask = causal_mask(L) if cache is None else cache[0].make_mask(L)
        for layer, c in zip(self.layers, per_layer(cache, len(self.layers))):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(MTPHeads, CausalLM):
    Inner = DeepseekModel
    mtp_spec = DEEPSEEK

    def mtp_cache(self) -> Cache:
        """A head's cache: the latent one, as its trunk's layers."""
        return LatentKVCache()

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[LayerCache]:
        """A latent cache per layer (models/layers/mla.py): kv_lora_rank + qk_rope_head_dim values per token."""
        return make_latent_caches(len(self.layers), max_kv_size=max_kv_size, kv_bits=kv_bits)

    quant_predicate = staticmethod(keep_routers_float)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        if any(k.endswith("weight_scale_inv") for k in weights):
            raise WeightsError(
                "FP8 block-quantized DeepSeek checkpoint (weight_scale_inv): dequantize it to "
                "bfloat16 first"
            )

        def keep(key: str) -> bool:  # drop RoPE buffers and a tied head's copy
            return "rotary_emb.inv_freq" not in key and not (
                args.tie_word_embeddings and key.startswith("lm_head.")
            )

        weights = {k: v for k, v in weights.items() if keep(k)}
        # V3's multi-token-prediction layers (>= num_hidden_layers) become its MTP heads.
        weights = nextn_layers_as_heads(
            weights, args.num_hidden_layers, args.num_nextn_predict_layers
        )
        weights = split_kv_b_proj(weights, args.num_attention_heads, args.qk_nope_head_dim)
        return stack_experts(weights, EXPERT_NAMES)
