"""LLaVA with a CLIP tower: the shortest edge resized, a center crop, ``<image>`` repeated.

The reference is transformers' ``CLIPImageProcessorPil`` (models/clip/
image_processing_pil_clip.py: the ``PilBackend`` with CLIP's defaults; ``CLIPImageProcessor``
is the torchvision one) as ``LlavaProcessor`` calls it:

- resized with ``resample`` (3: bicubic) so the shortest side is ``size.shortest_edge``, the
  other ``int(shortest_edge * long / short)`` (truncated: ``get_resize_output_image_size`` with
  ``default_to_square=False``), or to ``size.height`` x ``size.width`` where the size says so;
- center-cropped to ``crop_size`` (top = (height - crop) // 2; a side shorter than the crop is
  padded with zeros first, centred by ceil), still uint8;
- rescaled and normalized (CLIP's mean and std by default), channels first: (N, C, crop, crop);
- each ``<image>`` the chat template wrote becomes ``<image>`` x (crop_h // patch) x
  (crop_w // patch) + ``num_additional_image_tokens`` (1 for CLIP's class token), minus one for
  the ``vision_feature_select_strategy`` "default" (the class token dropped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConfigError
from ..media import Image
from .base import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ProcessedImages,
    Settings,
    SettingsVariant,
    expand_markers,
    flag,
    integer,
    normalization,
    resample_of,
    rescale_normalize,
    resize,
    to_rgb_array,
)

IMAGE_TOKEN = "<image>"


def resized_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """transformers' ``get_resize_output_image_size(default_to_square=False)``: (height, width)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``image_transforms.center_crop`` on an (H, W, C) array."""
    orig_h, orig_w = array.shape[:2]
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    if top >= 0 and left >= 0 and top + height <= orig_h and left + width <= orig_w:
        return array[top : top + height, left : left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros((new_h, new_w, *array.shape[2:]), array.dtype)
    top_pad, left_pad = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[top_pad : top_pad + orig_h, left_pad : left_pad + orig_w] = array
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]


@dataclass(frozen=True)
class LlavaProcessor(SettingsVariant):
    image_token_id: int
    image_token: str = IMAGE_TOKEN
    shortest_edge: int | None = 224
    height: int | None = None
    width: int | None = None
    crop_height: int = 224
    crop_width: int = 224
    patch_size: int = 14
    num_additional_image_tokens: int = 0
    drop_class_token: bool = True
    resample: int = 3
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    family: str = field(default="llava", init=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> LlavaProcessor:
        image, where, config = settings.image, settings.where, settings.config
        processor = settings.processor
        size = image.get("size") if image.get("size") is not None else {"shortest_edge": 224}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        shortest = height = width = None
        if isinstance(size, dict) and size.get("shortest_edge") is not None:
            shortest = integer(size["shortest_edge"], None, "size.shortest_edge", where)
        elif isinstance(size, dict) and {"height", "width"} <= size.keys():
            height = integer(size["height"], None, "size.height", where)
            width = integer(size["width"], None, "size.width", where)
        else:
            raise ConfigError(f"{where}: size is {size!r} (expected {{'shortest_edge': N}})")
        crop = image.get("crop_size") if image.get("crop_size") is not None else 224
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if not isinstance(crop, dict) or not {"height", "width"} <= crop.keys():
            raise ConfigError(f"{where}: crop_size is {crop!r} (expected height and width)")
        if flag(image.get("do_pad"), False):  # LlavaImageProcessor's pad to square
            raise ConfigError(f"{where}: do_pad is true (mlxinfer's LLaVA processor crops only)")
        vision = config.get("vision_config") or {}
        patch = integer(
            processor.get("patch_size"), vision.get("patch_size") or 14, "patch_size", where
        )
        strategy = processor.get("vision_feature_select_strategy")
        strategy = strategy or config.get("vision_feature_select_strategy") or "default"
        extra = processor.get("num_additional_image_tokens")
        extra = integer(extra, 0, "num_additional_image_tokens", where, minimum=0)
        token = processor.get("image_token")
        token = token if isinstance(token, str) and token else None
        token = token or settings.tokens.get("image_token", IMAGE_TOKEN)
        return cls(
            image_token=token,
            image_token_id=settings.required_id(token, ("image_token_index", "image_token_id")),
            shortest_edge=shortest,
            height=height,
            width=width,
            crop_height=integer(crop["height"], None, "crop_size.height", where),
            crop_width=integer(crop["width"], None, "crop_size.width", where),
            patch_size=patch,
            num_additional_image_tokens=extra,
            drop_class_token=strategy == "default",
            resample=resample_of(image.get("resample"), 3, where),
            do_resize=flag(image.get("do_resize"), True),
            do_center_crop=flag(image.get("do_center_crop"), True),
            **normalization(image, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, where),
        )

    @property
    def marker(self) -> str:
        return self.image_token

    def tokens(self, height: int, width: int) -> int:
        """``LlavaProcessor.replace_image_token``'s count for pixels of (height, width)."""
        n = (height // self.patch_size) * (width // self.patch_size)
        return n + self.num_additional_image_tokens - (1 if self.drop_class_token else 0)

    def prepare(self, images: Sequence[Image]) -> ProcessedImages:
        arrays = []
        for image in images:
            picture = to_rgb_array(image)
            if self.do_resize:
                if self.shortest_edge is not None:
                    height, width = resized_size(picture.height, picture.width, self.shortest_edge)
                else:
                    assert self.height is not None and self.width is not None
                    height, width = self.height, self.width
                picture = resize(picture, height, width, self.resample)
            array = np.asarray(picture)
            if self.do_center_crop:
                array = center_crop(array, self.crop_height, self.crop_width)
            arrays.append(
                rescale_normalize(
                    array,
                    do_rescale=self.do_rescale,
                    rescale_factor=self.rescale_factor,
                    do_normalize=self.do_normalize,
                    mean=self.image_mean,
                    std=self.image_std,
                )
            )
        if arrays and len({a.shape for a in arrays}) > 1:
            shapes = sorted({a.shape for a in arrays})
            raise ConfigError(
                f"llava: images of different shapes {shapes} (expected a center crop)"
            )
        pixel_values = (
            np.stack(arrays) if arrays else np.zeros((0, 3, self.crop_height, self.crop_width))
        ).astype(np.float32)
        tokens = [self.tokens(a.shape[1], a.shape[2]) for a in arrays]
        return ProcessedImages(pixel_values, tokens, [i.sha256 for i in images])

    def expand(self, text: str, processed: ProcessedImages) -> str:
        replacements = [self.image_token * n for n in processed.tokens_per_image]
        return expand_markers(text, self.marker, replacements)
