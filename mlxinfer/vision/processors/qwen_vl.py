"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5: ``smart_resize``, patches, and ``<|image_pad|>``.

The reference is transformers' ``Qwen2VLImageProcessorPil`` (models/qwen2_vl/
image_processing_pil_qwen2_vl.py; ``Qwen2VLImageProcessor`` is the torchvision one), which every
one of these families uses (Qwen3-VL and Qwen3.5 with ``patch_size`` 16 and mean/std 0.5):

- ``smart_resize``: each side rounded to a multiple of ``factor = patch_size * merge_size``,
  then scaled so that height x width lies in [min_pixels, max_pixels]. transformers 5 saves
  those two as ``size: {"shortest_edge": min_pixels, "longest_edge": max_pixels}``: pixel
  counts, not edges; older checkpoints have top-level ``min_pixels``/``max_pixels``, which win;
- resample (3: bicubic), rescale, normalize, channels first;
- a single image is one temporal patch: each patch is repeated ``temporal_patch_size`` times;
- patches flattened in the order (grid_h/m, grid_w/m, m, m, C, T, P, P): a ``merge_size`` x
  ``merge_size`` block of neighbouring patches is contiguous, as the merger expects;
- ``image_grid_thw`` = (1, grid_h, grid_w); the image's ``<|image_pad|>`` (inside the
  template's ``<|vision_start|>...<|vision_end|>``) becomes t*h*w / merge_size**2 pad tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError, MediaError
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

IMAGE_TOKEN = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
    *,
    name: str = "image",
) -> tuple[int, int]:
    """transformers' ``smart_resize``, line for line; an aspect ratio over 200 is a
    :class:`MediaError` (transformers raises ValueError)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"{name}: {width}x{height} pixels, an aspect ratio of "
            f"{max(height, width) / min(height, width):.0f}:1 (expected at most {MAX_ASPECT_RATIO}:1)"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLProcessor(SettingsVariant):
    image_token_id: int
    image_token: str = IMAGE_TOKEN
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    family: str = field(default="qwen_vl", init=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> QwenVLProcessor:
        image, where = settings.image, settings.where
        size: dict[str, Any] = image["size"] if isinstance(image.get("size"), dict) else {}
        # transformers: top-level min_pixels / max_pixels (older configs) override ``size``
        min_pixels = _first(
            image.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels")
        )
        max_pixels = _first(
            image.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels")
        )
        image_token = settings.tokens.get("image_token", IMAGE_TOKEN)
        start = settings.tokens.get("vision_start_token", VISION_START)
        end = settings.tokens.get("vision_end_token", VISION_END)
        made = cls(
            image_token=image_token,
            image_token_id=settings.required_id(
                image_token, ("image_token_id", "image_token_index")
            ),
            vision_start_token_id=settings.token_id(
                start, ("vision_start_token_id",), required=False
            ),
            vision_end_token_id=settings.token_id(end, ("vision_end_token_id",), required=False),
            min_pixels=integer(min_pixels, 56 * 56, "size.shortest_edge (min_pixels)", where),
            max_pixels=integer(max_pixels, 28 * 28 * 1280, "size.longest_edge (max_pixels)", where),
            patch_size=integer(image.get("patch_size"), 14, "patch_size", where),
            temporal_patch_size=integer(
                image.get("temporal_patch_size"), 2, "temporal_patch_size", where
            ),
            merge_size=integer(image.get("merge_size"), 2, "merge_size", where),
            resample=resample_of(image.get("resample"), 3, where),
            do_resize=flag(image.get("do_resize"), True),
            **normalization(image, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, where),
        )
        if made.min_pixels > made.max_pixels:
            raise ConfigError(
                f"{where}: min_pixels {made.min_pixels} is above max_pixels {made.max_pixels} "
                "(expected shortest_edge <= longest_edge, both pixel counts)"
            )
        vision = settings.config.get("vision_config") or {}
        for key in ("patch_size", "temporal_patch_size"):
            theirs = vision.get(key)
            if isinstance(theirs, int) and theirs != getattr(made, key):
                raise ConfigError(
                    f"{where}: {key} is {getattr(made, key)}, but {settings.config_file}'s "
                    f"vision_config.{key} is {theirs} (expected the same)"
                )
        merge = vision.get("spatial_merge_size")
        if isinstance(merge, int) and merge != made.merge_size:
            raise ConfigError(
                f"{where}: merge_size is {made.merge_size}, but {settings.config_file}'s "
                f"vision_config.spatial_merge_size is {merge} (expected the same)"
            )
        return made

    @property
    def marker(self) -> str:
        return self.image_token

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid(self, height: int, width: int, *, name: str = "image") -> tuple[int, int, int]:
        """(t, h, w) patches for a picture of ``height`` x ``width`` (before any resize)."""
        if self.do_resize:
            height, width = smart_resize(
                height, width, self.factor, self.min_pixels, self.max_pixels, name=name
            )
        return 1, height // self.patch_size, width // self.patch_size

    def prepare(self, images: Sequence[Image]) -> ProcessedImages:
        patches, grids = [], []
        for index, image in enumerate(images, start=1):
            picture = to_rgb_array(image)
            name = f"image {index}"
            height, width = picture.height, picture.width
            if self.do_resize:
                height, width = smart_resize(
                    height, width, self.factor, self.min_pixels, self.max_pixels, name=name
                )
                picture = resize(picture, height, width, self.resample)
            elif height % self.factor or width % self.factor:
                raise MediaError(
                    f"{name}: {width}x{height} pixels with do_resize off (expected both sides "
                    f"multiples of {self.factor})"
                )
            array = rescale_normalize(
                picture,
                do_rescale=self.do_rescale,
                rescale_factor=self.rescale_factor,
                do_normalize=self.do_normalize,
                mean=self.image_mean,
                std=self.image_std,
            )
            flat, grid_h, grid_w = self._patchify(array)
            patches.append(flat)
            grids.append((1, grid_h, grid_w))
        dim = 3 * self.temporal_patch_size * self.patch_size**2
        pixel_values = np.concatenate(patches) if patches else np.zeros((0, dim), np.float32)
        grid_thw = np.array(grids, dtype=np.int64).reshape(-1, 3)
        tokens = [int(np.prod(g)) // self.merge_size**2 for g in grids]
        return ProcessedImages(pixel_values, tokens, [i.sha256 for i in images], grid_thw)

    def expand(self, text: str, processed: ProcessedImages) -> str:
        return expand_markers(
            text, self.marker, [self.image_token * n for n in processed.tokens_per_image]
        )

    def _patchify(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        """``Qwen2VLImageProcessorPil.patchify``: (C, H, W) to (grid_h * grid_w, C*T*P*P)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, height, width = image.shape
        grid_h, grid_w = height // p, width // p
        patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
        patches = np.broadcast_to(
            patches[:, :, :, :, :, None], (*patches.shape[:5], t, *patches.shape[5:])
        )
        return patches.reshape(grid_h * grid_w, channels * t * p * p), grid_h, grid_w


def _first(*values: object) -> object:
    return next((v for v in values if v is not None), None)
