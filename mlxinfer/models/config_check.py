"""config.json values checked before a model is built from them.

A family's ``ModelArgs`` declares the keys it reads and their types; :func:`check_config` holds
every value a config gives for those keys to that declaration (JSON's ``true`` is not an int,
``4096.0`` is not an int, ``NaN`` is not a float, an int serves for a float), and the sizes to
the generous bounds of ``BOUNDS``; :func:`check_args` then checks what the family derived
(divisibility, experts per token). Anything a family's constructor still trips over
(``build_model`` catches it) is reported as a ConfigError naming config.json too, so no value
of the wrong type or sign reaches the user as a TypeError or ZeroDivisionError.

The bounds are far above any released model (Llama 3.1 405B: hidden 16,384, 126 layers,
128 heads; Gemma 3: vocabulary 262,144; DeepSeek-V3: 256 experts; Llama 4 Scout: a 10M
context), and low enough that no size, or product of two, overflows what MLX and NumPy index.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from ..errors import ConfigError

# key -> (least, most), inclusive. A key is checked only where the family declares it.
_SIZES = {
    "vocab_size": (1, 2**24),
    "hidden": (1, 2**17),
    "intermediate": (1, 2**20),
    "expert_intermediate": (0, 2**20),  # 0: a dense checkpoint of an MoE family
    "layers": (1, 1024),
    "heads": (1, 2**14),
    "head_dim": (1, 2**14),
    "positions": (1, 2**26),
    "experts": (0, 2**14),
    "some_experts": (1, 2**14),
    "layer_index": (0, 1024),
    "interval": (1, 1024),
}
BOUNDS: dict[str, tuple[int, int]] = {
    key: _SIZES[kind]
    for kind, keys in {
        "vocab_size": ["vocab_size"],
        "hidden": ["hidden_size", "n_embd", "n_embed", "d_model"],
        "intermediate": ["intermediate_size", "n_inner", "ffn_dim", "block_ff_dim"],
        "expert_intermediate": ["moe_intermediate_size", "shared_expert_intermediate_size"],
        "layers": ["num_hidden_layers", "n_layer", "num_layers"],
        "heads": [
            "num_attention_heads",
            "n_head",
            "attention_heads",
            "num_key_value_heads",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ],
        "head_dim": [
            "head_dim",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "kv_lora_rank",
            "q_lora_rank",
            "linear_key_head_dim",
            "linear_value_head_dim",
        ],
        "positions": [
            "max_position_embeddings",
            "n_positions",
            "seq_length",
            "original_max_position_embeddings",
        ],
        "experts": ["num_experts", "num_experts_per_tok", "n_shared_experts"],
        "some_experts": ["num_local_experts", "n_routed_experts", "n_group", "topk_group"],
        "layer_index": ["first_k_dense_replace"],
        "interval": [
            "decoder_sparse_step",
            "full_attention_interval",
            "no_rope_layer_interval",
            "sliding_window_pattern",
            "linear_conv_kernel_dim",
            "block_multiple_of",
        ],
    }.items()
    for key in keys
}
BOUNDS["conv_L_cache"] = (2, 1024)
# MTP heads (layers/mtp.py): the checkpoints ship 1 (MiMo-V2-Flash 3); each is a whole block.
BOUNDS["num_nextn_predict_layers"] = BOUNDS["mtp_num_hidden_layers"] = (0, 64)
BOUNDS["sliding_window"] = (0, 2**26)  # 0 in configs that do not use it; check_args: >= 1 if used
BOUNDS["max_window_layers"] = (0, 2**26)  # Qwen configs set it past the layer count
# XGLM's sinusoid table is computed at build: (positions + 2) x d_model float32s. 2**26 is
# 256 MB; XGLM 7.5B's is 2,050 x 4,096.
MAX_POSITION_TABLE = 2**26
# Floats that must be positive (the rest need only be finite).
POSITIVE = {
    "rope_theta",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "block_ffn_dim_multiplier",
}
NON_NEGATIVE = {"rms_norm_eps", "layer_norm_epsilon", "norm_eps"}
# Older names a family's from_dict copies onto a declared key.
ALIASES = {"n_embed": "hidden_size", "num_local_experts": "num_experts"}
# rope_scaling (normalised: config.py) numbers, each finite; the first set also > 0.
_ROPE_POSITIVE = {
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
}
_ROPE_FINITE = {"mscale", "mscale_all_dim", "llama_4_scaling_beta"}


def check_config(config: dict[str, Any], args_class: type, source: str = "config.json") -> None:
    """Raise a ConfigError naming ``source`` and the key for the first value ``args_class``
    (a family's ModelArgs dataclass) cannot take: wrong JSON type, out of ``BOUNDS``, or a
    float that is not finite (or not positive, where it must be)."""
    expected = _declared(args_class)
    for key, value in config.items():
        name = key if key in expected else ALIASES.get(key)
        if value is None or name not in expected:
            continue
        _check_type(key, value, expected[name], source)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key in BOUNDS or name in BOUNDS:
            least, most = BOUNDS.get(key) or BOUNDS[name]
            if not least <= value <= most:
                raise ConfigError(
                    f"{source}: key '{key}' must be in {least}..{most}, found {value!r}"
                )
        elif key in POSITIVE and not value > 0:
            raise ConfigError(f"{source}: key '{key}' must be > 0, found {value!r}")
        elif key in NON_NEGATIVE and not value >= 0:
            raise ConfigError(f"{source}: key '{key}' must be >= 0, found {value!r}")
    if "rope_scaling" in expected:
        check_rope_scaling(config.get("rope_scaling"), source)
    by_kind = config.get("rope_parameters_by_layer_type")
    if "rope_parameters_by_layer_type" in expected and isinstance(by_kind, dict):
        for kind, params in by_kind.items():
            where = f"{source} rope_parameters.{kind}"
            check_rope_scaling(params, where)
            theta = params.get("rope_theta")
            if theta is not None and not (_number(theta) and math.isfinite(theta) and theta > 0):
                raise ConfigError(f"{where}: 'rope_theta' must be > 0, found {_short(theta)}")


def check_rope_scaling(scaling: Any, source: str = "config.json") -> None:
    """The numbers of a normalised ``rope_scaling`` dict (None passes)."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(
            f"{source}: key 'rope_scaling' must be an object or null, found {_short(scaling)}"
        )
    if not isinstance(scaling.get("rope_type", "default"), str):
        raise ConfigError(
            f"{source}: rope_scaling 'rope_type' must be a string, found "
            f"{_short(scaling['rope_type'])}"
        )
    for key, value in scaling.items():
        if value is None:
            continue
        if key in _ROPE_POSITIVE or key in _ROPE_FINITE:
            if not _number(value) or not math.isfinite(value):
                raise ConfigError(
                    f"{source}: rope_scaling '{key}' must be a finite number, found {_short(value)}"
                )
            if key in _ROPE_POSITIVE and not value > 0:
                raise ConfigError(f"{source}: rope_scaling '{key}' must be > 0, found {value!r}")
        elif key == "original_max_position_embeddings":
            least, most = BOUNDS[key]
            if not _integer(value) or not least <= value <= most:
                raise ConfigError(
                    f"{source}: rope_scaling '{key}' must be an int in {least}..{most}, found "
                    f"{_short(value)}"
                )
        elif key in ("short_factor", "long_factor"):
            if not isinstance(value, list) or not all(
                _number(v) and math.isfinite(v) for v in value
            ):
                raise ConfigError(
                    f"{source}: rope_scaling '{key}' must be a list of finite numbers, found "
                    f"{_short(value)}"
                )
    if scaling.get("rope_type") == "llama3":
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        if _number(low) and _number(high) and not high > low:
            raise ConfigError(
                f"{source}: rope_scaling 'high_freq_factor' must exceed 'low_freq_factor', "
                f"found {high!r} and {low!r}"
            )


def check_args(args: Any, config: dict[str, Any], source: str = "config.json") -> None:
    """What a family derived from ``config``, checked where the network needs it: the hidden
    size divisible by the heads where heads are slices of it, the query heads a multiple of
    the key/value heads, 1..experts experts per token, expert groups that divide the experts."""
    hidden = _first(args, "hidden_size", "n_embd", "d_model")
    heads = _first(args, "num_attention_heads", "n_head", "attention_heads")
    # GPT-2, BLOOM and XGLM split the hidden vector itself into heads; the others project it
    # to heads x head_dim (transformers runs GLM-4-MoE's default 4096 / 96 heads of 42).
    if hidden is not None and heads and not hasattr(args, "head_dim") and hidden % heads:
        raise ConfigError(
            f"{source}: 'hidden_size' must be a multiple of 'num_attention_heads' (each head is "
            f"a slice of the hidden vector), found {hidden} and {heads}"
        )
    kv_heads = getattr(args, "num_key_value_heads", None)
    if heads and isinstance(kv_heads, int) and kv_heads and heads % kv_heads:
        raise ConfigError(
            f"{source}: 'num_attention_heads' must be a multiple of 'num_key_value_heads', "
            f"found {heads} and {kv_heads}"
        )
    per_token = getattr(args, "num_experts_per_tok", None)
    experts = _first(args, "num_local_experts", "num_experts", "n_routed_experts")
    if isinstance(experts, int) and experts > 0:  # 0 or None: a dense checkpoint
        if not isinstance(per_token, int) or not 1 <= per_token <= experts:
            raise ConfigError(
                f"{source}: 'num_experts_per_tok' must be in 1..{experts} (the number of "
                f"experts), found {per_token!r}"
            )
        groups, top_groups = getattr(args, "n_group", None), getattr(args, "topk_group", None)
        if isinstance(groups, int) and (experts % groups or not 1 <= (top_groups or 1) <= groups):
            raise ConfigError(
                f"{source}: 'n_group' must divide the {experts} experts and 'topk_group' be in "
                f"1..n_group, found n_group={groups}, topk_group={top_groups}"
            )
    if getattr(args, "model_type", None) == "xglm":  # its sinusoid table is built eagerly
        cells = (args.max_position_embeddings + 2) * args.d_model
        if cells > MAX_POSITION_TABLE:
            raise ConfigError(
                f"{source}: 'max_position_embeddings' x 'd_model' make a {cells}-entry position "
                f"table, over the limit of {MAX_POSITION_TABLE}, found "
                f"{args.max_position_embeddings} and {args.d_model}"
            )
    window = getattr(args, "sliding_window", None)
    if isinstance(window, int) and window < 1:
        raise ConfigError(f"{source}: 'sliding_window' must be >= 1 where used, found {window}")
    rope_dim = getattr(args, "qk_rope_head_dim", None)
    if isinstance(rope_dim, int) and rope_dim % 2:
        raise ConfigError(f"{source}: 'qk_rope_head_dim' must be even, found {rope_dim}")


def check_built(model: Any, source: str = "config.json") -> None:
    """What only the built model shows: every rotary embedding rotates an even number (>= 2)
    of features (``mx.fast.rope`` refuses others at the first forward), however the family
    derived it (head_dim, times partial_rotary_factor, MLA's qk_rope_head_dim)."""
    from .layers.rope import LongRoPE, RoPE

    for _, module in model.named_modules():
        if isinstance(module, (RoPE, LongRoPE)) and (module.dims < 2 or module.dims % 2):
            raise ConfigError(
                f"{source}: the rotary embedding would rotate {module.dims} features of each "
                "head (head_dim, times partial_rotary_factor where given); expected an even "
                "number >= 2"
            )


# --- types ----------------------------------------------------------------------------------------


def _declared(args_class: type) -> dict[str, tuple[str, str | None]]:
    """field -> (JSON kind, element kind for lists), from the dataclass annotations."""
    hints = typing.get_type_hints(args_class)
    out = {}
    for field in dataclasses.fields(args_class):
        kind = _kind(hints.get(field.name))
        if kind is not None:
            out[field.name] = kind
    return out


def _kind(hint: Any) -> tuple[str, str | None] | None:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _kind(args[0]) if len(args) == 1 else None
    origin = typing.get_origin(hint) or hint
    if origin is list:
        element = _kind(args[0]) if args else None
        return ("list", element[0] if element else None)
    if origin is dict:
        return ("dict", None)
    if origin in (int, float, bool, str):
        return (origin.__name__, None)
    return None


_JSON_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
_JSON_NAMES.update(list="a list", dict="an object")


def _check_type(key: str, value: Any, kind: tuple[str, str | None], source: str) -> None:
    outer, element = kind
    if _is(value, outer) and (
        outer != "list" or element is None or all(_is(v, element) for v in value)
    ):
        return
    want = _JSON_NAMES[outer] + (
        f" of {_JSON_NAMES[element]}s" if outer == "list" and element else ""
    )
    if outer == "float":
        want = "a finite number"
    raise ConfigError(f"{source}: key '{key}' must be {want}, found {_short(value)}")


def _is(value: Any, kind: str) -> bool:
    if kind == "int":
        return _integer(value)
    if kind == "float":
        return _number(value) and math.isfinite(value)
    if kind == "bool":
        return isinstance(value, bool)
    return isinstance(value, {"str": str, "list": list, "dict": dict}[kind])


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first(args: Any, *names: str) -> Any:
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
