"""What a GGUF architecture means in Hugging Face terms: tensor names and weight fixes.

config.json is made from the metadata in arch_config.py; the notes below cover both.

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

import warnings
from pathlib import Path

import numpy as np

from ..errors import WeightsError
from . import deepseek2, qwen35

SUPPORTED = ("llama", "granite", "mistral3", "smollm3", "lfm2", "qwen2", "phi3", "olmo2", "gemma2", "gemma3", "qwen3",
             "qwen3moe", "gpt-oss", "glm4moe", *qwen35.ARCHS, "deepseek2")  # fmt: skip

# Tensors that hold settings, not weights: read into config.json (arch_config.py), not imported.
SETTINGS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_TOP = {
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
_LAYER = {
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
_SHORTCONV = ("conv", "in_proj", "out_proj")
_KIND = {"attn_sinks": "sinks", "exp_probs_b": "e_score_correction_bias"}  # parameters by name
# A multi-token-prediction layer's own tensors (``blk.N.nextn.*``), as layers/mtp.py's DEEPSEEK
# names them; the copies of the embedding and LM head are dropped (the trunk's serve).
NEXTN = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm",
         "shared_head_norm": "shared_head.norm"}  # fmt: skip
_NEXTN_COPIES = ("embed_tokens", "shared_head_head")
_NEXTN_ARCHS = ("glm4moe", "deepseek2", *qwen35.ARCHS)
_FUSED = {"ffn_gate_exps": 0, "ffn_up_exps": 1}  # halves of experts.gate_up_proj, in order


def hf_module(
    arch: str, path: Path, gguf_name: str, n_layers: int | None = None
) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight').

    ``n_layers``: the trunk's layers, for an architecture with MTP layers after them: layer
    ``n_layers + i`` (its block and its ``nextn.*`` tensors) is ``model.mtp_layers.i``.
    """
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP:
        return _TOP[parts[0]], parts[1]
    if len(parts) in (3, 4, 5) and parts[0] == "blk" and parts[1].isdigit():
        i = int(parts[1])
        head = n_layers is not None and arch in _NEXTN_ARCHS and i >= n_layers
        layer = f"model.mtp_layers.{i - n_layers}" if head else f"model.layers.{i}"
        nextn = qwen35.NEXTN if arch in qwen35.ARCHS else NEXTN
        if arch in qwen35.ARCHS and len(parts) in (3, 4):
            found = qwen35.layer_name(parts[2], parts[3] if len(parts) == 4 else None)
            if found is not None:
                return f"{layer}.{found[0]}", found[1]
        elif len(parts) == 4 and parts[2] in _LAYER[arch]:
            return f"{layer}.{_LAYER[arch][parts[2]]}", _KIND.get(parts[2], parts[3])
        if len(parts) == 5 and parts[2] == "nextn" and parts[3] in nextn and head:
            return f"{layer}.{nextn[parts[3]]}", parts[4]
        if (
            len(parts) == 5
            and arch == "lfm2"
            and parts[2] == "shortconv"
            and parts[3] in _SHORTCONV
        ):
            return f"{layer}.conv.{parts[3]}", parts[4]  # LFM2's gated short convolution
    raise WeightsError(f"{path}: unexpected tensor {gguf_name} for architecture {arch}")


def import_names(arch: str, path: Path, tensors: dict, config: dict) -> dict[str, tuple[str, str]]:
    """The tensors to import, each with its (module, kind): :func:`hf_module` over the file,
    less the MTP layers' copies of the embedding and LM head, and less any MTP layer whose
    ``nextn`` tensors are all absent (and every one after it: heads are kept in order), with
    a warning. A layer with some of its four ``nextn`` tensors but not all is a WeightsError."""
    n_layers = config["num_hidden_layers"]
    heads = config.get("num_nextn_predict_layers", config.get("mtp_num_hidden_layers", 0))
    if arch not in _NEXTN_ARCHS:
        return {n: hf_module(arch, path, n) for n in tensors}
    by_layer: dict[int, list[str]] = {}
    names = {}
    for name in tensors:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            i = int(parts[1])
            if i >= n_layers + heads:
                raise WeightsError(
                    f"{path}: tensor {name}: expected layers 0..{n_layers + heads - 1} "
                    f"({arch}.block_count), found layer {i}"
                )
            if len(parts) == 5 and parts[2] == "nextn" and parts[3] in _NEXTN_COPIES:
                if i < n_layers:
                    raise WeightsError(
                        f"{path}: tensor {name}: expected nextn tensors only in the MTP layers "
                        f"{n_layers}..{n_layers + heads - 1}, found layer {i}"
                    )
                continue
            by_layer.setdefault(i, []).append(name)
        names[name] = hf_module(arch, path, name, n_layers)
    for i in range(n_layers, n_layers + heads):
        wanted = [f"blk.{i}.nextn.{part}.weight" for part in NEXTN]
        found = [w for w in wanted if w in tensors]
        if found and len(found) < len(wanted):
            missing = next(w for w in wanted if w not in tensors)
            raise WeightsError(
                f"{path}: MTP layer {i} ({arch}.nextn_predict_layers={heads}): expected tensor "
                f"{missing} beside {found[0]}, found none"
            )
        if not found:
            later = [n for j in range(i, n_layers + heads) for n in by_layer.get(j, [])]
            if later:
                warnings.warn(
                    f"{path}: MTP layer {i} has no nextn tensors ({wanted[0]} absent): "
                    f"{len(later)} tensors of layers {i}..{n_layers + heads - 1} not imported; "
                    "the model has no MTP head from there",
                    RuntimeWarning,
                    stacklevel=3,
                )
            for n in later:
                del names[n]
            break
    return names


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
        if len(t.shape) < 2:  # the halves are stacked along axis 1
            raise WeightsError(
                f"{path}: tensor {name} has shape {t.shape}; expected (experts, rows, ...)"
            )
    for name in tensors:
        if fused_part(name) == 1:
            parts = name.split(".")
            partner = ".".join([*parts[:2], first[0], parts[3]])
            if partner not in tensors:
                raise WeightsError(f"{path}: tensor {name} has no {partner} to fuse with")


def needs_float_fix(arch: str, module: str, kind: str) -> bool:
    """Whether :func:`fix_float` changes this tensor (Gemma's and Qwen3.5's norms, ...)."""
    if arch in qwen35.ARCHS:
        return qwen35.needs_float_fix(module, kind)
    if arch == "lfm2":  # the (C, 1, K) kernel, squeezed to (C, K) by the converter
        return kind == "weight" and module.endswith(".conv.conv")
    gemma = arch in ("gemma2", "gemma3")
    return gemma and kind == "weight" and module.rsplit(".", 1)[-1].endswith("norm")


def fix_float(arch: str, module: str, kind: str, a: np.ndarray, name: str) -> np.ndarray:
    """Per-architecture change to a floating-point tensor (float32 in, float32 out)."""
    if arch in qwen35.ARCHS and needs_float_fix(arch, module, kind):
        return qwen35.fix_float(module, kind, a, name)
    if arch == "lfm2" and needs_float_fix(arch, module, kind):
        if a.ndim != 2:
            raise WeightsError(f"tensor {name} has shape {a.shape}; expected (C, K)")
        return a[:, None, :]
    if needs_float_fix(arch, module, kind):
        return a - np.float32(1.0)  # stored as w + 1
    return a


def reorder(arch: str, module: str, kind: str, config: dict, parts: dict, name: str) -> dict:
    """One tensor's stored arrays with llama.cpp's reordering of rows or columns undone:
    Llama's q/k RoPE pairs (:func:`unpermute_rows`), Qwen3.5's value heads (qwen35.py)."""
    heads = permuted_heads(arch, module, config)
    if heads:
        if parts and next(iter(parts.values())).shape[0] % (2 * heads):
            rows = next(iter(parts.values())).shape[0]
            raise WeightsError(f"{name}: {rows} rows do not split into {heads} heads of even size")
        return {key: unpermute_rows(a, heads) for key, a in parts.items()}
    how = qwen35.value_head_order(config, module, kind) if arch in qwen35.ARCHS else None
    return qwen35.regroup(parts, config, how, name) if how else parts


def split(arch: str, module: str, parts: dict, config: dict, name: str) -> list[tuple[str, dict]]:
    """A tensor stored as several modules (Qwen3-Next's ``ssm_ba``): [(module, parts)]."""
    if arch == "qwen3next":
        return qwen35.split_ba(module, parts, config, name)
    return [(module, parts)]


def permuted_heads(arch: str, module: str, config: dict) -> int | None:
    """How many heads llama.cpp interleaved this tensor's rows by (None: not permuted)."""
    if arch not in ("llama", "smollm3", "mistral3", "granite"):
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
