"""Tensor parallelism's split of the experts (mlxinfer/distributed/experts.py), without ranks.

Each rank keeps its share of every routed and shared expert's hidden units, the router whole;
the shares' outputs, summed over simulated ranks in one process, must be the whole layer's
output. The two-rank launches against transformers are in tests/distributed/test_distributed.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxinfer.distributed.placement import tensor_split_reason
from mlxinfer.distributed.tensor import shard
from mlxinfer.models import build_model

BASE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=128,
)
MOE = {  # family -> (config, the routed experts' and shared experts' hidden sizes)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # A routed and a shared expert, the shared one times a whole per-token sigmoid gate.
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True
    ),
    # DeepseekMoE: V3's grouped router, shared experts added; a dense first layer.
    "glm4_moe": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    # Biased experts (the down bias must be added once) and a clamped SwiGLU.
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, intermediate_size=16),
    # DeepseekMoE (V3's router, a shared expert added) after a dense first layer, beside
    # multi-head latent attention (split by heads, its latent path whole; biased: o_proj's bias
    # must be added once).
    "deepseek_v3": dict(
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        attention_bias=True,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
    ),
}


def _model(family: str, **overrides):
    mx.random.seed(1)
    model = build_model({"model_type": family, **BASE, **MOE[family], **overrides})
    # Random biases (zero at init: a down bias added on every rank would not show otherwise).
    params = [
        (k, mx.random.normal(v.shape) * 0.1 if k.endswith("bias") else v)
        for k, v in tree_flatten(model.parameters())
    ]
    model.load_weights(params)
    return model, params


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", sorted(MOE))
def test_the_expert_shares_add_up_to_the_whole_layer(family, size):
    model, params = _model(family)
    x = mx.random.normal((2, 7, BASE["hidden_size"]))  # 28 (token, expert) pairs: unsorted
    layer = len(model.layers) - 1
    whole = model.layers[layer].mlp(x)
    parts = []
    for r in range(size):
        rank_model = build_model({"model_type": family, **BASE, **MOE[family]})
        rank_model.load_weights(params)
        summed = shard(rank_model, SimpleNamespace(rank=r, size=size))
        block = rank_model.layers[layer]
        assert any(b is block and name == "mlp" for b, name in summed)
        experts = block.mlp.experts
        assert (
            experts.down_proj.weight.shape[-1] * size
            == model.layers[layer].mlp.experts.down_proj.weight.shape[-1]
        )
        parts.append(block.mlp(x))
    np.testing.assert_allclose(np.array(sum(parts)), np.array(whole), atol=2e-6, rtol=1e-5)
    # Each share alone is not the whole (the test would pass with nothing split otherwise).
    assert float(mx.abs(parts[0] - whole).max()) > 1e-3


@pytest.mark.parametrize(
    "family, mode", [("mixtral", "affine"), ("gpt_oss", "affine"), ("gpt_oss", "mxfp4")]
)
def test_quantized_expert_shares_add_up_to_the_whole_layer(family, mode):
    """Quantized experts (4-bit, groups of 32: affine, or MXFP4 with uint8 scales only, as
    gpt-oss stores them; gpt-oss's with biases) cut to two ranks' shares: the packed weights,
    scales and biases of gate/up by hidden units, of down at a group boundary; the shares'
    outputs sum to the whole quantized layer's."""
    import mlx.nn as nn

    from mlxinfer.models.layers.moe import SwitchLinear

    sizes = dict(hidden_size=32, intermediate_size=64)

    def quantized_model():
        model = build_model({"model_type": family, **BASE, **MOE[family], **sizes})
        is_experts = lambda _, m: isinstance(m, SwitchLinear)  # noqa: E731
        nn.quantize(model, 32, 4, mode=mode, class_predicate=is_experts)
        return model

    mx.random.seed(3)
    model = quantized_model()
    params = [
        (k, mx.random.normal(v.shape) * 0.1 if mx.issubdtype(v.dtype, mx.floating) else v)
        if not k.endswith("scales") or mode == "affine"
        else (k, mx.random.randint(118, 124, v.shape).astype(mx.uint8))  # powers of two near 1
        for k, v in tree_flatten(model.parameters())
    ]
    params = [  # the packed weights: random codes
        (k, mx.random.randint(0, 1 << 31, v.shape).astype(mx.uint32) if v.dtype == mx.uint32 else v)
        for k, v in params
    ]
    model.load_weights(params)
    x = mx.random.normal((2, 7, sizes["hidden_size"]))
    whole = model.layers[0].mlp(x)
    parts = []
    for r in range(2):
        rank_model = quantized_model()
        rank_model.load_weights(params)
        shard(rank_model, SimpleNamespace(rank=r, size=2))
        down = rank_model.layers[0].mlp.experts.down_proj
        assert down.scales.shape[-1] == 1  # 32 of the 64 hidden units: one group each
        parts.append(rank_model.layers[0].mlp(x))
    np.testing.assert_allclose(np.array(sum(parts)), np.array(whole), atol=1e-4, rtol=1e-4)
    assert float(mx.abs(parts[0] - whole).max()) > 1e-3


def test_a_larger_batch_takes_the_sorted_path_too():
    """64 or more (token, expert) pairs: SwitchGLU sorts them by expert; the shares still add up."""
    model, params = _model("mixtral")
    x = mx.random.normal((1, 40, BASE["hidden_size"]))
    whole = model.layers[0].mlp(x)
    parts = []
    for r in range(2):
        rank_model = build_model({"model_type": "mixtral", **BASE, **MOE["mixtral"]})
        rank_model.load_weights(params)
        shard(rank_model, SimpleNamespace(rank=r, size=2))
        parts.append(rank_model.layers[0].mlp(x))
    np.testing.assert_allclose(np.array(sum(parts)), np.array(whole), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "family, overrides, size, reason",
    [
        ("mixtral", {}, 2, None),
        ("qwen2_moe", {}, 2, None),
        ("glm4_moe", {}, 2, None),  # a dense first layer, then experts
        (
            "mixtral",
            dict(num_key_value_heads=4, intermediate_size=6),
            4,
            "6 hidden units of each expert do not divide over 4 ranks",
        ),
        (
            "qwen2_moe",
            dict(num_key_value_heads=4, shared_expert_intermediate_size=18),
            4,
            "18 hidden units of 'shared_expert' do not divide over 4 ranks",
        ),
        ("mixtral", {}, 3, "4 attention heads do not divide over 3 ranks"),
        ("gpt_oss", {}, 2, None),  # sinks split by heads, experts' down bias on rank 0
    ],
)
def test_which_mixtures_of_experts_split(family, overrides, size, reason):
    model, _ = _model(family, **overrides)
    assert tensor_split_reason(model, size) == reason


def test_which_latent_attentions_split():
    """Multi-head latent attention splits by heads (one latent for all: no KV heads to divide)."""
    model, _ = _model("deepseek_v3")
    assert tensor_split_reason(model, 2) is None
    assert tensor_split_reason(model, 4) is None
    assert tensor_split_reason(model, 3) == "4 attention heads do not divide over 3 ranks"
    v2 = dict(MOE["deepseek_v3"], model_type="deepseek_v2", q_lora_rank=None, n_group=None)
    assert tensor_split_reason(build_model({**BASE, **v2}), 2) is None  # q_proj, no q LoRA


def _quantize_attention(model) -> None:
    """4-bit, groups of 32, every projection of the latent attention (its per-head k_b_proj
    and v_b_proj too: ``QuantizedPerHeadLinear``)."""
    import mlx.nn as nn

    for layer in model.layers:
        nn.quantize(layer.self_attn, 32, 4)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_the_latent_attention_shares_add_up_to_the_whole_layer(quantized, q_lora_rank):
    """Each simulated rank runs its heads of one MLA block with its own latent cache: a
    prefill (expanded keys and values), then two decode steps (absorbed into the query and
    output). The shares sum to the whole block's output at every step, and every rank's latent
    cache equals the whole block's (the latent path is not split)."""
    from mlxinfer.cache.kv import LatentKVCache
    from mlxinfer.distributed.placement import quantized_split_reason

    config = {"model_type": "deepseek_v3", **BASE, **MOE["deepseek_v3"], "q_lora_rank": q_lora_rank}
    config.update(intermediate_size=64, moe_intermediate_size=64)  # whole groups of 32 a rank

    def built():
        model = build_model(config)
        if quantized:
            _quantize_attention(model)
        return model

    mx.random.seed(2)
    model = built()
    params = [  # random biases, norm weights and (quantized) codes, scales and biases
        (
            k,
            mx.random.randint(0, 1 << 31, v.shape).astype(mx.uint32)
            if v.dtype == mx.uint32
            else mx.random.normal(v.shape) * 0.1 + (k.endswith("norm.weight"))
            if v.ndim == 1 or k.endswith(("scales", "biases"))
            else v,
        )
        for k, v in tree_flatten(model.parameters())
    ]
    model.load_weights(params)
    if quantized:  # o_proj's 64 inputs: 32 a rank, one group of 32 each; not on 4 ranks
        record, float_model = {"group_size": 32, "bits": 4}, build_model(config)  # as load.py
        assert quantized_split_reason(float_model, record, 2) is None
        assert quantized_split_reason(float_model, record, 4) == (
            "layer 0's model.layers.0.self_attn.o_proj: 64 quantized inputs in groups of 32 "
            "do not split into whole groups over 4 ranks"
        )
    x = mx.random.normal((2, 9, BASE["hidden_size"]))
    steps = [x[:, :7], x[:, 7:8], x[:, 8:9]]  # prefill (L > 1), then decode (L == 1)

    def run(attn):
        cache, outs = LatentKVCache(), []
        for chunk in steps:
            outs.append(attn(chunk, cache.make_mask(chunk.shape[1]), cache))
        return outs, cache.state

    whole, whole_cache = run(model.layers[1].self_attn)
    parts = []
    for r in range(2):
        rank_model = built()
        rank_model.load_weights(params)
        summed = shard(rank_model, SimpleNamespace(rank=r, size=2))
        block = rank_model.layers[1]
        assert any(b is block and name == "self_attn" for b, name in summed)
        assert block.self_attn.n_heads == 2 and block.self_attn.k_b_proj.weight.shape[0] == 2
        outs, cache = run(block.self_attn)
        for a, b in zip(cache, whole_cache):  # the same latents and RoPE keys on every rank
            np.testing.assert_array_equal(np.array(a), np.array(b))
        parts.append(outs)
    for step, full in enumerate(whole):
        total = parts[0][step] + parts[1][step]
        np.testing.assert_allclose(np.array(total), np.array(full), atol=1e-5, rtol=1e-5)
        # Each share alone is not the whole (the test would pass with nothing split otherwise).
        assert float(mx.abs(parts[0][step] - full).max()) > 1e-3
