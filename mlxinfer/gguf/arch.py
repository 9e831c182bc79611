"""What a GGUF architecture means in Hugging Face terms: tensor names, config.json, weight fixes.

Supported architectures and what differs from the HF checkpoint llama.cpp converted:

- ``llama`` -> ``model_type: llama``. The converter interleaved each head's
  RoPE halves in the q/k rows; :func:`unpermute_rows` restores HF's order.
- ``gemma3`` -> ``model_type: gemma3_text``. Gemma's RMSNorm multiplies by
  ``1 + w``; llama.cpp stores ``w + 1`` so that its own norm is a plain ``x * w``,
  and transformers' GGUF loader subtracts the 1 again. We do the same, in
  float32: ``(w + 1) - 1`` is exact for ``w + 1`` in [0.5, 2] (Sterbenz), and
  the model adds the 1 back. What the file leaves out is llama.cpp's
  hard-coded Gemma 3 knowledge: local (sliding) layers use RoPE base 10000,
  every 6th layer is global, and the query scale is ``head_dim ** -0.5``
  (``(hidden / heads) ** -0.5`` for the 62-layer 27B).
- ``qwen3`` -> ``model_type: qwen3``. Names only: llama.cpp does not permute
  Qwen's q/k rows (its graph uses NeoX-style RoPE, as HF does); the per-head
  q/k norms are ``attn_q_norm``/``attn_k_norm``; ``attention.key_length`` is the
  head size (128 in every Qwen3, not always hidden / heads).
- ``qwen3moe`` -> ``model_type: qwen3_moe``. As qwen3, plus the router
  ``ffn_gate_inp`` and experts stored stacked: ``ffn_gate_exps``/``ffn_up_exps``
  (E, I, H) and ``ffn_down_exps`` (E, H, I). Gate and up are fused into our
  ``experts.gate_up_proj`` (E, 2I, H), gate rows first (:func:`fused_part`).
  llama.cpp always renormalises the top-k routing weights (``norm_topk_prob``),
  and a layer with ``ffn_gate`` instead of experts is dense (``mlp_only_layers``).
- ``gpt-oss`` -> ``model_type: gpt_oss``. llama.cpp de-interleaves HF's fused
  ``gate_up_proj`` (gate and up alternate along 2I) into ``ffn_gate_exps`` and
  ``ffn_up_exps``, weights and biases alike (``.bias``, (E, I)); we stack them
  [gate; up] again, which is the order our model wants. The router is
  ``ffn_gate_inp`` (with a bias), the pre-MoE norm ``post_attention_norm``,
  the sinks ``attn_sinks.weight`` (n_heads,). What the file leaves out is what
  llama.cpp hard-codes: even layers slide, the clamped SwiGLU (alpha 1.702,
  limit 7), and YaRN's ``beta_fast`` 32 / ``beta_slow`` 1 without truncation
  (HF's gpt-oss config; the file says only the type, factor and original context).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import WeightsError

SUPPORTED = ("llama", "gemma3", "qwen3", "qwen3moe", "gpt-oss")

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTN_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3 = {
    **_ATTN_MLP,
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
}
_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.gate_up_proj",  # rows [0, I) of the fused tensor
    "ffn_up_exps": "mlp.experts.gate_up_proj",  # rows [I, 2I)
    "ffn_down_exps": "mlp.experts.down_proj",
}
_LAYER = {
    "llama": {**_ATTN_MLP, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        **_ATTN_MLP,
        "attn_norm": "input_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "qwen3": _QWEN3,
    "qwen3moe": {**_QWEN3, **_EXPERTS, "ffn_gate_inp": "mlp.gate"},
    "gpt-oss": {
        **{k: v for k, v in _ATTN_MLP.items() if k.startswith("attn_")},
        **_EXPERTS,
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "attn_sinks": "self_attn",  # a parameter, not a module: kind "sinks"
    },
}
_FUSED = {"ffn_gate_exps": 0, "ffn_up_exps": 1}  # halves of experts.gate_up_proj, in order


def hf_module(arch: str, path: Path, gguf_name: str) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight')."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP:
        return _TOP[parts[0]], parts[1]
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER[arch]:
        kind = "sinks" if parts[2] == "attn_sinks" else parts[3]
        return f"model.layers.{parts[1]}.{_LAYER[arch][parts[2]]}", kind
    raise WeightsError(f"{path}: unexpected tensor {gguf_name} for architecture {arch}")


def fused_part(gguf_name: str) -> int | None:
    """Which half of a fused tensor this one is (0: first rows; None: not fused).

    ``ffn_gate_exps`` and ``ffn_up_exps`` (E, I, ...) become one (E, 2I, ...) tensor,
    stacked along axis 1; the same for their biases (E, I) and quantized arrays.
    """
    parts = gguf_name.split(".")
    return _FUSED.get(parts[2]) if len(parts) == 4 else None


def check_fused(path: Path, tensors: dict) -> None:
    """Every fused half has its partner, of the same shape."""
    first = {v: k for k, v in _FUSED.items()}
    for name, t in tensors.items():
        if fused_part(name) != 0:
            continue
        parts = name.split(".")
        partner = ".".join([*parts[:2], first[1], parts[3]])
        if partner not in tensors:
            raise WeightsError(f"{path}: tensor {name} has no {partner} to fuse with")
        if tensors[partner].shape != t.shape:
            raise WeightsError(
                f"{path}: tensor {partner} has shape {tensors[partner].shape}, "
                f"expected {t.shape} like {name}"
            )
    for name in tensors:
        if fused_part(name) == 1:
            parts = name.split(".")
            partner = ".".join([*parts[:2], first[0], parts[3]])
            if partner not in tensors:
                raise WeightsError(f"{path}: tensor {name} has no {partner} to fuse with")


def needs_float_fix(arch: str, module: str, kind: str) -> bool:
    """Whether :func:`fix_float` changes this tensor (Gemma's norms)."""
    return arch == "gemma3" and kind == "weight" and module.rsplit(".", 1)[-1].endswith("norm")


def fix_float(arch: str, module: str, kind: str, a: np.ndarray) -> np.ndarray:
    """Per-architecture change to a floating-point tensor (float32 in, float32 out)."""
    if needs_float_fix(arch, module, kind):
        return a - np.float32(1.0)  # stored as w + 1
    return a


def permuted_heads(arch: str, module: str, config: dict) -> int | None:
    """How many heads llama.cpp interleaved this tensor's rows by (None: not permuted)."""
    if arch != "llama":
        return None
    return {
        "self_attn.q_proj": config["num_attention_heads"],
        "self_attn.k_proj": config["num_key_value_heads"],
    }.get(module.split(".", 3)[-1])


def unpermute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) back to HF's rotate-half order.

    llama.cpp's converter did rows.reshape(n_heads, 2, head_dim//2, ...).swapaxes(1, 2);
    rows are output channels and quantization groups run along the input dim, so the
    same row shuffle applies to packed weights, scales and biases alike.
    """
    head_dim = a.shape[0] // n_heads
    rest = a.shape[1:]
    a = a.reshape(n_heads, head_dim // 2, 2, *rest)  # (n_heads, head_dim/2, 2, ...)
    return a.swapaxes(1, 2).reshape(n_heads * head_dim, *rest)  # (n_heads*head_dim, ...)


def _f32(x) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


class _Meta:
    """Metadata lookups under the architecture's prefix, with one-line errors."""

    def __init__(self, path: Path, md: dict, arch: str):
        self.path, self.md, self.arch = path, md, arch

    def get(self, key: str, default=None):
        return self.md.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> int:
        if f"{self.arch}.{key}" not in self.md:
            raise WeightsError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return int(self.md[f"{self.arch}.{key}"])


def _rope_scaling(m: _Meta, **yarn_defaults) -> dict | None:
    """``rope.scaling.*`` as HF's ``rope_scaling`` (none, linear or yarn)."""
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(m.get("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _f32(m.get("rope.scaling.factor", 1.0))}
        if m.get("rope.scaling.original_context_length") is not None:
            original = int(m.get("rope.scaling.original_context_length"))
            scaling["original_max_position_embeddings"] = original
        for key in ("beta_fast", "beta_slow"):
            value = m.get(f"rope.scaling.yarn_{key}", yarn_defaults.get(key))
            if value is not None:
                scaling[key] = _f32(value)
        return {**yarn_defaults, **scaling}
    raise WeightsError(
        f"{m.path}: {m.arch}.rope.scaling.type={kind!r} not supported "
        "(expected none, linear or yarn)"
    )


def _token_ids(md: dict, config: dict) -> None:
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):  # fmt: skip
        if f"tokenizer.ggml.{gguf_key}" in md:
            config[key] = int(md[f"tokenizer.ggml.{gguf_key}"])


def make_config(arch: str, path: Path, md: dict, tensors: dict) -> dict:
    """config.json for the model the GGUF describes, in transformers 5's form."""
    m = _Meta(path, md, arch)
    experts = int(m.get("expert_count", 0))
    if experts and arch not in ("qwen3moe", "gpt-oss"):
        raise WeightsError(
            f"{path}: {arch}.expert_count={experts}: mixture-of-experts GGUF not supported"
        )
    hidden = m.need("embedding_length")
    n_heads = m.need("attention.head_count")
    head_dim = int(m.get("attention.key_length", hidden // n_heads))
    vocab = int(m.get("vocab_size", tensors["token_embd.weight"].shape[0]))
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": m.need("block_count"),
        "intermediate_size": m.need("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(
            m.get(
                "attention.layer_norm_rms_epsilon", 1e-5 if arch in ("llama", "gpt-oss") else 1e-6
            )
        ),
        "vocab_size": vocab,
        "max_position_embeddings": m.need("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    rope_theta = _f32(m.get("rope.freq_base", 10000.0))
    config = _ARCH_CONFIG[arch](m, tensors, config, rope_theta)
    _token_ids(md, config)
    return config


def _llama(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    head_dim = config["head_dim"]
    rope_dims = int(m.get("rope.dimension_count", head_dim))
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
    scaling = _rope_scaling(m)
    if scaling:
        if scaling["rope_type"] != "linear":
            raise WeightsError(
                f"{m.path}: llama.rope.scaling.type='yarn' not supported (expected none or linear)"
            )
        config["rope_scaling"] = {"type": "linear", "factor": scaling["factor"]}
    return config


def _gemma3(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers, hidden, n_heads = (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
    )
    pattern = int(m.get("attention.sliding_window_pattern", 6))  # llama.cpp's hard-coded default
    global_rope = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = _rope_scaling(m)
    if scaling:
        global_rope = {**scaling, "rope_theta": rope_theta}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": m.need("attention.sliding_window"),
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ],
        "rope_parameters": {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "query_pre_attn_scalar": hidden // n_heads if n_layers == 62 else config["head_dim"],
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _qwen3(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **config,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(m),
    }


def _qwen3moe(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    return {
        **_qwen3(m, tensors, config, rope_theta),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": m.need("expert_count"),
        "num_experts_per_tok": m.need("expert_used_count"),
        "moe_intermediate_size": m.need("expert_feed_forward_length"),
        "norm_topk_prob": bool(m.get("expert_weights_norm", True)),  # llama.cpp: always
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate.weight" in tensors],
    }


# HF's gpt-oss YaRN settings the file does not carry (llama.cpp hard-codes its own).
_GPT_OSS_YARN = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def _gpt_oss(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    window = m.get("attention.sliding_window")
    scaling = _rope_scaling(m, **_GPT_OSS_YARN)
    # No scaling type in the file: the family's default YaRN, as transformers' reader leaves it.
    rope = {} if scaling is None else {"rope_scaling": scaling}
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **config,
        "intermediate_size": int(m.get("expert_feed_forward_length", config["intermediate_size"])),
        "num_local_experts": m.need("expert_count"),
        "num_experts_per_tok": m.need("expert_used_count"),
        "sliding_window": None if window is None else int(window),
        "layer_types": [  # llama.cpp's swa pattern 2: even layers slide
            "sliding_attention" if i % 2 == 0 and window else "full_attention"
            for i in range(n_layers)
        ],
        "rope_theta": rope_theta,
        **rope,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
    }


_ARCH_CONFIG = {
    "llama": _llama,
    "gemma3": _gemma3,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gpt-oss": _gpt_oss,
}
