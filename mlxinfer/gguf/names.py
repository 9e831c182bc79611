"""What a GGUF architecture means in Hugging Face terms: its tensor names, and the notes on each.

arch.py maps the names and applies the weight fixes described here; config.json is made from
the metadata in arch_config.py and arch_families.py; the notes below cover all three.

Supported architectures and what differs from the HF checkpoint llama.cpp converted:

- ``llama`` -> ``model_type: llama``. The converter interleaved each head's
  RoPE halves in the q/k rows; :func:`unpermute_rows` restores HF's order.
- ``mistral3`` -> ``model_type: ministral3`` (Ministral 3, Mistral Small 3.x's text model): as
  llama (q/k rows permuted), with YaRN (``rope.scaling.yarn_log_multiplier``: ``mscale_all_dim``
  itself here, not 0.1 × it as for deepseek2) and Llama 4's query scaling
  (``attention.temperature_scale``: ``llama_4_scaling_beta``).
- ``granite`` -> ``model_type: granite`` (IBM Granite 3.x): as llama (q/k rows permuted), with
  its four multipliers as ``attention.scale``, ``embedding_scale``, ``residual_scale`` and
  ``logit_scale``.
- ``lfm2`` -> ``model_type: lfm2`` (LiquidAI's LFM2): ``attention.head_count_kv`` per layer, 0
  for a gated short-convolution layer (``shortconv.{conv, in_proj, out_proj}``, the kernel
  squeezed to (C, K)); the final norm as ``token_embd_norm``; the SwiGLU's width as written
  (already adjusted); names not permuted.
- ``smollm3`` -> ``model_type: smollm3``: as llama (q/k rows permuted); what llama.cpp hard-codes:
  every 4th layer without RoPE.
- ``olmo2`` -> ``model_type: olmo2``, or ``olmo3`` where the file names a sliding window (its
  ``attention.sliding_window_pattern`` says which layers slide): post-norms, whole-width q/k
  norms.
- ``qwen2`` -> ``model_type: qwen2`` (Qwen2, Qwen2.5): as qwen3 without q/k norms, with q/k/v
  biases.
- ``phi3`` -> ``model_type: phi3`` (Phi-3, Phi-3.5, Phi-4-mini): HF's fused ``qkv_proj`` and
  ``gate_up_proj`` as they are; LongRoPE's factors as the ``rope_factors_long``/``_short``
  tensors (read into ``rope_scaling``, not imported), partial RoPE from ``rope.dimension_count``,
  a ``sliding_window`` of 0 meaning none (Phi-4).
- ``gemma2`` -> ``model_type: gemma2``: Gemma 3's norms (stored w + 1) and names; what llama.cpp
  hard-codes: even layers slide, the query scale (``query_pre_attn_scalar``) is the head size,
  ``hidden / heads`` for the 46-layer 27B.
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
- ``glm4moe`` -> ``model_type: glm4_moe`` (GLM-4.5, GLM-4.5-Air). Names only, as qwen3moe:
  llama.cpp does not permute GLM's q/k rows (NeoX-style RoPE on the first
  ``rope.dimension_count`` features of each head: ``partial_rotary_factor``); biases on q/k/v,
  the pre-MoE norm ``post_attention_norm``, the router ``ffn_gate_inp`` with DeepSeek-V3's
  ``e_score_correction_bias`` as ``exp_probs_b.bias``, the shared experts ``ffn_*_shexp``, the
  first ``leading_dense_block_count`` layers dense. ``block_count`` counts the
  ``nextn_predict_layers`` multi-token-prediction layers after the trunk's: their blocks and
  ``blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}`` become ``model.mtp_layers.i``
  (layers/mtp.py); their copies of the embedding and LM head (``nextn.embed_tokens``,
  ``nextn.shared_head_head``) go, the trunk's serve. A file without a head's ``nextn`` tensors
  imports without that head (a warning). What llama.cpp hard-codes: sigmoid routing in one
  group (``n_group`` = ``topk_group`` = 1), top-k weights not renormalised unless
  ``expert_weights_norm`` says so.
- ``deepseek2`` -> ``model_type: deepseek_v2`` or ``deepseek_v3`` (DeepSeek-V2/V3, GLM-4.7-Flash,
  every multi-head latent attention model llama.cpp converts): deepseek2.py.
- ``qwen35``, ``qwen35moe`` -> ``model_type: qwen3_5_text`` / ``qwen3_5_moe_text`` (Qwen3.5 and
  Qwen3.6), ``qwen3next`` -> ``qwen3_next``: the Gated DeltaNet's tensors under llama.cpp's SSM
  names, value heads reordered (Qwen3.5), ``1 + w`` norms, ``-exp(A_log)`` and the MTP layer as
  ``nextn`` tensors; qwen35.py undoes each.
"""

from __future__ import annotations

from . import deepseek2, qwen35

SUPPORTED = ("llama", "granite", "mistral3", "smollm3", "lfm2", "qwen2", "phi3", "olmo2", "gemma2",
             "gemma3", "qwen3",
             "qwen3moe", "gpt-oss", "glm4moe", *qwen35.ARCHS, "deepseek2")  # fmt: skip

# Tensors that hold settings, not weights: read into config.json (arch_config.py), not imported.
SETTINGS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
TOP = {
    "token_embd_norm": "model.embedding_norm",  # LFM2's final norm, by that name
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
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
LAYER = {
    "llama": {**_ATTN_MLP, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "granite": {
        **_ATTN_MLP,
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    },
    "mistral3": {
        **_ATTN_MLP,
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    },
    "lfm2": {
        "attn_norm": "operator_norm",
        "ffn_norm": "ffn_norm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.out_proj",
        "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm",
        "ffn_gate": "feed_forward.w1",
        "ffn_up": "feed_forward.w3",
        "ffn_down": "feed_forward.w2",
    },
    "smollm3": {
        **_ATTN_MLP,
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    },
    "qwen2": {**_ATTN_MLP, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "olmo2": {  # post-norms only; q/k norms over all heads at once
        **_ATTN_MLP,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",  # gate rows then up rows, as HF's fused projection
        "ffn_down": "mlp.down_proj",
    },
    "gemma2": {
        **_ATTN_MLP,
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
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
    "glm4moe": {
        **_QWEN3,
        **_EXPERTS,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
        "exp_probs_b": "mlp.gate",  # a parameter of the router: kind "e_score_correction_bias"
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    "deepseek2": deepseek2.LAYER,
}
SHORTCONV = ("conv", "in_proj", "out_proj")
KIND = {"attn_sinks": "sinks", "exp_probs_b": "e_score_correction_bias"}  # parameters by name
# A multi-token-prediction layer's own tensors (``blk.N.nextn.*``), as layers/mtp.py's DEEPSEEK
# names them; the copies of the embedding and LM head are dropped (the trunk's serve).
NEXTN = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm",
         "shared_head_norm": "shared_head.norm"}  # fmt: skip
NEXTN_COPIES = ("embed_tokens", "shared_head_head")
NEXTN_ARCHS = ("glm4moe", "deepseek2", *qwen35.ARCHS)
FUSED = {"ffn_gate_exps": 0, "ffn_up_exps": 1}  # halves of experts.gate_up_proj, in order
