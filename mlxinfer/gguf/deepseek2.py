"""DeepSeek-V2/V3 and GLM-4.7-Flash GGUF files (``deepseek2``): config.json and tensor names.

llama.cpp's converter (conversion/deepseek.py ``DeepseekV2Model``, conversion/glm.py
``Glm4MoeLiteModel``) writes every multi-head latent attention model as ``deepseek2``:

- the attention for its absorbed form: HF's ``kv_b_proj`` split per head into ``attn_k_b``,
  stored transposed — (heads, kv_lora_rank, qk_nope), quantized along qk_nope — and
  ``attn_v_b`` (heads, v_head_dim, kv_lora_rank), which is our ``v_b_proj`` as it is. We keep
  ``attn_k_b`` as stored and tell the model so (``k_b_proj_transposed`` in config.json:
  models/layers/mla.py flips its two products), so a quantized file keeps its codes. Files from
  before that split hold ``attn_kv_b`` (HF's ``kv_b_proj``), which the model splits itself;
- ``attention.key_length``/``value_length`` describe the absorbed form (kv_lora_rank +
  qk_rope and kv_lora_rank; ``head_count_kv`` 1); the per-head sizes are
  ``key_length_mla``/``value_length_mla`` (older files: ``key_length``/``value_length``);
- the routing as ``expert_gating_func`` (sigmoid: DeepSeek-V3's, with ``exp_probs_b`` the
  correction bias; softmax or absent: V2's, as llama.cpp reads an absent key),
  ``expert_group_count``/``expert_group_used_count``, ``expert_weights_scale`` and
  ``expert_weights_norm``; YaRN's ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier``
  (0.1 × it: llama.cpp scales both the rotation and the softmax by it, which is HF's form with
  ``mscale`` = ``mscale_all_dim``);
- GLM-4.7-Flash keeps its MTP layer (DeepSeek-V2/V3's are dropped by the converter): block
  ``n_layers`` with ``blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}``, as GLM-4.5's.

A GLM-4.7-Flash file thus imports as ``deepseek_v3``: the same network (models/deepseek_v2.py).
"""

from __future__ import annotations

from ..errors import WeightsError
from .lookups import MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH, Meta, f32, rope_scaling

LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # no query bottleneck (V2-Lite)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # files from before the k_b/v_b split
    "attn_k_b": "self_attn.k_b_proj",  # (heads, kv_lora_rank, qk_nope): k_b_proj_transposed
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate",  # a parameter of the router: kind "e_score_correction_bias"
    "ffn_gate_exps": "mlp.experts.gate_up_proj",  # rows [0, I) of the fused tensor
    "ffn_up_exps": "mlp.experts.gate_up_proj",  # rows [I, 2I)
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_SIGMOID, _SOFTMAX = 2, 1  # llama.cpp's expert_gating_func values (0: none written)


def config(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    """config.json's DeepSeek fields from the ``deepseek2.*`` keys (``m``: lookups.py's)."""
    layers, width = MAX_LAYERS, MAX_WIDTH
    blocks = config["num_hidden_layers"]
    heads = m.integer("nextn_predict_layers", lo=0, hi=layers, default=0)
    if heads >= blocks:
        raise m.error("nextn_predict_layers", f"fewer than the {blocks} blocks (block_count)",
                      heads)  # fmt: skip
    trunk = blocks - heads
    rope_dims = m.integer("rope.dimension_count", hi=width)
    if rope_dims % 2:
        raise m.error("rope.dimension_count", "an even count", rope_dims)
    kv_lora = m.integer("attention.kv_lora_rank", hi=width)
    q_lora = m.integer("attention.q_lora_rank", lo=0, hi=width, default=0) or None
    if f"{m.arch}.attention.key_length_mla" in m.md:
        key = m.integer("attention.key_length_mla", hi=width)
        value = m.integer("attention.value_length_mla", hi=width)
    else:
        key = m.integer("attention.key_length", hi=width)
        value = m.integer("attention.value_length", hi=width)
    if key <= rope_dims:
        raise m.error("attention.key_length_mla", f"more than rope.dimension_count ({rope_dims})",
                      key)  # fmt: skip
    gating = m.integer("expert_gating_func", lo=0, hi=2**32, default=0)
    if gating not in (0, _SOFTMAX, _SIGMOID):
        raise m.error("expert_gating_func", f"{_SOFTMAX} (softmax) or {_SIGMOID} (sigmoid)",
                      gating)  # fmt: skip
    v3 = gating == _SIGMOID
    if v3 and not any(n.endswith(".exp_probs_b.bias") for n in tensors):
        raise WeightsError(
            f"{m.path}: {m.arch}.expert_gating_func is sigmoid (DeepSeek-V3's routing), "
            "expected its exp_probs_b.bias tensors, found none"
        )
    n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
    n_group = m.integer("expert_group_count", hi=n_experts, default=1)
    scaling = rope_scaling(m)
    log_mul = m.number("rope.scaling.yarn_log_multiplier", hi=1e6, default=None)
    if scaling is not None and scaling["rope_type"] == "yarn" and log_mul:
        mscale = f32(f32(log_mul) / 0.1)
        scaling = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
    out = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        **config,
        "num_hidden_layers": trunk,
        "num_nextn_predict_layers": heads,
        "num_key_value_heads": config["num_attention_heads"],  # the file's 1 is the absorbed MQA
        "head_dim": key,
        "hidden_act": "silu",
        "kv_lora_rank": kv_lora,
        "q_lora_rank": q_lora,
        "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": key - rope_dims,
        "v_head_dim": value,
        "k_b_proj_transposed": "blk.0.attn_k_b.weight" in tensors,
        "rope_theta": rope_theta,
        "rope_scaling": scaling,
        "rope_interleave": True,  # llama.cpp's deepseek2 rotates interleaved pairs
        "n_routed_experts": n_experts,
        "num_experts_per_tok": m.integer("expert_used_count", hi=n_experts),
        "moe_intermediate_size": m.integer("expert_feed_forward_length", hi=width),
        "n_shared_experts": m.integer(
            "expert_shared_count", lo=0, hi=MAX_EXPERTS, default=0
        ),  # fmt: skip
        "first_k_dense_replace": m.integer("leading_dense_block_count", lo=0, hi=trunk, default=0),
        "routed_scaling_factor": f32(m.number("expert_weights_scale", hi=1e6, default=1.0)),
        "norm_topk_prob": m.flag("expert_weights_norm", False),
        "n_group": n_group,
        "topk_group": m.integer("expert_group_used_count", hi=n_group, default=1),
    }
    if not v3:
        out["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    return out
