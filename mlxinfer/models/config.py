"""Read a checkpoint's config.json into one normalised dict.

Transformers 4 writes RoPE settings as ``rope_theta`` + ``rope_scaling``;
transformers 5 writes a single ``rope_parameters`` dict (``rope_type``,
``rope_theta`` and the scaling fields). Both become ``rope_theta`` (float)
and ``rope_scaling`` (dict with ``rope_type``, or None) here, so model modules
read one form.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import ConfigError

ROPE_DEFAULT_THETA = 10000.0
MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KB; a multimodal one with its tables, < 1 MB


def read_config(model_dir: Path) -> dict[str, Any]:
    """Load ``model_dir/config.json`` and normalise it (see module doc)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path}: missing config.json (expected a model directory with config.json)"
        )
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path}: {path.stat().st_size} bytes, over the {MAX_CONFIG_BYTES}-byte limit "
                "for a config.json"
            )
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError(f"{path}: not valid JSON ({reason})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return normalize_rope(language_model_config(config, str(path)), source=str(path))


# Multimodal checkpoints whose language model runs alone: model_type -> the text model_type
# when ``text_config`` names none (Mistral Small 3.1's is "mistral", Ministral 3's "ministral3").
LANGUAGE_MODELS = {
    "gemma3": "gemma3_text",
    "mistral3": "mistral",
    "llava": "llama",
    "idefics3": "llama",
    "smolvlm": "llama",
    # On text alone the M-RoPE of these is plain RoPE: their language models are qwen2 / qwen3's.
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}


_QWEN_VL_KEYS = (
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)

# Of those, the ones whose vision tower runs too (models/<model_type>.py), when the config has a
# ``vision_config``: the top-level keys their family reads beside the lifted ``text_config``.
WITH_TOWER = {
    "gemma3": (
        "vision_config",
        "mm_tokens_per_image",
        "image_token_index",
        "boi_token_index",
        "eoi_token_index",
    ),
    "qwen2_5_vl": _QWEN_VL_KEYS,
    "qwen3_vl": _QWEN_VL_KEYS,
    "qwen3_5": _QWEN_VL_KEYS,
    "qwen3_5_moe": _QWEN_VL_KEYS,
    "mistral3": (
        "vision_config",
        "image_token_index",
        "spatial_merge_size",
        "projector_hidden_act",
        "vision_feature_layer",
        "multimodal_projector_bias",
        "text_model_type",
    ),
    "idefics3": ("vision_config", "image_token_id", "scale_factor"),
    "smolvlm": ("vision_config", "image_token_id", "scale_factor"),
    "llava": (
        "vision_config",
        "image_token_index",
        "projector_hidden_act",
        "vision_feature_layer",
        "vision_feature_select_strategy",
        "multimodal_projector_bias",
        "image_seq_length",
        "text_model_type",
    ),
}


def language_model_config(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """A multimodal checkpoint's config (``LANGUAGE_MODELS``) as its language model's:
    ``text_config`` lifted to the top, ``language_model_of`` naming what it came from; for one
    whose tower runs too (``WITH_TOWER``), its own model_type and the tower's keys beside."""
    kind = config.get("model_type")
    if not isinstance(kind, str):  # get_family reports it (a missing or mistyped model_type)
        return config
    if kind not in LANGUAGE_MODELS:
        return config
    text = config.get("text_config")
    with_tower = kind in WITH_TOWER and isinstance(config.get("vision_config"), dict)
    if with_tower and text is None and "hidden_size" in config:
        return config  # already in this form (our own `convert` wrote it)
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a '{kind}' checkpoint needs a 'text_config' object")
    text_kind = text.get("model_type") or LANGUAGE_MODELS[kind]
    if text_kind.endswith("_vl_text"):  # qwen2_5_vl_text, qwen3_vl_text: no family of their own
        text_kind = LANGUAGE_MODELS[kind]
    out = {**text, "model_type": text_kind, "language_model_of": kind}
    if with_tower:  # the whole model: its family reads the tower's keys beside the text's
        out = {**text, **{k: config[k] for k in WITH_TOWER[kind] if k in config}}
        out["model_type"] = kind
        if "text_model_type" in WITH_TOWER[kind]:  # a family over several text models
            out["text_model_type"] = text_kind
    # The whole model's flag decides the tie (transformers 5 ties by the top-level config:
    # Mistral3Config defaults to tied while its text_config says untied).
    if "tie_word_embeddings" in config:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    return out


def without_tower(config: dict[str, Any]) -> dict[str, Any]:
    """A ``WITH_TOWER`` config (as read) as its language model's alone: for a checkpoint that
    kept the config but not the tower's weights."""
    kind = config.get("model_type")
    if kind not in WITH_TOWER:
        return config
    out = {k: v for k, v in config.items() if k not in WITH_TOWER[kind]}
    text_kind = config.get("text_model_type") or LANGUAGE_MODELS[kind]
    return {**out, "model_type": text_kind, "language_model_of": kind}


def normalize_rope(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """Fold ``rope_parameters`` (transformers 5) into ``rope_theta``/``rope_scaling``.

    Multimodal RoPE's keys (``mrope_section``, ``mrope_interleaved``: Qwen-VL, Qwen3.5) move
    to the top level, where a family that reads them declares them; its ``rope_type`` "mrope"
    (older Qwen2-VL configs) is the default RoPE over those sections."""
    config = dict(config)
    params = config.pop("rope_parameters", None)
    for holder in (params, config.get("rope_scaling")):
        if isinstance(holder, dict):
            for key in _MROPE_KEYS:
                if key in holder:
                    config.setdefault(key, holder[key])
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type parameters (e.g. gemma3: full_attention / sliding_attention)
        # are kept for the family module that knows the layer types.
        config["rope_parameters_by_layer_type"] = params
        params = None
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(
                f"{source}: key 'rope_parameters' must be an object, found {params!r}"
            )
        config.setdefault("rope_theta", params.get("rope_theta", ROPE_DEFAULT_THETA))
        given = {k: v for k, v in params.items() if k != "rope_theta"}
        config["rope_scaling"] = given if _rope_type(given) != "default" else None
        if "partial_rotary_factor" in params:
            config.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
    scaling = config.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ConfigError(
                f"{source}: key 'rope_scaling' must be an object or null, found {scaling!r}"
            )
        scaling = dict(scaling)
        scaling["rope_type"] = _rope_type(scaling)
        scaling.pop("type", None)
        config["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
    config["rope_theta"] = _positive(
        config.get("rope_theta", ROPE_DEFAULT_THETA), "rope_theta", source
    )
    return config


def _positive(value: Any, key: str, source: str) -> float:
    """``value`` as a float, or a ConfigError unless it is a finite number > 0."""
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past the float range
            number = math.inf
    if not 0 < number < math.inf:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ConfigError(f"{source}: key '{key}' must be a finite number > 0, found {shown}")
    return number


_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _rope_type(scaling: dict[str, Any]) -> str:
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    return "default" if kind == "mrope" else kind


def require(config: dict[str, Any], keys: list[str], source: str = "config.json") -> None:
    """Raise a ConfigError naming the first required key that is absent."""
    for key in keys:
        if key not in config or config[key] is None:
            raise ConfigError(
                f"{source}: missing required key '{key}' for model_type '{config.get('model_type')}'"
            )
