"""Qwen3.5/3.6 and Qwen3-Next GGUF files (``qwen35``, ``qwen35moe``, ``qwen3next``): llama.cpp's
changes undone.

llama.cpp's converter (conversion/qwen.py: ``Qwen3NextModel``, ``_LinearAttentionVReorderBase``,
``_QwenMtpMixin``) writes a Qwen3.5 text model as:

- the Gated DeltaNet's projections under SSM names (``attn_qkv``, ``attn_gate`` = z,
  ``ssm_beta`` = b, ``ssm_alpha`` = a, ``ssm_out``, ``ssm_norm``, ``ssm_conv1d`` with the
  (C, 1, K) kernel squeezed to (C, K)); ``dt_bias`` as ``ssm_dt.bias``; ``A_log`` as
  ``ssm_a`` = ``-exp(A_log)`` (we store ``log(-ssm_a)``: the model computes ``-exp`` of it
  again, within a float32 rounding of the file's value);
- every RMSNorm weight but the DeltaNet's own (``ssm_norm``) as ``1 + w`` (the ``(1 + w)``
  norms llama.cpp runs as plain ``x * w``): we subtract the 1 in float32, as for Gemma;
- where a key head has several value heads, the value heads in tiled order
  ``[k0v0, k1v0, …, k0v1, k1v1, …]`` instead of HF's grouped ``[k0v0, k0v1, …, k1v0, …]``:
  the rows of ``attn_qkv``'s value part, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, the
  value channels of ``ssm_conv1d``, the entries of ``ssm_a`` and ``ssm_dt``, and the
  columns of ``ssm_out``. We put them back. Rows move whole (codes, scales and biases of a
  row together); ``ssm_out``'s columns move by value heads, after the file's blocks are in
  MLX's groups (of 32 for every K-quant), so a head's columns are whole groups;
- Qwen3-Next (``qwen3next``, no value heads reordered): its fused ``in_proj_qkvz`` (per key
  head: q, k, v, z) as ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z), Qwen3.5's
  layout, and ``in_proj_ba`` as ``ssm_ba``: we import it as Qwen3.5's four projections
  (``separate_projections`` in config.json), ``ssm_ba``'s rows split into ``in_proj_b`` and
  ``in_proj_a``;
- the MTP layer (``mtp.*`` in the checkpoint) as block ``n_layers + i`` with
  ``blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}`` for ``mtp.fc`` and its three
  norms; ``block_count`` counts it, ``nextn_predict_layers`` says how many.

The file's ``rope.dimension_sections`` (Qwen3.5's interleaved multimodal RoPE) do not change
a text model: a text token has the same position on every axis, which is plain partial RoPE.
"""

from __future__ import annotations

import numpy as np

from ..errors import WeightsError
from .lookups import MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH, Meta

ARCHS = ("qwen35", "qwen35moe", "qwen3next")

LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # the queries and their output gate, as HF's q_proj
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_ba": "linear_attn.in_proj_ba",  # qwen3next: split into in_proj_b and in_proj_a
    "ssm_dt": "linear_attn",  # its .bias is the parameter dt_bias
    "ssm_a": "linear_attn",  # no suffix: the parameter A_log
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_up_proj",  # rows [0, I) of the fused tensor
    "ffn_up_exps": "mlp.experts.gate_up_proj",  # rows [I, 2I)
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
KIND = {("ssm_dt", "bias"): "dt_bias", ("ssm_a", None): "A_log"}
NEXTN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
         "shared_head_norm": "norm"}  # fmt: skip
# Norms stored as 1 + w (every RMSNorm but the DeltaNet's gated one).
_PLUS_ONE = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm",
             "pre_fc_norm_embedding", "pre_fc_norm_hidden")  # fmt: skip


def layer_name(part: str, suffix: str | None) -> tuple[str, str] | None:
    """A block tensor's (module under the layer, kind), or None if not a Qwen3.5 tensor."""
    if part not in LAYER or (suffix is None) != (part == "ssm_a"):
        return None
    return LAYER[part], KIND.get((part, suffix), suffix or "")


def needs_float_fix(module: str, kind: str) -> bool:
    parent, _, last = module.rpartition(".")
    if kind == "A_log" or (kind == "weight" and module.endswith("linear_attn.conv1d")):
        return True
    return kind == "weight" and last in _PLUS_ONE and not parent.endswith("linear_attn")


def fix_float(module: str, kind: str, a: np.ndarray, name: str) -> np.ndarray:
    """float32 in, float32 out: 1 + w back to w, ``-exp(A_log)`` back to ``A_log``, the conv
    kernel (C, K) back to HF's (C, 1, K)."""
    if kind == "A_log":
        if not np.all(a < 0):
            raise WeightsError(
                f"tensor {name}: expected -exp(A_log) < 0 everywhere, found {float(a.max()):.6g}"
            )
        return np.log(-a.astype(np.float64)).astype(np.float32)
    if module.endswith("linear_attn.conv1d"):
        if a.ndim != 2:
            raise WeightsError(f"tensor {name} has shape {a.shape}; expected (C, K)")
        return a[:, None, :]
    return a - np.float32(1.0)


def config(m: Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    """config.json's Qwen3.5 fields from the ``qwen35.*`` keys (``m``: lookups.py's)."""
    blocks, head_dim = config["num_hidden_layers"], config["head_dim"]
    heads = m.integer("nextn_predict_layers", lo=0, hi=MAX_LAYERS, default=0)
    if heads >= blocks:
        raise m.error("nextn_predict_layers", f"fewer than the {blocks} blocks (block_count)",
                      heads)  # fmt: skip
    trunk = blocks - heads
    n_k = m.integer("ssm.group_count", hi=MAX_WIDTH)
    n_v = m.integer("ssm.time_step_rank", hi=MAX_WIDTH)
    inner = m.integer("ssm.inner_size", hi=MAX_WIDTH)
    if n_v % n_k or inner % n_v:
        raise m.error("ssm.time_step_rank", f"a multiple of ssm.group_count ({n_k}) dividing "
                      f"ssm.inner_size ({inner})", n_v)  # fmt: skip
    rope_dims = m.integer("rope.dimension_count", hi=head_dim, default=head_dim)
    if rope_dims % 2:
        raise m.error("rope.dimension_count", "an even count", rope_dims)
    recurrent = m.md.get(f"{m.arch}.attention.recurrent_layers")
    if recurrent is not None:
        flags = np.asarray(recurrent) if isinstance(recurrent, (list, np.ndarray)) else None
        if flags is None or flags.ndim != 1 or flags.dtype.kind not in "biu" or len(flags) < trunk:
            raise m.error("attention.recurrent_layers", f"a list of {blocks} flags",
                          f"{recurrent!r:.80}")  # fmt: skip
        kinds = ["linear_attention" if r else "full_attention" for r in flags[:trunk]]
    else:
        every = m.integer("full_attention_interval", hi=MAX_LAYERS, default=4)
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(trunk)]  # fmt: skip
    out = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **config,
        "num_hidden_layers": trunk,
        "layer_types": kinds,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "partial_rotary_factor": rope_dims / head_dim,
        "linear_conv_kernel_dim": m.integer("ssm.conv_kernel", hi=MAX_WIDTH),
        "linear_key_head_dim": m.integer("ssm.state_size", hi=MAX_WIDTH),
        "linear_value_head_dim": inner // n_v,
        "linear_num_key_heads": n_k,
        "linear_num_value_heads": n_v,
        "mtp_num_hidden_layers": heads,
    }
    if m.arch == "qwen3next":  # the DeltaNet's inputs as Qwen3.5's four projections (split_ba)
        out.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                   separate_projections=True)  # fmt: skip
    if m.arch in ("qwen35moe", "qwen3next"):
        n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
        shared = m.integer("expert_shared_feed_forward_length", lo=0, hi=MAX_WIDTH, default=0)
        if m.arch == "qwen35moe":
            out.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
        out.update(
            num_experts=n_experts,
            num_experts_per_tok=m.integer("expert_used_count", hi=n_experts),
            moe_intermediate_size=m.integer("expert_feed_forward_length", hi=MAX_WIDTH),
            shared_expert_intermediate_size=shared,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out


def split_ba(module: str, parts: dict, config: dict, name: str) -> list[tuple[str, dict]]:
    """Qwen3-Next's ``in_proj_ba`` (per key head: the b of its value heads, then their a) as
    Qwen3.5's ``in_proj_b`` and ``in_proj_a``, each a selection of whole rows; another
    module is returned as it is."""
    if not module.endswith("linear_attn.in_proj_ba"):
        return [(module, parts)]
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    r = n_v // n_k
    rows = np.arange(2 * n_v).reshape(n_k, 2, r)
    out = []
    for i, new in enumerate(("in_proj_b", "in_proj_a")):
        picked = {}
        for key, a in parts.items():
            if a.shape[0] != 2 * n_v:
                raise WeightsError(
                    f"tensor {name} has {a.shape[0]} rows; expected {2 * n_v} "
                    f"(b and a of {n_v} value heads)"
                )
            picked[key.replace("in_proj_ba", new)] = a[rows[:, i].reshape(-1)]
        out.append((module.replace("in_proj_ba", new), picked))
    return out


def value_head_order(config: dict, module: str, kind: str) -> tuple[str, int, int] | None:
    """How llama.cpp moved this tensor's value heads: (axis kind, value-dim size per head,
    offset in rows), or None where nothing moved (one value head per key head, or a tensor
    without value heads)."""
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if n_k == n_v or ".linear_attn" not in f".{module}" or config.get("model_type") == "qwen3_next":
        return None  # (llama.cpp reorders Qwen3.5's value heads, not Qwen3-Next's)
    dv = config["linear_value_head_dim"]
    last = module.rsplit(".", 1)[-1]
    if last == "in_proj_qkv":
        return "rows", dv, 2 * n_k * config["linear_key_head_dim"]
    if last == "conv1d" and kind == "weight":
        return "rows", dv, 2 * n_k * config["linear_key_head_dim"]
    if last == "in_proj_z":
        return "rows", dv, 0
    if last in ("in_proj_b", "in_proj_a") or kind in ("A_log", "dt_bias"):
        return "rows", 1, 0
    if last == "out_proj":
        return "columns", dv, 0
    return None


def grouped_order(n_k: int, n_v: int, size: int) -> np.ndarray:
    """Where each HF (grouped) value channel sits in llama.cpp's tiled order: the index array
    that takes tiled channels back to grouped ones."""
    r = n_v // n_k
    tiled = np.arange(n_v * size).reshape(n_k, r, size).transpose(1, 0, 2).reshape(-1)
    return np.argsort(tiled)  # tiled[j] = grouped channel at tiled position j


def regroup(parts: dict, config: dict, how: tuple[str, int, int], name: str) -> dict:
    """Put the value heads of every stored array of one tensor back in HF's grouped order."""
    axis, size, offset = how
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    back = grouped_order(n_k, n_v, size)
    out = {}
    for key, a in parts.items():
        if axis == "rows":
            if a.shape[0] != offset + n_v * size:
                raise WeightsError(
                    f"tensor {name} has {a.shape[0]} rows; expected "
                    f"{offset + n_v * size} ({n_v} value heads of {size})"
                )
            idx = np.concatenate([np.arange(offset), offset + back])
            out[key] = a[idx]
            continue
        cols = a.shape[-1]  # codes (packed words), scales or biases: heads are whole columns
        if cols % n_v:
            raise WeightsError(
                f"tensor {name}: {cols} stored columns do not split into {n_v} "
                "value heads (a quantization block spans two heads)"
            )
        per = cols // n_v
        idx = (back[::size] // size)[:, None] * per + np.arange(per)
        out[key] = a[..., idx.reshape(-1)]
    return out
