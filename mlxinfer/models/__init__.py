"""Model families, keyed by the HF ``model_type`` in config.json."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ..errors import ConfigError
from .config_check import check_args, check_built, check_config

# model_type -> module in this package. Aliases differ only in config.
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "ministral3": "ministral3",
    "smollm3": "smollm3",
    "granite": "granite",
    "granitemoe": "granitemoe",
    "olmo2": "olmo2",
    "olmo3": "olmo3",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "mimo": "mimo",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "gemma3": "gemma3",  # with its vision tower (config.py: only with a vision_config)
    "qwen2_5_vl": "qwen2_5_vl",  # with their towers, as gemma3
    "qwen3_vl": "qwen3_vl",
    "qwen3_5": "qwen3_5_vl",  # Qwen3-VL's tower over the qwen3_5 hybrid trunk
    "qwen3_5_moe": "qwen3_5_vl",
    "mistral3": "mistral3",  # Pixtral tower over mistral / ministral3 text
    "llava": "llava",  # CLIP (or Pixtral) tower over llama / mistral text
    "idefics3": "idefics3",  # SmolVLM: SigLIP tower, pixel-shuffle connector, llama text
    "smolvlm": "idefics3",  # SmolVLM2: the same network
    "phi3": "phi3",
    "gpt2": "gpt2",
    "bloom": "bloom",
    "xglm": "xglm",
    "lfm2": "lfm2",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "gpt_oss": "gpt_oss",
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v2",
    "glm4_moe_lite": "deepseek_v2",
    "glm4_moe": "glm4_moe",
    "bert": "bert",
}


def get_family(config: dict[str, Any], source: str = "config.json"):
    """Return the family module for ``config['model_type']``."""
    model_type = config.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing required key 'model_type'")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: key 'model_type' must be a string, found {model_type!r:.80}")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"{source}: unknown model_type '{model_type}' "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    return import_module(f".{FAMILIES[model_type]}", __name__)


# What a family's constructor may raise for a value the checks let through.
_BUILD_ERRORS: tuple[type[Exception], ...]
_BUILD_ERRORS = (TypeError, ValueError, ArithmeticError, KeyError, IndexError, AttributeError)
_BUILD_ERRORS += (RecursionError, MemoryError, RuntimeError)


def build_model(config: dict[str, Any], source: str = "config.json"):
    """Instantiate the (unloaded) model a config describes.

    The config's values are checked first (config_check.py); anything the family's
    constructor still trips over is a ConfigError naming ``source`` too, never a bare
    TypeError or ZeroDivisionError.
    """
    family = get_family(config, source)
    check_config(config, family.ModelArgs, source)
    try:
        args = family.ModelArgs.from_dict(config)
        check_args(args, config, source)
        model = family.Model(args)
        check_built(model, source)
        return model
    except _BUILD_ERRORS as e:
        reason = " ".join(str(e).split())[:160]
        raise ConfigError(
            f"{source}: cannot build a '{config['model_type']}' model from it "
            f"({type(e).__name__}: {reason})"
        ) from e
