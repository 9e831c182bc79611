"""Tensor parallelism's split of the hybrid families' layers (mlxinfer/distributed/recurrent.py,
and an attention with an output gate), without ranks.

LFM2's short convolution splits by channels, Gated DeltaNet (Qwen3-Next, Qwen3.5) by key
heads, Qwen3-Next's output-gated attention by query heads (each head's [queries | gate] rows
together). Simulated ranks' shares, run in one process each with its own cache, must add up to
the whole layer's output, and each rank's recurrent state must be its slice of the whole
layer's. The two-rank launches against transformers are in tests/distributed/test_distributed_hybrid.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_distributed_experts import BASE

from mlxinfer.cache.kv import KVCache, StateCache
from mlxinfer.distributed.placement import quantized_split_reason, tensor_split_reason
from mlxinfer.distributed.tensor import shard
from mlxinfer.models import build_model

# A recurrent layer (LFM2's short convolution, Gated DeltaNet) or an attention with an output
# gate, each beside an MLP: layer 0 recurrent, layer 1 attention.
GATED_DELTA = dict(
    layer_types=["linear_attention", "full_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
)
HYBRID = {
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_bias=True, block_multiple_of=16),
    "qwen3_next": dict(
        GATED_DELTA,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    ),
    "qwen3_5_text": GATED_DELTA,  # separate in_proj_qkv / _z / _b / _a
}


def _mixer(block) -> str:
    return next(name for name in ("conv", "linear_attn", "self_attn") if name in block)


def _state_share(whole: mx.array, axis: int, parts: list[int], r: int, s: int) -> mx.array:
    """Rank r's share of a whole layer's state: its slice of each of ``parts`` along ``axis``."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    index = [slice(None)] * whole.ndim
    shares = []
    for a, n in zip(starts, parts):
        index[axis] = slice(a + r * n // s, a + (r + 1) * n // s)
        shares.append(whole[tuple(index)])
    return mx.concatenate(shares, axis=axis)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("family", sorted(HYBRID))
def test_the_hybrid_shares_add_up_to_the_whole_layer(family, quantized):
    """Each simulated rank runs its share of a recurrent layer (LFM2's conv channels, Gated
    DeltaNet's key heads) and of an output-gated attention (Qwen3-Next's), each with its own
    cache: a prefill, then two decode steps. The shares sum to the whole layer's output at
    every step, and each rank's recurrent state is its slice of the whole layer's state."""
    config = {"model_type": family, **BASE, **HYBRID[family]}
    if quantized:  # 4-bit in groups of 32: each rank's out_proj/o_proj inputs whole groups
        config.update(hidden_size=64, head_dim=16)
        if family != "lfm2":
            config.update(linear_value_head_dim=16)

    def built():
        model = build_model(config)
        if quantized:
            for layer in model.layers:
                nn.quantize(layer[_mixer(layer)], 32, 4)
        return model

    mx.random.seed(4)
    model = built()
    params = [  # random vectors (norms near 1, biases, A_log, dt_bias) and quantized codes
        (
            k,
            mx.random.randint(0, 1 << 31, v.shape).astype(mx.uint32)
            if v.dtype == mx.uint32
            else mx.random.normal(v.shape) * 0.01  # weights of about 0.1 from codes 0-15
            if k.endswith(("scales", "biases"))
            else mx.random.normal(v.shape) * 0.1 + (k.endswith("norm.weight"))
            if v.ndim == 1
            else v,
        )
        for k, v in tree_flatten(model.parameters())
    ]
    model.load_weights(params)
    x = mx.random.normal((2, 9, config["hidden_size"]))
    steps = [x[:, :7], x[:, 7:8], x[:, 8:9]]  # prefill (L > 1), then decode (L == 1)

    def run(block):
        mixer = block[_mixer(block)]
        if "self_attn" in block:
            cache = KVCache()
            call = lambda h: mixer(h, cache.make_mask(h.shape[1]), cache)  # noqa: E731
        else:
            cache = StateCache(1 if family == "lfm2" else 2)
            call = lambda h: mixer(h, cache)  # noqa: E731
        return [call(h) for h in steps], cache.state

    for layer in range(2):
        whole, whole_state = run(model.layers[layer])
        parts = []
        for r in range(2):
            rank_model = built()
            rank_model.load_weights(params)
            summed = shard(rank_model, SimpleNamespace(rank=r, size=2))
            block = rank_model.layers[layer]
            assert any(b is block and name == _mixer(block) for b, name in summed)
            outs, state = run(block)
            if family == "lfm2" and layer == 0:  # (B, K - 1, channels)
                expected = [_state_share(whole_state[0], 2, [config["hidden_size"]], r, 2)]
            elif layer == 0:  # conv inputs (B, K - 1, [q | k | v]); S (B, n_v, Dk, Dv)
                net = model.layers[0].linear_attn
                qkv = [net.key_dim, net.key_dim, net.value_dim]
                expected = [
                    _state_share(whole_state[0], 2, qkv, r, 2),
                    _state_share(whole_state[1], 1, [net.n_v], r, 2),
                ]
            else:  # keys and values (B, n_kv, T, D): this rank's KV heads
                expected = [_state_share(a, 1, [a.shape[1]], r, 2) for a in whole_state]
            for a, b in zip(state, expected, strict=True):
                np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)
            parts.append(outs)
        for step, full in enumerate(whole):
            total = parts[0][step] + parts[1][step]
            np.testing.assert_allclose(np.array(total), np.array(full), atol=1e-5, rtol=1e-5)
            # Each share alone is not the whole (the test would pass with nothing split).
            assert float(mx.abs(parts[0][step] - full).max()) > 1e-3


@pytest.mark.parametrize(
    "family, overrides, size, reason",
    [
        ("lfm2", {}, 2, None),
        ("qwen3_next", {}, 2, None),  # an output-gated attention, Gated DeltaNet, MoE
        ("qwen3_5_text", {}, 2, None),
        (
            "lfm2",
            dict(hidden_size=30, head_dim=8, num_key_value_heads=4),
            4,
            "30 conv channels do not divide over 4 ranks",
        ),
        (
            "qwen3_next",
            dict(num_key_value_heads=4),
            4,
            "2 linear-attention key heads do not divide over 4 ranks",
        ),
        (
            "qwen3_next",
            dict(layer_types=["full_attention"] * 2),
            4,
            "2 KV heads do not divide over 4 ranks",
        ),
    ],
)
def test_which_hybrid_layers_split(family, overrides, size, reason):
    config = {"model_type": family, **BASE, **HYBRID[family], **overrides}
    assert tensor_split_reason(build_model(config), size) == reason


def test_a_recurrent_layers_quantized_out_proj_splits_at_a_group_boundary():
    sizes = dict(hidden_size=64, intermediate_size=96)  # the MLP's 64 hidden units: 2 groups
    model = build_model({"model_type": "lfm2", **BASE, **HYBRID["lfm2"], **sizes})
    record = {"group_size": 32, "bits": 4}
    assert quantized_split_reason(model, record, 2) is None
    assert quantized_split_reason(model, record, 4) == (
        "layer 0's model.layers.0.conv.out_proj: 64 quantized inputs in groups of 32 do not "
        "split into whole groups over 4 ranks"
    )
