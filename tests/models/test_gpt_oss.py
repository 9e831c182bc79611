"""gpt-oss against transformers, on tiny random checkpoints.

Spec: f32 logits within 1e-3 of transformers (one pass, and chunked prefill + decode across
the sliding window), 32 greedy tokens identical, with attention sinks, biased routers and
experts, and a clamp that bites; the Hub's config form (``rope_scaling`` YaRN) too. A 4-bit
conversion runs with the routers in float. An MXFP4-stored checkpoint (``*_blocks`` +
``*_scales``, as the Hub ships gpt-oss) loads into MLX's ``mxfp4`` experts without a float
round trip and matches transformers' own dequantized load of the same files; converting it
keeps the experts MXFP4. Sinks hold in every attention path: the fused kernel, the
quantized cache's and the paged pool's (tests/batch/test_batch.py).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from hf_models import add_tokenizer, make_tiny, torch_greedy, torch_logits, torch_logits_chunked
from safetensors.numpy import load_file, save_file

from mlxinfer.generation import generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.models.layers.attention import quantized_attention

TOL = 1e-3
IDS = [3, 17, 99, 5, 240, 8, 8, 61, 130, 2, 77, 19, 200, 45, 1, 33, 150, 9, 12, 255, 4, 60, 91, 101]
CHUNKS = [IDS[:5], IDS[5:12], IDS[12:13]] + [[t] for t in IDS[13:]]
TINY = dict(
    model_type="gpt_oss",
    num_local_experts=8,
    num_experts_per_tok=2,
    head_dim=16,
    intermediate_size=32,
    sliding_window=6,
    eos_token_id=None,  # transformers' min_new_tokens would mask it
)
CASES = {
    "gpt_oss": TINY,
    # a clamp the random activations reach, top-3, a layer order of our choosing
    "gpt_oss-clamped-top3": dict(
        TINY,
        num_hidden_layers=3,
        num_experts_per_tok=3,
        swiglu_limit=0.3,
        swiglu_alpha=1.2,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
    # config.json as the Hub's checkpoints write it (transformers 4: rope_theta + rope_scaling)
    "gpt_oss-v4": dict(TINY, config_form="v4"),
}


def make_gpt_oss(path, **spec):
    """make_tiny with sinks far from 0 (random init leaves them near it), so they count."""
    path, model = make_tiny(path, perturb_vectors=True, **spec)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.5)
    config = (path / "config.json").read_text()
    model.save_pretrained(path)
    (path / "config.json").write_text(config)  # keep make_tiny's form (v4)
    return path, model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path, torch_model = make_gpt_oss(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    model, _ = load_model(path)
    return model, torch_model


def test_full_forward_matches_transformers(pair):
    model, torch_model = pair
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


def test_chunked_prefill_then_decode_matches_transformers(pair):
    model, torch_model = pair
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in CHUNKS])
    assert cache[0].offset == len(IDS)
    assert np.abs(out - torch_logits_chunked(torch_model, CHUNKS)).max() <= TOL


def test_greedy_tokens_identical(pair):
    model, torch_model = pair
    prompt = IDS[:6]
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=32, prefill_step_size=4)]
    assert ours == torch_greedy(torch_model, prompt, 32)


def test_hub_config_reads_yarn_and_layer_kinds(tmp_path):
    """The Hub's config.json form: rope_theta 150000 with YaRN in rope_scaling, and no
    layer_types (transformers' default: even layers slide)."""
    path, _ = make_gpt_oss(tmp_path, **{**TINY, "config_form": "v4"})
    config = json.loads((path / "config.json").read_text())
    del config["layer_types"]
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(path)
    assert model.args.layer_types == ["sliding_attention", "full_attention"]
    assert model.args.rope_theta == 150000.0 and model.args.rope_scaling["rope_type"] == "yarn"
    assert [type(c).__name__ for c in model.make_cache()] == ["RotatingKVCache", "KVCache"]


def test_4bit_conversion_runs_with_routers_in_float(tmp_path):
    src, torch_model = make_gpt_oss(tmp_path / "hf", **TINY)
    add_tokenizer(src)
    convert(src, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    record = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
    routers = {f"model.layers.{i}.mlp.router": False for i in range(2)}
    assert record == {"group_size": 32, "bits": 4, "mode": "affine", **routers}
    model, _ = load_model(tmp_path / "q4")
    experts = model.layers[0].mlp.experts
    assert type(experts.gate_up_proj).__name__ == "QuantizedSwitchLinear"
    assert experts.gate_up_proj.bias.shape == (8, 64)  # the experts' own biases stay float
    logits = np.array(model(mx.array([IDS]))[0])
    assert np.isfinite(logits).all()
    assert np.corrcoef(logits.ravel(), torch_logits(torch_model, IDS).ravel())[0, 1] > 0.8
    assert len([t for t, _ in generate_step(IDS[:4], model, max_tokens=8)]) == 8


# ---------------------------------------------------------------------------
# MXFP4 experts, as the Hub stores gpt-oss

# E2M1, the OCP MX FP4 element: code i -> value (codes 8-15 are the negatives)
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., rows, cols) floats -> OpenAI's layout: blocks (..., rows, cols/32, 16) uint8 (two
    codes a byte, the first in the low nibble) and scales (..., rows, cols/32) uint8 exponents
    (bias 127), each group's largest value within FP4's ±6 after its scale."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0))
    codes = np.abs((groups / 2.0**exp)[..., None] - FP4).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # contiguous: safetensors.numpy writes a strided array's memory as if it were not
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exp[..., 0] + 127).astype(np.uint8))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """An MXFP4 checkpoint written from a float one, and transformers' dequantized load of it."""
    root = tmp_path_factory.mktemp("mxfp4")
    src, _ = make_gpt_oss(root / "float", **TINY)
    out = {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (E, in, out)
            out[f"{key}_blocks"], out[f"{key}_scales"] = mxfp4_encode(value.swapaxes(-1, -2))
        else:
            out[key] = value
    dst = root / "mxfp4"
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(config))
    add_tokenizer(dst)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    return dst, out, reference


def test_mxfp4_experts_load_as_stored_and_match_transformers(mxfp4):
    path, stored, reference = mxfp4
    model, _ = load_model(path)
    layer = model.layers[0].mlp.experts.gate_up_proj
    assert type(layer).__name__ == "QuantizedSwitchLinear" and layer.mode == "mxfp4"
    # The file's bytes, not a float round trip: gate rows (even) then up rows (odd).
    blocks = stored["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    rows = np.concatenate([blocks[:, 0::2], blocks[:, 1::2]], axis=1).reshape(8, 64, -1)
    assert np.array_equal(np.array(layer.weight).view(np.uint8), rows)
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(reference, IDS)).max() <= TOL
    prompt = IDS[:6]
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=16, prefill_step_size=4)]
    assert ours == torch_greedy(reference, prompt, 16)


def test_converting_mxfp4_keeps_the_experts_mxfp4(mxfp4, tmp_path):
    path, _, reference = mxfp4
    convert(path, tmp_path / "mlx", dtype="float32")
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert "quantization_config" not in config
    model, _ = load_model(tmp_path / "mlx")
    assert model.layers[1].mlp.experts.down_proj.mode == "mxfp4"
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(reference, IDS)).max() <= TOL

    # -q: the rest affine 4-bit, the experts still MXFP4, each recorded
    convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    record = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
    assert record["mode"] == "affine"
    assert record["model.layers.0.mlp.experts.gate_up_proj"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "mxfp4",
    }
    model, _ = load_model(tmp_path / "q4")
    assert model.layers[0].mlp.experts.gate_up_proj.mode == "mxfp4"
    assert model.layers[0].self_attn.q_proj.mode == "affine"
    assert np.isfinite(np.array(model(mx.array([IDS]))[0])).all()


# ---------------------------------------------------------------------------
# Sinks in the quantized cache's attention


def test_quantized_attention_with_sinks_is_attention_over_the_dequantized_keys():
    """quantized_attention with a sink per head equals mx.fast's kernel with the same sinks over
    the keys and values the cache holds (dequantized): 6 query heads on 2 kv heads, causal."""
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 6, 5, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((1, 2, 9, 32)).astype(np.float32)) for _ in range(2))
    sinks = mx.array(rng.standard_normal(6).astype(np.float32) * 2)
    kq, vq = (mx.quantize(a, group_size=32, bits=8) for a in (k, v))
    out = quantized_attention(
        q, kq, vq, scale=0.2, mask="causal", group_size=32, bits=8, sinks=sinks
    )
    kd, vd = (mx.dequantize(*a, group_size=32, bits=8) for a in (kq, vq))
    expected = mx.fast.scaled_dot_product_attention(
        q, kd, vd, scale=0.2, mask="causal", sinks=sinks
    )
    without = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.2, mask="causal")
    assert np.abs(np.array(out - expected)).max() <= 1e-5
    assert np.abs(np.array(out - without)).max() > 1e-2  # the sinks count
