"""config.json from a GGUF file's metadata, in transformers 5's form, for each architecture.

``make_config`` reads the ``<arch>.*`` keys through typed, range-checked lookups (metadata.py;
a wrong type or range is a ConfigError naming the key, a needed key that is absent a
WeightsError), checks them against the tensors (embedding rows and width, head sizes), and
adds what llama.cpp hard-codes for each family (arch.py's notes list it). Every size is
bounded (``MAX_*`` below), so nothing sized from the metadata is a hostile allocation.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from ..errors import ConfigError, WeightsError
from . import deepseek2, qwen35
from . import metadata as meta
from .rope_freqs import llama3_scaling


def _f32(x) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


# Bounds on what a file's metadata may ask for: far above every published model (Llama 3.1
# 405B: 126 layers, 16384 wide, 128 heads; Kimi K2: 384 experts; Llama 4 Scout: 10M tokens of
# context), low enough that nothing sized from them (per-layer lists, RoPE tables, a KV
# budget) is a hostile allocation. Every tensor's own size is bounded by the file.
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 20  # hidden, FFN, head and window sizes
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 26
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_ROPE = 1e12  # rope.freq_base, scaling factors, YaRN betas


class _Meta:
    """Typed metadata lookups under the architecture's prefix (metadata.py): a wrong type or
    range is a ConfigError naming the key; a needed key that is absent, a WeightsError."""

    def __init__(self, path: Path, md: dict, arch: str, read=None):
        self.path, self.md, self.arch = path, md, arch
        self.read = read  # a tensor's values as float32 (GGUFTensor -> ndarray), or None

    def integer(self, key: str, *, lo: int = 1, hi: int, default=meta.REQUIRED) -> int:
        return meta.integer(self.path, self.md, f"{self.arch}.{key}", lo=lo, hi=hi, default=default)

    def number(self, key: str, *, hi: float = MAX_ROPE, default=meta.REQUIRED) -> float:
        return meta.number(self.path, self.md, f"{self.arch}.{key}", hi=hi, default=default)

    def string(self, key: str, default=meta.REQUIRED) -> str | None:
        return meta.string(self.path, self.md, f"{self.arch}.{key}", default=default)

    def flag(self, key: str, default: bool) -> bool:
        return meta.boolean(self.path, self.md, f"{self.arch}.{key}", default=default)

    def error(self, key: str, expected: str, found) -> ConfigError:
        return ConfigError(f"{self.path}: {self.arch}.{key}: expected {expected}, found {found}")


def _rope_scaling(m: _Meta, **yarn_defaults) -> dict | None:
    """``rope.scaling.*`` as HF's ``rope_scaling`` (none, linear or yarn)."""
    kind = m.string("rope.scaling.type", default=None)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(m.number("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": _f32(m.number("rope.scaling.factor", default=1.0)),
        }
        original = m.integer("rope.scaling.original_context_length", hi=MAX_CONTEXT, default=None)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        for key in ("beta_fast", "beta_slow"):
            value = m.number(f"rope.scaling.yarn_{key}", default=yarn_defaults.get(key))
            if value is not None:
                scaling[key] = _f32(value)
        return {**yarn_defaults, **scaling}
    raise WeightsError(
        f"{m.path}: {m.arch}.rope.scaling.type={kind!r:.80} not supported "
        "(expected none, linear or yarn)"
    )


def _token_ids(path: Path, md: dict, config: dict, rows: int) -> None:
    """BOS, EOS and padding ids. BOS is fed to the model, so it must be an embedding row;
    EOS and padding are only compared against, so one past the rows is dropped with a warning."""
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):  # fmt: skip
        full = f"tokenizer.ggml.{gguf_key}"
        i = meta.integer(path, md, full, lo=-(2**63), hi=2**64, default=None)
        if i is None:
            continue
        if not 0 <= i < rows and key == "bos_token_id":
            raise ConfigError(
                f"{path}: {full}: expected a token id in [0, {rows}) (token_embd.weight's rows; "
                f"BOS is fed to the model), found {i}"
            )
        if not 0 <= i < rows:
            warnings.warn(
                f"{path}: {full} is {i}, past the {rows} embedding rows; ignored",
                RuntimeWarning,
                stacklevel=4,
            )
            continue
        config[key] = i


def _embedding(path: Path, md: dict, tensors: dict) -> tuple[int, int]:
    """token_embd.weight's (rows, width); the vocabulary may not name more tokens than rows."""
    shape = tensors["token_embd.weight"].shape
    if len(shape) != 2:
        raise WeightsError(
            f"{path}: tensor token_embd.weight has shape {shape}; expected (vocab, hidden)"
        )
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > shape[0]:
        raise ConfigError(
            f"{path}: tokenizer.ggml.tokens: expected at most {shape[0]} tokens "
            f"(token_embd.weight's rows), found {len(tokens)}"
        )
    return shape


def make_config(arch: str, path: Path, md: dict, tensors: dict, read=None) -> dict:
    """config.json for the model the GGUF describes, in transformers 5's form (``read``: a
    tensor's values, for settings stored as a tensor: Llama 3.1's ``rope_freqs``)."""
    m = _Meta(path, md, arch, read)
    moe = arch in ("qwen3moe", "gpt-oss", "glm4moe", "qwen35moe", "qwen3next", "deepseek2")
    experts = m.integer("expert_count", lo=0, hi=MAX_EXPERTS, default=0)
    if experts and not moe:
        raise WeightsError(
            f"{path}: {arch}.expert_count={experts}: mixture-of-experts GGUF not supported"
        )
    rows, width = _embedding(path, md, tensors)
    hidden = m.integer("embedding_length", hi=MAX_WIDTH)
    if hidden != width:
        raise m.error("embedding_length", f"{width} (token_embd.weight's width)", hidden)
    n_heads = m.integer("attention.head_count", hi=MAX_HEADS)
    n_kv = m.integer("attention.head_count_kv", hi=n_heads, default=n_heads)
    if n_heads % n_kv:
        raise m.error("attention.head_count_kv", f"a divisor of the {n_heads} heads", n_kv)
    # RoPE turns pairs of channels: every head size is even
    if f"{arch}.attention.key_length" in md:
        head_dim = m.integer("attention.key_length", hi=MAX_WIDTH)
        if head_dim % 2:
            raise m.error("attention.key_length", "an even head size", head_dim)
    elif hidden % n_heads or hidden // n_heads % 2:
        expected = f"a divisor of the width {hidden} giving an even head size"
        raise m.error("attention.head_count", expected, n_heads)
    else:
        head_dim = hidden // n_heads
    vocab = m.integer("vocab_size", hi=MAX_VOCAB, default=rows)
    if vocab != rows:
        raise m.error("vocab_size", f"{rows} (token_embd.weight's rows)", vocab)
    eps_default = 1e-5 if arch in ("llama", "gpt-oss") else 1e-6
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": m.integer("block_count", hi=MAX_LAYERS),
        # a mixture of experts may have no dense FFN at all
        "intermediate_size": m.integer("feed_forward_length", lo=0 if moe else 1, hi=MAX_WIDTH),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(
            m.number("attention.layer_norm_rms_epsilon", hi=1.0, default=eps_default)
        ),
        "vocab_size": vocab,
        "max_position_embeddings": m.integer("context_length", hi=MAX_CONTEXT),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    rope_theta = _f32(m.number("rope.freq_base", default=10000.0))
    config = _ARCH_CONFIG[arch](m, tensors, config, rope_theta)
    _token_ids(path, md, config, rows)
    return config


def _llama(m: _Meta, tensors: dict, config: dict, rope_theta: float, scaling: bool = True) -> dict:
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
    scaling = _rope_scaling(m)
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


def _gemma3(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers, hidden, n_heads = (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
    )
    # llama.cpp's hard-coded default: every 6th layer global
    pattern = m.integer("attention.sliding_window_pattern", hi=MAX_LAYERS, default=6)
    global_rope = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = _rope_scaling(m)
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
        "query_pre_attn_scalar": hidden // n_heads if n_layers == 62 else config["head_dim"],
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _mistral3(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    scaling = _rope_scaling(m)
    out = {
        **_llama(m, tensors, config, rope_theta, scaling=False),
        "architectures": ["Ministral3ForCausalLM"],
        "model_type": "ministral3",
    }
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            raise m.error("rope.scaling.type", "yarn or none", scaling["rope_type"])
        mscale = _f32(m.number("rope.scaling.yarn_log_multiplier", hi=1e6, default=1.0))
        beta = m.number("attention.temperature_scale", hi=1e6, default=None)
        out["rope_scaling"] = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
        if beta is not None:
            out["rope_scaling"]["llama_4_scaling_beta"] = _f32(beta)
    return out


def _smollm3(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    return {
        **_llama(m, tensors, config, rope_theta),
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n_layers)],  # llama.cpp's step 4
    }


def _olmo2(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    out = {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        **config,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(m),
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


def _phi3(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
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
            "long_factor": [_f32(x) for x in long],
            "short_factor": [_f32(x) for x in short],
            "original_max_position_embeddings": out["original_max_position_embeddings"],
        }
    return out


def _gemma2(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers, hidden, n_heads = (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
    )
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
        "query_pre_attn_scalar": hidden // n_heads if n_layers == 46 else config["head_dim"],
        "attn_logit_softcapping": _f32(m.number("attn_logit_softcapping", hi=1e6, default=50.0)),
        "final_logit_softcapping": _f32(m.number("final_logit_softcapping", hi=1e6, default=30.0)),
    }


def _qwen2(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **config,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(m),
        "use_sliding_window": False,
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


def _gpt_oss(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    n_layers = config["num_hidden_layers"]
    window = m.integer("attention.sliding_window", lo=0, hi=MAX_CONTEXT, default=None)
    n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
    ffn = m.integer("expert_feed_forward_length", hi=MAX_WIDTH, default=None)
    scaling = _rope_scaling(m, **_GPT_OSS_YARN)
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


def _glm4moe(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
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
        "rope_scaling": _rope_scaling(m),
        "n_routed_experts": n_experts,
        "num_experts_per_tok": m.integer("expert_used_count", hi=n_experts),
        "moe_intermediate_size": m.integer("expert_feed_forward_length", hi=MAX_WIDTH),
        "n_shared_experts": m.integer("expert_shared_count", lo=0, hi=MAX_EXPERTS),
        "first_k_dense_replace": m.integer("leading_dense_block_count", lo=0, hi=trunk, default=0),
        "routed_scaling_factor": _f32(m.number("expert_weights_scale", hi=1e6)),
        "norm_topk_prob": m.flag("expert_weights_norm", False),  # llama.cpp's default
        "n_group": 1,  # llama.cpp routes GLM-4.5 in one group
        "topk_group": 1,
    }
    if int(head_dim * config["partial_rotary_factor"]) != rope_dims:  # never for real sizes
        raise m.error("rope.dimension_count", f"a count the factor of {head_dim} keeps exactly",
                      rope_dims)  # fmt: skip
    return config


def _qwen35(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    return qwen35.config(m, tensors, config, rope_theta, MAX_LAYERS, MAX_WIDTH)


def _deepseek2(m: _Meta, tensors: dict, config: dict, rope_theta: float) -> dict:
    limits = {"layers": MAX_LAYERS, "width": MAX_WIDTH, "experts": MAX_EXPERTS}
    return deepseek2.config(m, tensors, config, rope_theta, _rope_scaling(m), limits)


_ARCH_CONFIG = {
    "llama": _llama,
    "qwen2": _qwen2,
    "smollm3": _smollm3,
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
