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
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import WeightsError

SUPPORTED = ("llama", "gemma3")

_TOP = {
    "llama": {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    "gemma3": {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    },
}
_ATTN_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
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
}


def hf_module(arch: str, path: Path, gguf_name: str) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight')."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP[arch]:
        return _TOP[arch][parts[0]], parts[1]
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER[arch]:
        return f"model.layers.{parts[1]}.{_LAYER[arch][parts[2]]}", parts[3]
    raise WeightsError(f"{path}: unexpected tensor {gguf_name} for architecture {arch}")


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


def _rope_scaling(m: _Meta) -> dict | None:
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(m.get("rope.scaling.factor"))}
    raise WeightsError(
        f"{m.path}: {m.arch}.rope.scaling.type={kind!r} not supported (expected none or linear)"
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
    if experts:
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
            m.get("attention.layer_norm_rms_epsilon", 1e-5 if arch == "llama" else 1e-6)
        ),
        "vocab_size": vocab,
        "max_position_embeddings": m.need("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    rope_theta = _f32(m.get("rope.freq_base", 10000.0))
    if arch == "llama":
        rope_dims = int(m.get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise WeightsError(
                f"{path}: llama.rope.dimension_count={rope_dims}, expected head_dim={head_dim}"
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
            config["rope_scaling"] = {"type": "linear", "factor": scaling["factor"]}
    elif arch == "gemma3":
        n_layers = config["num_hidden_layers"]
        pattern = int(
            m.get("attention.sliding_window_pattern", 6)
        )  # llama.cpp's hard-coded default
        global_rope = {"rope_type": "default", "rope_theta": rope_theta}
        scaling = _rope_scaling(m)
        if scaling:
            global_rope = {**scaling, "rope_theta": rope_theta}
        config = {
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
            "query_pre_attn_scalar": hidden // n_heads if n_layers == 62 else head_dim,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        }
    _token_ids(md, config)
    return config
