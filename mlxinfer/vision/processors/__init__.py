"""Image processors, one module per family, and :func:`load_processor`, which reads a checkpoint.

Each family matches transformers' PIL image processor and its Processor's text expansion:

- ``gemma3.py``: Gemma 3 (``Gemma3ImageProcessorPil`` + ``Gemma3Processor``);
- ``qwen_vl.py``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 (``Qwen2VLImageProcessorPil`` +
  ``Qwen2VLProcessor``/``Qwen2_5_VLProcessor``/``Qwen3VLProcessor``);
- ``pixtral.py``: Mistral 3 and Pixtral (``PixtralImageProcessorPil`` + ``PixtralProcessor``);
- ``llava.py``: LLaVA with a CLIP tower (``CLIPImageProcessorPil`` + ``LlavaProcessor``);
- ``idefics3.py``: Idefics3 and SmolVLM (``Idefics3ImageProcessorPil`` + ``Idefics3Processor``;
  SmolVLM's are subclasses with the same steps and text).

Where the settings are: transformers 5 saves one ``processor_config.json`` with the image
processor's settings nested under ``image_processor`` (and no ``preprocessor_config.json``);
older checkpoints have ``preprocessor_config.json`` (and a ``processor_config.json`` with only
the processor's own keys, or none). As transformers does, the nested dict wins, then
preprocessor_config.json. Token ids come from config.json (``image_token_index``,
``image_token_id``, ``boi_token_index``, ``vision_start_token_id``...); the token strings from
tokenizer_config.json's top-level keys (``image_token``, ``boi_token``, ``eoi_token``; also
inside ``extra_special_tokens``), else each family's defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .base import ImageProcessor, ProcessedImages, Settings
from .gemma3 import Gemma3Processor
from .idefics3 import Idefics3Processor
from .llava import LlavaProcessor
from .pixtral import PixtralProcessor
from .qwen_vl import QwenVLProcessor, smart_resize

__all__ = [
    "Gemma3Processor",
    "Idefics3Processor",
    "ImageProcessor",
    "LlavaProcessor",
    "PixtralProcessor",
    "ProcessedImages",
    "QwenVLProcessor",
    "Settings",
    "load_processor",
    "smart_resize",
]

# image_processor_type (its "Fast"/"Pil" suffix dropped) -> family
_BY_PROCESSOR_TYPE = {
    "Gemma3ImageProcessor": "gemma3",
    "Qwen2VLImageProcessor": "qwen_vl",
    "PixtralImageProcessor": "pixtral",
    "CLIPImageProcessor": "llava",
    "LlavaImageProcessor": "llava",
    "Idefics3ImageProcessor": "idefics3",
    "SmolVLMImageProcessor": "idefics3",
}
# config.json model_type -> family, where the processor config names no type
_BY_MODEL_TYPE = {
    "gemma3": "gemma3",
    "qwen2_vl": "qwen_vl",
    "qwen2_5_vl": "qwen_vl",
    "qwen3_vl": "qwen_vl",
    "qwen3_vl_moe": "qwen_vl",
    "qwen3_5": "qwen_vl",
    "qwen3_5_moe": "qwen_vl",
    "mistral3": "pixtral",
    "llava": "llava",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
}
_TOKEN_KEYS = (
    "image_token",
    "boi_token",
    "eoi_token",
    "vision_start_token",
    "vision_end_token",
    "video_token",
)


def load_processor(
    model_dir: str | Path, *, tokenizer: Any = None, pan_and_scan: bool = False
) -> ImageProcessor | None:
    """The image processor of the checkpoint in ``model_dir``, or None for a text-only model
    (no ``vision_config`` in config.json).

    ``tokenizer`` (anything with ``token_to_id(str) -> int | None``, such as mlxinfer's
    ``Tokenizer``) is optional: given, each special token's id in config.json is checked against
    it, and supplies an id config.json lacks. ``pan_and_scan`` turns on Gemma 3's pan and scan
    (off by default, as ``Gemma3Processor`` has it). A vision model whose processor is not one
    mlxinfer knows, or whose settings are missing or malformed, is a one-line ConfigError.
    """
    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    config = _read_json(config_file, required=True)
    if not isinstance(config.get("vision_config"), dict):
        return None
    processor_file = model_dir / "processor_config.json"
    preprocessor_file = model_dir / "preprocessor_config.json"
    processor = _read_json(processor_file)
    preprocessor = _read_json(preprocessor_file)
    if isinstance(processor.get("image_processor"), dict):
        image, where = processor["image_processor"], f"{processor_file} (image_processor)"
    elif preprocessor:
        image, where = preprocessor, str(preprocessor_file)
    else:
        raise ConfigError(
            f"{model_dir}: a vision model ({config_file.name} has vision_config) without image "
            f"processor settings (expected {processor_file.name} with image_processor, or "
            f"{preprocessor_file.name})"
        )
    processor_keys = {k: v for k, v in processor.items() if not isinstance(v, dict)}
    model_type = config.get("model_type")
    kind = image.get("image_processor_type")
    family = None
    if isinstance(kind, str):
        family = _BY_PROCESSOR_TYPE.get(kind.removesuffix("Fast").removesuffix("Pil"))
    elif isinstance(model_type, str):
        family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        known = ", ".join(sorted(_BY_PROCESSOR_TYPE))
        raise ConfigError(
            f"{where}: image_processor_type {kind!r} (model_type {model_type!r}) has no image "
            f"processor in mlxinfer (expected one of {known})"
        )
    settings = Settings(
        config=config,
        image=image,
        processor=processor_keys,
        tokens=_token_strings(_read_json(model_dir / "tokenizer_config.json")),
        where=where,
        config_file=str(config_file),
        vocab=getattr(tokenizer, "token_to_id", None),
    )
    if family == "gemma3":
        return Gemma3Processor.from_settings(settings, pan_and_scan=pan_and_scan)
    if family == "pixtral":
        return PixtralProcessor.from_settings(settings)
    if family == "llava":
        return LlavaProcessor.from_settings(settings)
    if family == "idefics3":
        return Idefics3Processor.from_settings(settings)
    return QwenVLProcessor.from_settings(settings)


def _token_strings(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    found: dict[str, str] = {}
    for source in (
        tokenizer_config.get("model_specific_special_tokens"),
        tokenizer_config.get("extra_special_tokens"),
        tokenizer_config,
    ):
        if not isinstance(source, dict):
            continue
        for key in _TOKEN_KEYS:
            value = source.get(key)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str) and value:
                found[key] = value
    return found


def _read_json(path: Path, *, required: bool = False) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: missing (expected the model's config.json)") from None
        return {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a JSON {type(data).__name__} (expected an object)")
    return data
