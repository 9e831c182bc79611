"""Qwen3-Next and Qwen3.5 against transformers, on tiny random checkpoints.

Spec: f32 logits within 1e-3 of transformers (one pass, and chunked prefill + decode, which
carries the Gated DeltaNet's conv inputs and recurrent state in a ``StateCache``), 32 greedy
tokens identical, with partial RoPE, the attention's output gate, grouped value heads and
the shared-expert MoE; a prompt longer than the recurrence's chunk. The chunked recurrence
equals the token-by-token one (the rule written out). A 4-bit conversion runs with the
routers in float. The state's bytes are its arithmetic size and do not grow with the context.
Qwen3.5 (dense and MoE) differs in its Gated DeltaNet's projections; its image-text
checkpoints run their language model.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny, torch_greedy, torch_logits, torch_logits_chunked

from mlxinfer.cache.kv import StateCache
from mlxinfer.generation import generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.models.layers.gated_delta import gated_delta_chunked, gated_delta_step

TOL = 1e-3
IDS = [3, 17, 99, 5, 240, 8, 8, 61, 130, 2, 77, 19, 200, 45, 1, 33, 150, 9, 12, 255, 4, 60, 91, 101]
CHUNKS = [IDS[:5], IDS[5:12], IDS[12:13]] + [[t] for t in IDS[13:]]
TINY = dict(
    model_type="qwen3_next",
    head_dim=16,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    eos_token_id=None,  # transformers' min_new_tokens would mask it
)
DENSE = {
    k: v
    for k, v in TINY.items()
    if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    and k != "shared_expert_intermediate_size"
}
CASES = {
    "qwen3_next": TINY,
    "qwen3_5_text": dict(DENSE, model_type="qwen3_5_text"),
    "qwen3_5_moe_text": dict(TINY, model_type="qwen3_5_moe_text"),
    # a dense layer, equal key and value heads, wider value heads, conv width 3, and the layer
    # kinds from full_attention_interval as transformers derives them
    "qwen3_next-dense1-interval2": dict(
        TINY,
        layer_types=None,
        full_attention_interval=2,
        mlp_only_layers=[1],
        linear_num_value_heads=2,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=3,
        norm_topk_prob=False,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    spec = {k: v for k, v in CASES[request.param].items() if v is not None}
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp(request.param), perturb_vectors=True, **spec
    )
    model, _ = load_model(path)
    return model, torch_model


def test_layer_kinds_follow_the_config(pair):
    model, torch_model = pair
    kinds = torch_model.config.layer_types
    assert [layer.is_linear for layer in model.layers] == [k == "linear_attention" for k in kinds]
    assert [isinstance(c, StateCache) for c in model.make_cache()] == [
        k == "linear_attention" for k in kinds
    ]


def test_full_forward_matches_transformers(pair):
    model, torch_model = pair
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


def test_chunked_prefill_then_decode_matches_transformers(pair):
    model, torch_model = pair
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in CHUNKS])
    assert all(c.offset == len(IDS) for c in cache)
    assert np.abs(out - torch_logits_chunked(torch_model, CHUNKS)).max() <= TOL


def test_greedy_tokens_identical(pair):
    model, torch_model = pair
    prompt = IDS[:6]
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=32, prefill_step_size=4)]
    assert ours == torch_greedy(torch_model, prompt, 32)


def test_a_prompt_longer_than_the_recurrence_chunk(pair):
    """150 tokens: two full chunks of 64 and a padded one, in one pass and in prefill steps."""
    model, torch_model = pair
    ids = np.random.default_rng(0).integers(0, 256, 150).tolist()
    ref = torch_logits(torch_model, ids)
    assert np.abs(np.array(model(mx.array([ids]))[0]) - ref).max() <= TOL
    cache = model.make_cache()
    steps = [ids[:100], ids[100:149], ids[149:]]
    out = np.concatenate([np.array(model(mx.array([s]), cache)[0]) for s in steps])
    assert np.abs(out - ref).max() <= TOL


def test_the_chunked_recurrence_is_the_token_by_token_rule():
    """gated_delta_chunked over 37 tokens in chunks of 8 (a padded last one), from a nonzero
    state, equals 37 steps of the rule S <- e^g S + k beta (v - S^T k)^T, o = S^T q."""
    rng = np.random.default_rng(0)
    B, H, L, Dk, Dv = 2, 3, 37, 8, 5

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(B, H, L, Dk), normal(B, H, L, Dk), normal(B, H, L, Dv)
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    g = -mx.abs(normal(B, H, L)) * 0.3
    beta = mx.sigmoid(normal(B, H, L))
    state = normal(B, H, Dk, Dv) * 0.1
    out, final = gated_delta_chunked(q, k, v, g, beta, state, chunk=8)
    s, expected = state, []
    for t in range(L):
        o, s = gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[..., t], beta[..., t], s)
        expected.append(o)
    assert np.abs(np.array(out - mx.stack(expected, axis=2))).max() <= 1e-4
    assert np.abs(np.array(final - s)).max() <= 1e-4


def test_state_cache_bytes_are_fixed_by_the_shapes(pair):
    model, _ = pair
    args = model.args
    cache = model.make_cache()
    model(mx.array([IDS[:5]]), cache)
    conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim + (
        args.linear_num_value_heads * args.linear_value_head_dim
    )
    expected = 4 * (
        (args.linear_conv_kernel_dim - 1) * conv_dim
        + args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim
    )
    states = [c for c in cache if isinstance(c, StateCache)]
    assert [c.nbytes for c in states] == [expected] * len(states)
    for t in IDS[5:]:
        model(mx.array([[t]]), cache)
    assert [c.nbytes for c in states] == [expected] * len(states)


def test_4bit_conversion_runs_with_routers_in_float(tmp_path):
    src, torch_model = make_tiny(tmp_path / "hf", perturb_vectors=True, **TINY)
    add_tokenizer(src)
    convert(src, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    record = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
    routers = {
        f"model.layers.{i}.mlp.{name}": False
        for i in range(4)
        for name in ("gate", "shared_expert_gate")
    }
    assert record == {"group_size": 32, "bits": 4, "mode": "affine", **routers}
    model, _ = load_model(tmp_path / "q4")
    assert type(model.layers[0].linear_attn.in_proj_qkvz).__name__.endswith("QuantizedLinear")
    logits = np.array(model(mx.array([IDS]))[0])
    ref = torch_logits(torch_model, IDS)
    assert np.isfinite(logits).all()
    # Four layers of several 4-bit projections each on random weights: close, not equal
    # (measured 0.68); 8 bits leave the same path nearly exact.
    assert np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.5
    assert len([t for t, _ in generate_step(IDS[:4], model, max_tokens=8)]) == 8
    convert(src, tmp_path / "q8", quantize=True, bits=8, group_size=32)
    model, _ = load_model(tmp_path / "q8")
    logits = np.array(model(mx.array([IDS]))[0])
    assert np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.99


def test_a_qwen3_5_image_text_checkpoint_matches_on_text(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (model_type qwen3_5, text_config, a vision
    tower under model.visual) loads with its tower (models/qwen3_5_vl.py; images:
    tests/vision/test_qwen3_5_vl.py) and matches transformers' whole model on text, with and
    without the cache."""
    import torch
    import transformers

    torch.manual_seed(0)
    text = {k: v for k, v in DENSE.items() if k != "model_type"}
    text.update(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    text.update(num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    config = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
        ),
    )
    torch_model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for t in torch_model.parameters():
            t.add_(torch.randn_like(t) * (0.1 if t.dim() == 1 else 0.05))
    torch_model.save_pretrained(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    assert type(model).__module__ == "mlxinfer.models.qwen3_5_vl"
    with torch.no_grad():
        expected = torch_model(torch.tensor([IDS])).logits[0].float().numpy()
    assert np.abs(np.array(model(mx.array([IDS]))[0]) - expected).max() <= TOL
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in CHUNKS])
    assert np.abs(out - expected).max() <= TOL


def test_a_qwen3_5_moe_config_without_a_dense_intermediate_size_loads(tmp_path):
    """Qwen3.5-MoE's configs name no ``intermediate_size`` (transformers' Qwen3_5MoeTextConfig
    has none; every block has experts): such a checkpoint loads and matches transformers."""
    spec = dict(CASES["qwen3_5_moe_text"])
    path, torch_model = make_tiny(tmp_path / "m", perturb_vectors=True, **spec)
    config = json.loads((path / "config.json").read_text())
    config.pop("intermediate_size", None)
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(path)
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL
