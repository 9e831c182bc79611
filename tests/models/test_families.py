"""Every model family against transformers, on tiny random checkpoints.

Spec, per family: f32 logits within 1e-3 of transformers on the same weights,
over one full pass and over chunked prefill + token-by-token decode (compared
with transformers' own cached forward); 32 greedy tokens identical; a 4-bit
conversion loads and gives finite logits. Norm weights and biases are
perturbed too (``perturb_vectors``), so (1 + w) norms and biases count. Sliding
windows are shorter than the test sequence, so the rotating caches rotate.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny, torch_greedy, torch_logits, torch_logits_chunked

from mlxinfer.generation import generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model

TOL = 1e-3
IDS = [3, 17, 99, 5, 240, 8, 8, 61, 130, 2, 77, 19, 200, 45, 1, 33, 150, 9, 12, 255, 4, 60, 91, 101]
CHUNKS = [IDS[:5], IDS[5:12], IDS[12:13]] + [[t] for t in IDS[13:]]

CASES = {
    "qwen2": dict(model_type="qwen2"),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True, num_key_value_heads=1),
    # transformers: layers i >= max_window_layers slide when use_sliding_window
    "qwen2-sliding": dict(
        model_type="qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen3-bias-headdim32": dict(model_type="qwen3", head_dim=32, attention_bias=True),
    "gemma": dict(model_type="gemma", head_dim=16),
    "gemma-mqa-gelu": dict(
        model_type="gemma", head_dim=32, num_key_value_heads=1, hidden_act="gelu"
    ),
    # small caps so that tanh really bends the logits
    "gemma2": dict(
        model_type="gemma2",
        head_dim=16,
        num_hidden_layers=3,
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
    ),
    "gemma2-defaults": dict(model_type="gemma2", head_dim=16, sliding_window=8),
    "gemma3_text": dict(
        model_type="gemma3_text",
        head_dim=16,
        num_hidden_layers=6,
        sliding_window=6,
        query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "gemma3_text-softcap": dict(
        model_type="gemma3_text",
        head_dim=16,
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=2.0,
        final_logit_softcapping=4.0,
    ),
    "phi3": dict(model_type="phi3", pad_token_id=0, eos_token_id=2),
    "phi3-window": dict(model_type="phi3", pad_token_id=0, eos_token_id=2, sliding_window=7),
    "phi3-longrope-partial": dict(
        model_type="phi3",
        pad_token_id=0,
        eos_token_id=2,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [2.0, 2.5, 3.0, 3.5],
            "partial_rotary_factor": 0.5,
        },
    ),
    "gpt2": dict(model_type="gpt2"),
    "gpt2-layer-scaled-relu": dict(
        model_type="gpt2",
        scale_attn_by_inverse_layer_idx=True,
        n_inner=96,
        activation_function="relu",
    ),
    "bloom": dict(model_type="bloom"),
    "bloom-6heads-postln": dict(
        model_type="bloom", hidden_size=48, n_head=6, apply_residual_connection_post_layernorm=True
    ),
    "xglm": dict(model_type="xglm", ffn_dim=128),
    # every 2nd layer without RoPE (transformers derives the list from the interval)
    "smollm3": dict(
        model_type="smollm3",
        num_hidden_layers=4,
        no_rope_layer_interval=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # multipliers far from 1, so that each one counts
    "granite": dict(
        model_type="granite",
        embedding_multiplier=3.0,
        attention_multiplier=0.05,
        residual_multiplier=0.4,
        logits_scaling=2.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "olmo2": dict(model_type="olmo2", pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "olmo2-gqa": dict(
        model_type="olmo2", num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2
    ),
    # three sliding layers, then a full one (transformers' default layer_types); YaRN on
    # the full layers only
    "olmo3": dict(
        model_type="olmo3",
        num_hidden_layers=4,
        sliding_window=6,
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 5e5,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "attention_factor": 1.3,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "olmo3-layer-types": dict(
        model_type="olmo3",
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Llama 4's query scaling from original_max_position_embeddings = 8 on (the test's 24
    # positions cross it twice); β larger than the checkpoints' 0.1 so that it counts
    "ministral3": dict(
        model_type="ministral3",
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 16.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5,
        },
    ),
    "smollm3-untied": dict(
        model_type="smollm3",
        no_rope_layers=[0, 1],
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def _drop_layer_types(cfg):
    """transformers-4 configs carry no layer_types: the family derives them."""
    cfg.pop("layer_types")
    return cfg


def _olmo3_v4(cfg):
    """OLMo 3's transformers-4 config: one rope_theta, rope_scaling (for the full layers)."""
    full = dict(cfg.pop("rope_parameters")["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    return _drop_layer_types(cfg)


def _gemma3_v4(cfg):
    """Gemma 3's transformers-4 config: rope_theta + rope_scaling (global), rope_local_base_freq, a pattern."""
    by_kind = cfg.pop("rope_parameters")
    full = dict(by_kind["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    cfg["rope_local_base_freq"] = by_kind["sliding_attention"]["rope_theta"]
    cfg["sliding_window_pattern"] = cfg.pop("_sliding_window_pattern")
    return _drop_layer_types(cfg)


# config.json rewritten after saving, to the older forms the same weights were published with
CASES.update(
    {
        "qwen2-sliding-v4": dict(
            CASES["qwen2-sliding"], config_form="v4", rewrite=_drop_layer_types
        ),
        "gemma2-v4": dict(CASES["gemma2"], config_form="v4", rewrite=_drop_layer_types),
        "gemma3_text-v4": dict(CASES["gemma3_text"], rewrite=_gemma3_v4),
        "olmo3-v4": dict(CASES["olmo3"], rewrite=_olmo3_v4),
    }
)
# LongRoPE switches factors once a pass reaches original_max_position_embeddings, so a
# full pass differs from prefill + decode there (as in transformers' forward). transformers'
# generate() also drops its cache when the sequence first crosses the switch and recomputes
# it with the long factors; mlxinfer keeps the cache, so greedy decoding is compared from a
# prompt already past the switch.
LENGTH_DEPENDENT = {"phi3-longrope-partial"}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    spec = dict(CASES[request.param])
    rewrite = spec.pop("rewrite", None)
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp(request.param), perturb_vectors=True, **spec
    )
    if rewrite is not None:
        config = path / "config.json"
        config.write_text(json.dumps(rewrite(json.loads(config.read_text()))))
    model, _ = load_model(path)
    return request.param, path, model, torch_model


def test_full_forward_matches_transformers(pair):
    _, _, model, torch_model = pair
    ref = torch_logits(torch_model, IDS)
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - ref).max() <= TOL


def test_chunked_prefill_then_decode_matches_transformers(pair):
    name, _, model, torch_model = pair
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in CHUNKS])
    assert cache[0].offset == len(IDS)
    assert np.abs(out - torch_logits_chunked(torch_model, CHUNKS)).max() <= TOL
    if name not in LENGTH_DEPENDENT:
        assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


def test_greedy_tokens_identical(pair):
    name, _, model, torch_model = pair
    # A prompt past the switch, fed in chunks of 4 that each stay below it: every chunk still
    # rotates as transformers' one forward over the prompt does (prompt_reach).
    prompt, step = (IDS[:18], 4) if name in LENGTH_DEPENDENT else (IDS[:6], 4)
    ref = torch_greedy(torch_model, prompt, 32)
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=32, prefill_step_size=step)]
    assert ours == ref


def test_4bit_conversion_loads_and_runs(pair, tmp_path):
    _, path, _, _ = pair
    add_tokenizer(path)
    report = convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    model, config = load_model(tmp_path / "q4")
    assert config["quantization"]["bits"] == 4
    assert report["bits_per_weight"] < 32  # f32 checkpoint: some layers went 4-bit
    logits = model(mx.array([IDS]))
    assert np.isfinite(np.array(logits)).all()
    cache = model.make_cache()
    for c in CHUNKS:
        assert np.isfinite(np.array(model(mx.array([c]), cache))).all()


def test_gpt2_keeps_position_table_in_float(tmp_path):
    path, _ = make_tiny(tmp_path / "hf", model_type="gpt2")
    add_tokenizer(path)
    convert(path, tmp_path / "q4", quantize=True, group_size=32)
    record = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
    assert record["transformer.wpe"] is False
    assert "transformer.wte" not in record  # the embedding (and tied head) is quantized


def test_float16_weights_stay_close_to_float32(pair):
    _, path, model, _ = pair
    half, _ = load_model(path, dtype=mx.float16)
    out = np.array(half(mx.array([IDS]))[0].astype(mx.float32))
    assert np.abs(out - np.array(model(mx.array([IDS]))[0])).max() < 0.05


# --- cache choices ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    spec = {
        **CASES["gemma3_text"],
        "head_dim": 32,
    }  # quantized caches need groups of 32 along head_dim
    path, torch_model = make_tiny(tmp_path_factory.mktemp("gemma3"), perturb_vectors=True, **spec)
    return load_model(path)[0], torch_model


def test_local_layers_rotate_and_global_layers_follow_the_flags(gemma3):
    from mlxinfer.cache.kv import KVCache
    from mlxinfer.cache.quantized import QuantizedKVCache
    from mlxinfer.cache.rotating import RotatingKVCache

    model, torch_model = gemma3
    kinds = model.args.layer_types
    choices = [
        ({}, KVCache),
        ({"kv_bits": 8, "kv_group_size": 32}, QuantizedKVCache),
        ({"max_kv_size": 64}, RotatingKVCache),
    ]
    for flags, full_kind in choices:
        cache = model.make_cache(**flags)
        for kind, c in zip(kinds, cache):
            assert isinstance(c, RotatingKVCache if kind == "sliding_attention" else full_kind)
            if kind == "sliding_attention":
                assert c.max_size == model.args.sliding_window and c.keep == 0
        out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in CHUNKS])
        tol = 2e-2 if flags.get("kv_bits") else TOL
        assert np.abs(out - torch_logits_chunked(torch_model, CHUNKS)).max() <= tol, flags


def test_unsupported_cache_choices_are_clear_errors(tmp_path):
    gemma2, _ = load_model(make_tiny(tmp_path / "g2", **CASES["gemma2"])[0])
    with pytest.raises(ValueError, match="soft-capping"):
        gemma2.make_cache(kv_bits=8)
    bloom, _ = load_model(make_tiny(tmp_path / "bloom", model_type="bloom")[0])
    for flags in ({"kv_bits": 8}, {"max_kv_size": 64}):
        with pytest.raises(ValueError, match="ALiBi"):
            bloom.make_cache(**flags)


def test_qwen2_window_counts_only_with_use_sliding_window():
    from mlxinfer.models import build_model

    config = dict(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=256,
        sliding_window=131072,
        max_window_layers=1,
    )
    assert (
        build_model({**config, "use_sliding_window": False}).args.layer_types
        == ["full_attention"] * 3
    )
    assert build_model({**config, "use_sliding_window": True}).args.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ]


def test_generate_runs_end_to_end_on_every_family(pair):
    """The public API on each family: token-id prompt in, text out."""
    import mlxinfer
    from mlxinfer.tokenization import Tokenizer

    _, path, model, _ = pair
    add_tokenizer(path)
    text = mlxinfer.generate(model, Tokenizer.from_dir(path), IDS[:6], max_tokens=8)
    assert isinstance(text, str)


@pytest.mark.parametrize("model_type", ["gpt2", "bloom"])
def test_checkpoints_saved_without_the_transformer_prefix(tmp_path, model_type):
    """openai-community/gpt2 and bigscience/bloom-* were saved from the bare model: no "transformer."
    prefix, and GPT-2's carry its causal-mask buffers."""
    path, torch_model = make_tiny(tmp_path / "hf", model_type=model_type, perturb_vectors=True)
    weights = mx.load(str(path / "model.safetensors"))
    legacy = {k.removeprefix("transformer."): v for k, v in weights.items()}
    if model_type == "gpt2":
        legacy.update({f"h.{i}.attn.bias": mx.ones((1, 1, 8, 8)) for i in range(2)})
    mx.save_safetensors(str(path / "model.safetensors"), legacy)
    model, _ = load_model(path)
    assert np.abs(np.array(model(mx.array([IDS]))[0]) - torch_logits(torch_model, IDS)).max() <= TOL


def test_gemma_embedding_scale_is_rounded_to_the_weight_dtype_first():
    from mlxinfer.models.base import scaled_embedding

    # transformers casts sqrt(3072) = 55.43 to the weights' dtype: 55.5 in bfloat16
    assert scaled_embedding(mx.ones((1,), mx.bfloat16), 3072**0.5).item() == 55.5
    assert abs(scaled_embedding(mx.ones((1,)), 3072**0.5).item() - 3072**0.5) < 1e-5


def test_gemma_float16_residual_add_clips_instead_of_overflowing():
    from mlxinfer.models.gemma2 import residual_add

    big = mx.array([60000.0, -60000.0, 1.5], dtype=mx.float16)
    out = residual_add(big, big)
    assert out.dtype == mx.float16
    assert np.array(out.astype(mx.float32)).tolist() == [65504.0, -65504.0, 3.0]
    assert np.isinf(np.array((big + big).astype(mx.float32))[0])  # what a plain add does


def test_a_multimodal_gemma3_checkpoint_runs_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (model_type gemma3, text_config, a vision
    tower): it loads with its tower (tests/vision/test_gemma3_vlm.py runs images) and matches
    transformers' whole model on text, with and without the cache; `convert` keeps the tower;
    without the tower's weights its language model loads alone."""
    import torch
    import transformers
    from hf_models import TINY

    torch.manual_seed(0)
    text = {k: v for k, v in TINY.items()}
    text.update(
        head_dim=16,
        num_hidden_layers=3,
        sliding_window=6,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**text),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
    )
    torch_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for t in torch_model.parameters():
            if t.dim() == 1:
                t.add_(torch.randn_like(t) * 0.1)  # norms away from their neutral value
    torch_model.save_pretrained(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    assert type(model).__module__ == "mlxinfer.models.gemma3"
    with torch.no_grad():
        expected = torch_model(torch.tensor([IDS])).logits[0].float().numpy()
    assert np.abs(np.array(model(mx.array([IDS]))[0]) - expected).max() <= TOL
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in CHUNKS])
    assert np.abs(out - expected).max() <= TOL
    add_tokenizer(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "text", dtype="float32")
    written = json.loads((tmp_path / "text" / "config.json").read_text())
    assert written["model_type"] == "gemma3" and "vision_config" in written
    again, _ = load_model(tmp_path / "text")
    assert type(again).__module__ == "mlxinfer.models.gemma3"
    assert np.abs(np.array(again(mx.array([IDS]))[0]) - expected).max() <= TOL
    # A checkpoint that kept the config but not the tower (a text-only export) runs its text.
    from safetensors.numpy import load_file, save_file

    weights = load_file(tmp_path / "hf" / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "vision_tower" not in k and "projector" not in k},
        tmp_path / "hf" / "model.safetensors",
        metadata={"format": "pt"},
    )
    logged = []
    text_only, _ = load_model(tmp_path / "hf", log=logged.append)
    assert "no vision tower" in logged[0]
    assert np.abs(np.array(text_only(mx.array([IDS]))[0]) - expected).max() <= TOL


@pytest.mark.parametrize("text_type", ["mistral", "ministral3"])
def test_a_multimodal_mistral3_checkpoint_runs_its_language_model(tmp_path, text_type):
    """A Mistral3ForConditionalGeneration checkpoint (Mistral Small 3.1/3.2: a "mistral" text
    model, untied; Ministral 3: "ministral3", tied by the top-level flag as transformers ties
    it): its language model loads alone and matches transformers' whole model on text, with
    and without the cache; it loads with its Pixtral tower (models/mistral3.py, image parity in
    tests/vision/test_mistral3_vlm.py) and `convert` keeps it; a checkpoint that kept the config
    but not the tower runs its language model alone."""
    import torch
    import transformers
    from hf_models import TINY

    torch.manual_seed(0)
    text = dict(TINY, model_type=text_type, head_dim=16)
    if text_type == "ministral3":
        text["rope_parameters"] = CASES["ministral3"]["rope_parameters"]
    config = transformers.Mistral3Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=16,
            image_size=28,
            patch_size=14,
        ),
        spatial_merge_size=1,
        tie_word_embeddings=text_type == "ministral3",
    )
    torch_model = transformers.Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for t in torch_model.parameters():
            if t.dim() > 1:
                t.normal_(0, 0.08)
            else:
                t.add_(torch.randn_like(t) * 0.1)  # norms away from their neutral value
    torch_model.save_pretrained(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    assert type(model).__module__ == "mlxinfer.models.mistral3"
    assert model.args.text_model_type == text_type
    assert model.tied == (text_type == "ministral3")
    with torch.no_grad():
        expected = torch_model(torch.tensor([IDS])).logits[0].float().numpy()
    assert np.abs(np.array(model(mx.array([IDS]))[0]) - expected).max() <= TOL
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in CHUNKS])
    assert np.abs(out - expected).max() <= TOL
    add_tokenizer(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "text", dtype="float32")
    written = json.loads((tmp_path / "text" / "config.json").read_text())
    assert written["model_type"] == "mistral3" and "vision_config" in written
    again, _ = load_model(tmp_path / "text")
    assert type(again).__module__ == "mlxinfer.models.mistral3"
    assert np.abs(np.array(again(mx.array([IDS]))[0]) - expected).max() <= TOL
    from safetensors.numpy import load_file, save_file

    weights = load_file(tmp_path / "hf" / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "vision_tower" not in k and "projector" not in k},
        tmp_path / "hf" / "model.safetensors",
        metadata={"format": "pt"},
    )
    logged = []
    text_only, _ = load_model(tmp_path / "hf", log=logged.append)
    assert "no vision tower" in logged[0]
    assert (
        type(text_only).__module__
        == f"mlxinfer.models.{'llama' if text_type == 'mistral' else text_type}"
    )
    assert np.abs(np.array(text_only(mx.array([IDS]))[0]) - expected).max() <= TOL
