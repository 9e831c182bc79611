"""Mixture-of-experts and multi-head latent attention families against transformers.

Spec, per family (mixtral, qwen2_moe, deepseek_v2, deepseek_v3, glm4_moe_lite) on tiny random
checkpoints with 8 experts:
  * f32 logits within 1e-3 of transformers, one pass and chunked prefill + decode;
  * 32 greedy tokens identical;
  * a 4-bit conversion loads and runs, with the routers left in float and recorded so.
Plus: the MLA cache holds kv_lora_rank + qk_rope_head_dim values per token per layer,
and 4-bit experts are gathered by index, never dequantized as a stack.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from hf_models import add_tokenizer, make_tiny, torch_greedy, torch_logits, torch_logits_chunked

from mlxinfer.cache.kv import LatentKVCache, cache_nbytes
from mlxinfer.cache.rotating import RotatingKVCache
from mlxinfer.generation import generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.models import build_model
from mlxinfer.models.layers.mla import cache_bytes_per_token
from mlxinfer.quant.transform import quantize_model

TOL = 1e-3
IDS = [3, 17, 99, 5, 240, 8, 8, 61, 130, 2, 77, 19, 200, 45, 1, 33, 150, 9, 12, 255, 4, 60, 91, 101]

MLA = dict(
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=24,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
CASES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
    "mixtral-window6": dict(
        model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, sliding_window=6
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "qwen2_moe-norm-dense0": dict(
        model_type="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=32,
    ),
    "qwen3_moe-norm-dense1-bias": dict(
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        head_dim=16,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        attention_bias=True,
    ),
    "deepseek_v2-lite": dict(
        model_type="deepseek_v2",
        **MLA,
        q_lora_rank=None,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_shared_experts=2,
    ),
    "deepseek_v2-grouped-yarn": dict(
        model_type="deepseek_v2",
        **MLA,
        q_lora_rank=24,
        num_experts_per_tok=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        n_shared_experts=1,
        rope_parameters=YARN,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        **MLA,
        q_lora_rank=48,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    ),
    "deepseek_v3-yarn-rotate-half": dict(
        model_type="deepseek_v3",
        **MLA,
        q_lora_rank=48,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        rope_interleave=False,
        norm_topk_prob=False,
        rope_parameters={**YARN, "factor": 8.0, "mscale_all_dim": 1.0},
    ),
    # GLM-4.7-Flash: DeepSeek-V3's MLA and router under GLM's name, layers by mlp_layer_types
    "glm4_moe_lite": dict(
        model_type="glm4_moe_lite",
        **MLA,
        q_lora_rank=48,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=1.8,
        mlp_layer_types=["sparse", "dense"],
    ),
    # Granite's multipliers far from 1, so that each one counts
    "granitemoe": dict(
        model_type="granitemoe",
        num_local_experts=8,
        num_experts_per_tok=2,
        embedding_multiplier=3.0,
        attention_multiplier=0.05,
        residual_multiplier=0.4,
        logits_scaling=2.5,
    ),
    "granitemoe-top3-bias-mqa": dict(
        model_type="granitemoe",
        num_local_experts=8,
        num_experts_per_tok=3,
        num_key_value_heads=1,
        attention_bias=True,
        embedding_multiplier=2.0,
        attention_multiplier=0.1,
        residual_multiplier=0.6,
        logits_scaling=1.5,
    ),
    # GLM-4.5-Air's shape: one dense layer first, a shared expert, half of each head rotated
    "glm4_moe": dict(
        model_type="glm4_moe",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        attention_bias=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
    # GLM-4.6's q/k norm; groups, scaling, no renormalisation, a quarter of each head rotated
    "glm4_moe-qknorm-grouped": dict(
        model_type="glm4_moe",
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=2,
        first_k_dense_replace=0,
        head_dim=32,
        use_qk_norm=True,
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    ),
}


def make_tiny_moe(path, **spec):
    """make_tiny, plus noise on every 1-D parameter and buffer (norms, DeepSeek-V3's
    e_score_correction_bias) so that none sits at its neutral 0 or 1."""
    path, model = make_tiny(
        path, eos_token_id=None, **spec
    )  # no EOS: transformers' min_new_tokens would mask it
    torch.manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dim() == 1 and "inv_freq" not in name:
                t.add_(torch.randn_like(t) * (0.5 if "correction_bias" in name else 0.1))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path, torch_model = make_tiny_moe(
        tmp_path_factory.mktemp(request.param), **CASES[request.param]
    )
    model, _ = load_model(path)
    return model, torch_model


def test_full_forward_matches_transformers(pair):
    model, torch_model = pair
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


def test_chunked_prefill_then_decode_matches_transformers(pair):
    model, torch_model = pair
    chunks = [IDS[:5], IDS[5:12], IDS[12:13]] + [[t] for t in IDS[13:]]
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in chunks])
    assert cache[0].offset == len(IDS)
    assert np.abs(out - torch_logits_chunked(torch_model, chunks)).max() <= TOL
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


def test_greedy_tokens_identical(pair):
    model, torch_model = pair
    prompt = IDS[:6]
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=32, prefill_step_size=4)]
    assert ours == torch_greedy(torch_model, prompt, 32)


# ---------------------------------------------------------------------------
# 4-bit conversion

ROUTERS = {
    "mixtral": ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],
    "qwen2_moe": [
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.shared_expert_gate",
    ],
    "deepseek_v3": ["model.layers.1.mlp.gate"],  # layer 0 is dense
    "glm4_moe": ["model.layers.1.mlp.gate"],  # layer 0 is dense
    "granitemoe": ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],
    "qwen3_moe": ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_4bit_conversion_runs_with_routers_in_float(name, tmp_path):
    spec = dict(CASES[name])
    if name == "qwen2_moe":
        spec.update(moe_intermediate_size=64)  # every expert input width a multiple of the group
    if name == "deepseek_v3":
        spec.update(kv_lora_rank=64, moe_intermediate_size=64, q_lora_rank=64)
    src, torch_model = make_tiny_moe(tmp_path / "hf", **spec)
    add_tokenizer(src)
    report = convert(src, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    record = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
    assert record == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        **{r: False for r in ROUTERS[name]},
    }
    assert report["bits_per_weight"] < 7  # 4 bits + float32 scale and bias per 32

    model, _ = load_model(tmp_path / "q4")
    moe = model.layers[-1].mlp
    assert type(moe.experts.gate_up_proj).__name__ == "QuantizedSwitchLinear"
    assert type(moe.gate).__name__ == "Gate" and moe.gate.weight.dtype == mx.float32
    logits = np.array(model(mx.array([IDS]))[0])
    ref = torch_logits(torch_model, IDS)
    assert np.isfinite(logits).all()
    assert (
        np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.8
    )  # 4-bit random weights: close, not equal
    assert len([t for t, _ in generate_step(IDS[:4], model, max_tokens=8)]) == 8


# ---------------------------------------------------------------------------
# Expert reads: gathered by index, never dequantized as a whole


def many_experts_model(n_experts: int = 64):
    config = dict(
        model_type="mixtral",
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_local_experts=n_experts,
        num_experts_per_tok=2,
    )
    model = build_model(config)
    quantize_model(model, bits=4, group_size=64)
    mx.eval(model.parameters())
    return model


def test_4bit_experts_are_gathered_by_index_never_dequantized(monkeypatch):
    model = many_experts_model()
    gathered, dequantized = [], []
    real_gather, real_dequantize = mx.gather_qmm, mx.dequantize

    def gather_spy(x, w, *args, **kwargs):
        gathered.append((w.shape, kwargs["rhs_indices"].shape))
        return real_gather(x, w, *args, **kwargs)

    def dequantize_spy(w, *args, **kwargs):
        dequantized.append(w.shape)
        return real_dequantize(w, *args, **kwargs)

    monkeypatch.setattr(mx, "gather_qmm", gather_spy)
    monkeypatch.setattr(mx, "dequantize", dequantize_spy)
    cache = model.make_cache()
    mx.eval(model(mx.array([IDS[:3]]), cache))  # prefill: 3 tokens × top-2
    mx.eval(model(mx.array([[5]]), cache))  # decode
    # Two gathers (gate_up, down) per MoE layer per call, each with the routed (token, k) indices.
    assert [idx for _, idx in gathered] == [(3, 2)] * 4 + [(1, 2)] * 4
    assert all(w[0] == 64 for w, _ in gathered)
    # The only dequantize is the embedding's rows for the looked-up tokens.
    assert dequantized == [
        (1, 3, 256 * 4 // 32),
        (1, 1, 256 * 4 // 32),
    ]  # (B, tokens, packed hidden)


def test_4bit_decode_step_allocates_far_less_than_one_layers_experts():
    model = many_experts_model()
    cache = model.make_cache()
    mx.eval(model(mx.array([IDS[:3]]), cache))
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model(mx.array([[5]]), cache))
    one_layer_dequantized = 64 * 3 * 256 * 512 * 4  # 64 experts × gate, up, down, float32
    assert mx.get_peak_memory() - before < one_layer_dequantized / 100


def test_glm4_moe_checkpoint_with_its_mtp_layer_loads_the_decoder_only(tmp_path):
    """GLM-4.5 checkpoints append num_nextn_predict_layers multi-token-prediction layers
    (model.layers.<n>.*, with eh_proj, enorm, hnorm, shared_head): the decoder is the same,
    and the layer becomes the model's MTP head (tests/models/test_glm4_moe_mtp.py)."""
    path, torch_model = make_tiny_moe(tmp_path / "hf", **CASES["glm4_moe"])
    weights = mx.load(str(path / "model.safetensors"))
    n = torch_model.config.num_hidden_layers
    mtp = {
        k.replace(f"layers.{n - 1}.", f"layers.{n}."): v
        for k, v in weights.items()
        if f"layers.{n - 1}." in k
    }
    mtp[f"model.layers.{n}.eh_proj.weight"] = mx.zeros((64, 128))
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{n}.{norm}.weight"] = mx.ones((64,))
    mx.save_safetensors(str(path / "model.safetensors"), {**weights, **mtp})
    model, _ = load_model(path)
    assert len(model.layers) == n and len(model.mtp_heads) == 1
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


def test_glm4_moe_groups_that_do_not_divide_the_experts_are_a_config_error():
    from mlxinfer.errors import ConfigError

    spec = dict(CASES["glm4_moe"], hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    spec.update(num_attention_heads=4, vocab_size=256, n_group=3)
    with pytest.raises(ConfigError, match="n_group=3"):
        build_model(spec)


def test_granitemoe_experts_under_transformers_5_names_load_the_same(tmp_path):
    """Granite MoE checkpoints stack experts as block_sparse_moe.input_linear/output_linear with
    the router at router.layer; transformers 5 holds them as experts.gate_up_proj/down_proj
    and router.weight. Both load into the same fused layout."""
    path, torch_model = make_tiny_moe(tmp_path / "hf", **CASES["granitemoe"])
    weights = mx.load(str(path / "model.safetensors"))
    assert any(".block_sparse_moe.input_linear.weight" in k for k in weights)
    names = {
        "input_linear.weight": "experts.gate_up_proj",
        "output_linear.weight": "experts.down_proj",
        "router.layer.weight": "router.weight",
    }

    def v5(key):
        for old, new in names.items():
            key = key.replace(f"block_sparse_moe.{old}", f"block_sparse_moe.{new}")
        return key

    mx.save_safetensors(str(path / "model.safetensors"), {v5(k): v for k, v in weights.items()})
    model, _ = load_model(path)
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


# ---------------------------------------------------------------------------
# The latent cache


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path, torch_model = make_tiny_moe(tmp_path_factory.mktemp("ds"), **CASES["deepseek_v3"])
    return load_model(path)[0], torch_model


def test_mla_cache_holds_latent_and_rope_key_per_token(deepseek):
    model, _ = deepseek
    a = model.args
    cache = model.make_cache()
    model(mx.array([IDS[:10]]), cache)
    model(mx.array([IDS[10:11]]), cache)
    assert all(isinstance(c, LatentKVCache) for c in cache)
    itemsize = 4  # float32 model
    per_layer = (a.kv_lora_rank + a.qk_rope_head_dim) * 11 * itemsize
    assert [c.nbytes for c in cache] == [per_layer] * a.num_hidden_layers
    assert cache_nbytes(cache) == cache_bytes_per_token(a, itemsize)["latent"] * 11
    latent, rope_key = cache[0].state
    assert latent.shape == (1, 1, 11, a.kv_lora_rank) and rope_key.shape == (
        1,
        1,
        11,
        a.qk_rope_head_dim,
    )
    # What full K/V caching would take for the same model: n_heads × (qk + v) per layer.
    mha = cache_bytes_per_token(a, itemsize)["mha"]
    assert mha == a.num_hidden_layers * 4 * (16 + 8 + 24) * itemsize


def test_mla_cache_bytes_for_deepseek_v3_shape():
    class V3:
        num_hidden_layers, num_attention_heads = 61, 128
        kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim = 512, 64, 128, 128

    sizes = cache_bytes_per_token(V3, itemsize=2)
    assert sizes == {"latent": 61 * 576 * 2, "mha": 61 * 128 * 320 * 2}
    assert 71 < sizes["mha"] / sizes["latent"] < 72


def test_mla_decode_attends_over_the_latent_without_expanding_keys(deepseek, monkeypatch):
    """A one-token step takes the absorbed path; it equals the expanded one."""
    model, _ = deepseek
    attn = model.layers[0].self_attn
    cls = type(attn)
    cache = model.make_cache()
    model(mx.array([IDS[:6]]), cache)
    x = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(0))
    latent, rope_key = cache[0].state
    q = (
        attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        .reshape(1, 1, 4, -1)
        .transpose(0, 2, 1, 3)
    )
    q_nope, q_pe = mx.split(q, [attn.nope_dim], axis=-1)
    absorbed = attn._absorbed(q_nope, q_pe, latent, rope_key, None)
    expanded = attn._expanded(q_nope, q_pe, latent, rope_key, None)
    assert absorbed.shape == expanded.shape == (1, 4, 1, 24)
    np.testing.assert_allclose(np.array(absorbed), np.array(expanded), atol=1e-5)

    seen = []
    monkeypatch.setattr(cls, "_expanded", lambda self, *a: seen.append("expanded"))
    monkeypatch.setattr(
        cls,
        "_absorbed",
        lambda self, q_nope, *a: seen.append("absorbed") or mx.zeros((*q_nope.shape[:-1], 24)),
    )
    model(mx.array([[7]]), cache)
    assert set(seen) == {"absorbed"}


def test_mla_bounded_cache_and_refused_kv_bits(deepseek):
    model, torch_model = deepseek
    cache = model.make_cache(max_kv_size=64)
    assert all(isinstance(c, RotatingKVCache) for c in cache)
    out = np.concatenate(
        [np.array(model(mx.array([c]), cache)[0]) for c in (IDS[:8], IDS[8:9], IDS[9:10])]
    )
    assert np.abs(out - torch_logits(torch_model, IDS[:10])).max() <= TOL
    with pytest.raises(
        ValueError, match="kv-bits is not supported with multi-head latent attention"
    ):
        model.make_cache(kv_bits=8)


def test_latent_cache_round_trips_through_a_prompt_cache_file(deepseek, tmp_path):
    from mlxinfer.cache.prompt import load_cache, save_cache

    model, _ = deepseek
    cache = model.make_cache()
    model(mx.array([IDS[:7]]), cache)
    save_cache(tmp_path / "c.safetensors", cache)
    loaded, _ = load_cache(tmp_path / "c.safetensors")
    assert [type(c) for c in loaded] == [LatentKVCache] * len(cache)
    assert [c.offset for c in loaded] == [7] * len(cache)
    a = np.array(model(mx.array([IDS[7:8]]), cache))
    b = np.array(model(mx.array([IDS[7:8]]), loaded))
    np.testing.assert_array_equal(a, b)
