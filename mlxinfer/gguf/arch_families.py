"""config.json for each GGUF architecture: the family's own keys, and what llama.cpp hard-codes.

``make_config`` (arch_config.py) reads the keys every architecture has, then calls the
architecture's function here (:data:`ARCH_CONFIG`) with the lookups (lookups.py), the tensors
and that common part; names.py's notes say what each family's file holds. Qwen3.5/Qwen3-Next and
DeepSeek-V2/V3 have modules of their own (qwen35.py, deepseek2.py).
"""

from __future__ import annotations

import numpy as np

from ..errors import WeightsError
from . import deepseek2, qwen35
from .lookups import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_WIDTH,
    Meta,
    f32,
    kv_heads_per_layer,
    rope_scaling,
)
from .rope_freqs import llama3_scaling


def _llama(m: Meta, tensors: dict, config: dict, rope_theta: float, scaling: bool = True) -> dict:
    head_dim = config["head_dim"]
    # q and k rows are put back in HF's order head by head (unpermute_rows): they must split
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, t in tensors.items():
        n = heads.get(name.split(".")[2]) if name.count(".") == 3 else None
        if n and t.shape[0] % (2 * n):
            raise WeightsError(
                f"{m.path}: tensor {name} has {t.shape[0]} rows; expected a multiple of "
                f"2 x {n} heads"
            )
    rope_dims = m.integer("rope.dimension_count", hi=MAX_WIDTH, default=head_dim)
    if rope_dims != head_dim:
        raise WeightsError(
            f"{m.path}: llama.rope.dimension_count={rope_dims}, expected head_dim={head_dim}"
        )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config,
        "hidden_act": "silu",
        "mlp_bias": False,
        "rope_theta": rope_theta,
    }
    if not scaling:  # the caller reads the scaling (mistral3)
        return config
    scaling = rope_scaling(m)
    if scaling:
        if scaling["rope_type"] != "linear":
            raise WeightsError(
                f"{m.path}: llama.rope.scaling.type='yarn' not supported (expected none or linear)"
            )
        config["rope_scaling"] = {"type": "linear", "factor": scaling["factor"]}
    elif "rope_freqs.weight" in tensors and m.read is not None:  # Llama 3.1+ (rope_freqs.py)
        factors = m.read(tensors["rope_freqs.weight"])
        config["rope_scaling"] = llama3_scaling(m.path, factors, rope_theta, head_dim)
    return config


def _query_scalar(config: dict, layers_of_27b: int) -> int:
    """Gemma's ``query_pre_attn_scalar`` as llama.cpp hard-codes it: the head size, except
    ``hidden / heads`` for the 27B models (46 layers in Gemma 2, 62 in Gemma 3)."""
    if config["num_hidden_layers"] == layers_of_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma3(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    # llama.cpp's hard-coded default: every 6th layer global
    pattern = m.integer("attention.sliding_window_pattern", hi=MAX_LAYERS, default=6)
    global_rope = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = rope_scaling(m)
    if scaling:
        global_rope = {**scaling, "rope_theta": rope_theta}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": m.integer("attention.sliding_window", hi=MAX_CONTEXT),
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ],
        "rope_parameters": {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "query_pre_attn_scalar": _query_scalar(config, 62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _mistral3(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    scaling = rope_scaling(m)
    out = {
        **_llama(m, tensors, config, rope_theta, scaling=False),
        "architectures": ["Ministral3ForCausalLM"],
        "model_type": "ministral3",
    }
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            raise m.error("rope.scaling.type", "yarn or none", scaling["rope_type"])
        mscale = f32(m.number("rope.scaling.yarn_log_multiplier", hi=1e6, default=1.0))
        beta = m.number("attention.temperature_scale", hi=1e6, default=None)
        out["rope_scaling"] = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
        if beta is not None:
            out["rope_scaling"]["llama_4_scaling_beta"] = f32(beta)
    return out


def _granite(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    out = {
        **_llama(m, tensors, config, rope_theta),
        "architectures": ["GraniteForCausalLM"],
        "model_type": "granite",
    }
    for key, ours in (("attention.scale", "attention_multiplier"),
                      ("embedding_scale", "embedding_multiplier"),
                      ("residual_scale", "residual_multiplier"),
                      ("logit_scale", "logits_scaling")):  # fmt: skip
        value = m.number(key, hi=1e6, default=None)
        if value is not None:
            out[ours] = f32(value)
    return out


def _lfm2(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    per_layer = kv_heads_per_layer(m, config["num_attention_heads"])
    n_layers = config["num_hidden_layers"]
    if per_layer is None or len(per_layer) != n_layers:
        raise m.error("attention.head_count_kv", f"{n_layers} per-layer counts",
                      "one count" if per_layer is None else len(per_layer))  # fmt: skip
    eps = config.pop("rms_norm_eps")
    return {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        **config,
        "norm_eps": eps,
        "rope_theta": rope_theta,
        "layer_types": ["full_attention" if kv else "conv" for kv in per_layer],
        "conv_L_cache": m.integer("shortconv.l_cache", lo=2, hi=MAX_WIDTH),
        "block_ff_dim": config["intermediate_size"],
        "block_auto_adjust_ff_dim": False,  # the file's width is the adjusted one
    }


def _smollm3(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    return {
        **_llama(m, tensors, config, rope_theta),
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n_layers)],  # llama.cpp's step 4
    }


def _olmo2(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    out = {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        **config,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling(m),
    }
    window = m.integer("attention.sliding_window", lo=0, hi=MAX_CONTEXT, default=0)
    if window:  # OLMo 3
        pattern = m.md.get(f"{m.arch}.attention.sliding_window_pattern")
        flags = np.asarray(pattern) if isinstance(pattern, (list, np.ndarray)) else None
        if (
            flags is None
            or flags.ndim != 1
            or len(flags) != n_layers
            or flags.dtype.kind not in "biu"
        ):
            raise m.error(
                "attention.sliding_window_pattern", f"{n_layers} flags", f"{pattern!r:.80}"
            )
        out.update(
            architectures=["Olmo3ForCausalLM"],
            model_type="olmo3",
            sliding_window=window,
            layer_types=["sliding_attention" if f else "full_attention" for f in flags],
        )
    return out


def _phi3(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    head_dim = config["head_dim"]
    rope_dims = m.integer("rope.dimension_count", hi=head_dim, default=head_dim)
    if rope_dims % 2:
        raise m.error("rope.dimension_count", "an even count", rope_dims)
    window = m.integer("attention.sliding_window", lo=0, hi=MAX_CONTEXT, default=0)
    out = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        **config,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "partial_rotary_factor": rope_dims / head_dim,
        "sliding_window": window or None,
    }
    factors = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in tensors]
    if factors and (len(factors) < 2 or m.read is None):
        raise WeightsError(f"{m.path}: expected both rope_factors_long and _short, found {factors}")
    if factors:  # LongRoPE (Phi-3.5, Phi-4-mini)
        long, short = (m.read(tensors[n]).reshape(-1) for n in factors)
        if not (np.isfinite(long).all() and np.isfinite(short).all() and (long > 0).all()
                and (short > 0).all()):  # fmt: skip
            raise WeightsError(
                f"{m.path}: tensor rope_factors_long/_short: expected finite positive factors"
            )
        if long.shape != (rope_dims // 2,) or short.shape != long.shape:
            raise WeightsError(
                f"{m.path}: tensor rope_factors_long/_short has {long.size}/{short.size} values; "
                f"expected {rope_dims // 2} (one per rotated pair)"
            )
        out["original_max_position_embeddings"] = m.integer(
            "rope.scaling.original_context_length", hi=MAX_CONTEXT
        )
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [f32(x) for x in long],
            "short_factor": [f32(x) for x in short],
            "original_max_position_embeddings": out["original_max_position_embeddings"],
        }
    return out


def _gemma2(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    window = m.integer("attention.sliding_window", hi=MAX_CONTEXT)
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": rope_theta,
        "sliding_window": window,
        "layer_types": [  # llama.cpp's pattern for Gemma 2: even layers slide
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ],
        "query_pre_attn_scalar": _query_scalar(config, 46),
        "attn_logit_softcapping": f32(m.number("attn_logit_softcapping", hi=1e6, default=50.0)),
        "final_logit_softcapping": f32(m.number("final_logit_softcapping", hi=1e6, default=30.0)),
    }


def _qwen2(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    return {
        **_qwen3(m, tensors, config, rope_theta),  # the same keys; Qwen3 adds only q/k norms
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": False,
    }


def _qwen3(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **config,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling(m),
    }


def _qwen3moe(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
    return {
        **_qwen3(m, tensors, config, rope_theta),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": n_experts,
        "num_experts_per_tok": m.integer("expert_used_count", hi=n_experts),
        "moe_intermediate_size": m.integer("expert_feed_forward_length", hi=MAX_WIDTH),
        "norm_topk_prob": m.flag("expert_weights_norm", True),  # llama.cpp: always
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate.weight" in tensors],
    }


# HF's gpt-oss YaRN settings the file does not carry (llama.cpp hard-codes its own).
_GPT_OSS_YARN = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def _gpt_oss(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    window = m.integer("attention.sliding_window", lo=0, hi=MAX_CONTEXT, default=None)
    n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
    ffn = m.integer("expert_feed_forward_length", hi=MAX_WIDTH, default=None)
    scaling = rope_scaling(m, **_GPT_OSS_YARN)
    # No scaling type in the file: the family's default YaRN, as transformers' reader leaves it.
    rope = {} if scaling is None else {"rope_scaling": scaling}
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **config,
        "intermediate_size": config["intermediate_size"] if ffn is None else ffn,
        "num_local_experts": n_experts,
        "num_experts_per_tok": m.integer("expert_used_count", hi=n_experts),
        "sliding_window": window,
        "layer_types": [  # llama.cpp's swa pattern 2: even layers slide
            "sliding_attention" if i % 2 == 0 and window else "full_attention"
            for i in range(n_layers)
        ],
        "rope_theta": rope_theta,
        **rope,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
    }


# llama.cpp's expert_gating_func values: 0 (none: the family's default), 1 softmax, 2 sigmoid.
_SIGMOID = 2


def _glm4moe(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    """GLM-4.5: ``block_count`` counts the ``nextn_predict_layers`` MTP layers after the trunk's
    (llama.cpp's converter writes num_hidden_layers + num_nextn_predict_layers)."""
    blocks, head_dim = config["num_hidden_layers"], config["head_dim"]
    heads = m.integer("nextn_predict_layers", lo=0, hi=MAX_LAYERS, default=0)
    if heads >= blocks:
        raise m.error(
            "nextn_predict_layers", f"fewer than the {blocks} blocks (block_count)", heads
        )
    rope_dims = m.integer("rope.dimension_count", hi=MAX_WIDTH, default=head_dim)
    if rope_dims > head_dim or rope_dims % 2:
        raise m.error("rope.dimension_count", f"an even count up to the head size {head_dim}",
                      rope_dims)  # fmt: skip
    gating = m.integer("expert_gating_func", lo=0, hi=2**32, default=0)
    if gating not in (0, _SIGMOID):
        raise m.error("expert_gating_func", f"{_SIGMOID} (sigmoid, GLM-4.5's routing)", gating)
    n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
    trunk = blocks - heads
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **config,
        "num_hidden_layers": trunk,
        "num_nextn_predict_layers": heads,
        "hidden_act": "silu",
        "partial_rotary_factor": rope_dims / head_dim,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling(m),
        "n_routed_experts": n_experts,
        "num_experts_per_tok": m.integer("expert_used_count", hi=n_experts),
        "moe_intermediate_size": m.integer("expert_feed_forward_length", hi=MAX_WIDTH),
        "n_shared_experts": m.integer("expert_shared_count", lo=0, hi=MAX_EXPERTS),
        "first_k_dense_replace": m.integer("leading_dense_block_count", lo=0, hi=trunk, default=0),
        "routed_scaling_factor": f32(m.number("expert_weights_scale", hi=1e6)),
        "norm_topk_prob": m.flag("expert_weights_norm", False),  # llama.cpp's default
        "n_group": 1,  # llama.cpp routes GLM-4.5 in one group
        "topk_group": 1,
    }
    if int(head_dim * config["partial_rotary_factor"]) != rope_dims:  # never for real sizes
        raise m.error("rope.dimension_count", f"a count the factor of {head_dim} keeps exactly",
                      rope_dims)  # fmt: skip
    return config


def _qwen35(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    return qwen35.config(m, tensors, config, rope_theta)


def _deepseek2(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    return deepseek2.config(m, tensors, config, rope_theta)


ARCH_CONFIG = {
    "llama": _llama,
    "qwen2": _qwen2,
    "smollm3": _smollm3,
    "lfm2": _lfm2,
    "granite": _granite,
    "mistral3": _mistral3,
    "olmo2": _olmo2,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gpt-oss": _gpt_oss,
    "glm4moe": _glm4moe,
    "qwen35": _qwen35,
    "qwen35moe": _qwen35,
    "qwen3next": _qwen35,
    "deepseek2": _deepseek2,
}
