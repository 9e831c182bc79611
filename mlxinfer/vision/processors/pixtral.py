"""Pixtral and Mistral 3: the longest side capped, sides to whole patches, rows of ``[IMG]``.

The reference is transformers' ``PixtralImageProcessorPil`` (models/pixtral/
image_processing_pil_pixtral.py; ``PixtralImageProcessor`` is the torchvision one) as
``PixtralProcessor`` calls it, with ``patch_size`` = the processor's ``patch_size`` x
``spatial_merge_size`` (Mistral 3: 14 x 2 = 28; Pixtral-12B: 16 x 1):

- scaled down (never up) so both sides fit ``size.longest_edge`` (floor, not round), then each
  side rounded UP to a whole number of patches, resized with ``resample`` (3: bicubic),
  rescaled and normalized, channels first;
- the images of one call padded with zeros (after normalizing) to the largest height and width:
  ``pixel_values`` is (N, C, H_max, W_max), and ``grid_thw`` holds each image's own extent as
  (1, rows, columns) of the tower's patches (``patch_size``, before merging), from which its
  ``image_sizes`` are rows and columns x patch_size;
- each ``[IMG]`` the chat template wrote becomes rows of ``[IMG]`` x columns (merged patches),
  each row ended by ``[IMG_BREAK]``, the last by ``[IMG_END]`` instead; ``tokens_per_image``
  counts the ``[IMG]`` tokens (where the features go).
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

IMAGE_TOKEN = "[IMG]"
BREAK_TOKEN = "[IMG_BREAK]"
END_TOKEN = "[IMG_END]"


def resized_size(
    height: int, width: int, max_height: int, max_width: int, patch: int
) -> tuple[int, int]:
    """transformers' pixtral ``get_resize_output_image_size``: (height, width) after the resize."""
    ratio = max(height / max_height, width / max_width)
    if ratio > 1:
        height = int(math.floor(height / ratio))
        width = int(math.floor(width / ratio))
    return ((height - 1) // patch + 1) * patch, ((width - 1) // patch + 1) * patch


@dataclass(frozen=True)
class PixtralProcessor(SettingsVariant):
    image_token_id: int
    image_token: str = IMAGE_TOKEN
    image_break_token: str = BREAK_TOKEN
    image_end_token: str = END_TOKEN
    image_break_token_id: int | None = None
    image_end_token_id: int | None = None
    patch_size: int = 16
    spatial_merge_size: int = 1
    max_height: int = 1024
    max_width: int = 1024
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    family: str = field(default="pixtral", init=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> PixtralProcessor:
        image, where, config = settings.image, settings.where, settings.config
        vision = config.get("vision_config") or {}
        size = image.get("size") if image.get("size") is not None else {"longest_edge": 1024}
        if isinstance(size, dict) and isinstance(size.get("longest_edge"), int):
            max_height = max_width = integer(size["longest_edge"], None, "size.longest_edge", where)
        elif isinstance(size, dict) and {"height", "width"} <= size.keys():
            max_height = integer(size["height"], None, "size.height", where)
            max_width = integer(size["width"], None, "size.width", where)
        else:
            raise ConfigError(f"{where}: size is {size!r} (expected {{'longest_edge': N}})")
        # PixtralProcessor's own patch_size and spatial_merge_size (processor_config.json; 16
        # and 1 when absent) decide the resize, not the image processor's patch_size.
        patch = settings.processor.get("patch_size")
        merge = settings.processor.get("spatial_merge_size")
        patch = integer(patch, vision.get("patch_size") or 16, "patch_size", where)
        merge = integer(merge, config.get("spatial_merge_size") or 1, "spatial_merge_size", where)
        for key, ours, theirs in (
            ("vision_config.patch_size", patch, vision.get("patch_size")),
            ("spatial_merge_size", merge, config.get("spatial_merge_size")),
        ):
            if isinstance(theirs, int) and theirs != ours:
                raise ConfigError(
                    f"{where}: the processor's {key.split('.')[-1]} is {ours}, but "
                    f"{settings.config_file}'s {key} is {theirs} (expected the same)"
                )
        tokens = {**settings.tokens, **_processor_tokens(settings.processor)}
        image_token = tokens.get("image_token", IMAGE_TOKEN)
        break_token = tokens.get("image_break_token", BREAK_TOKEN)
        end_token = tokens.get("image_end_token", END_TOKEN)
        return cls(
            image_token=image_token,
            image_token_id=settings.required_id(
                image_token, ("image_token_index", "image_token_id")
            ),
            image_break_token=break_token,
            image_end_token=end_token,
            image_break_token_id=settings.token_id(
                break_token, ("image_break_token_id",), required=False
            ),
            image_end_token_id=settings.token_id(
                end_token, ("image_end_token_id",), required=False
            ),
            patch_size=patch,
            spatial_merge_size=merge,
            max_height=max_height,
            max_width=max_width,
            resample=resample_of(image.get("resample"), 3, where),
            do_resize=flag(image.get("do_resize"), True),
            **normalization(image, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, where),
        )

    @property
    def marker(self) -> str:
        return self.image_token

    @property
    def unit(self) -> int:
        """Pixels per image token along a side: patch_size x spatial_merge_size."""
        return self.patch_size * self.spatial_merge_size

    def prepare(self, images: Sequence[Image]) -> ProcessedImages:
        arrays, grids, tokens = [], [], []
        for image in images:
            picture = to_rgb_array(image)
            if self.do_resize:
                height, width = resized_size(
                    picture.height, picture.width, self.max_height, self.max_width, self.unit
                )
                picture = resize(picture, height, width, self.resample)
            array = rescale_normalize(
                picture,
                do_rescale=self.do_rescale,
                rescale_factor=self.rescale_factor,
                do_normalize=self.do_normalize,
                mean=self.image_mean,
                std=self.image_std,
            )
            height, width = array.shape[1:]
            arrays.append(array)
            grids.append((1, height // self.patch_size, width // self.patch_size))
            tokens.append((height // self.unit) * (width // self.unit))
        if arrays:
            top = max(a.shape[1] for a in arrays), max(a.shape[2] for a in arrays)
            pixel_values = np.zeros((len(arrays), 3, *top), np.float32)
            for row, array in zip(pixel_values, arrays):
                row[:, : array.shape[1], : array.shape[2]] = array
        else:
            pixel_values = np.zeros((0, 3, self.unit, self.unit), np.float32)
        grid_thw = np.array(grids, dtype=np.int64).reshape(-1, 3)
        return ProcessedImages(pixel_values, tokens, [i.sha256 for i in images], grid_thw)

    def expand(self, text: str, processed: ProcessedImages) -> str:
        if processed.grid_thw is None:
            raise ValueError("Pixtral's expansion needs grid_thw (from PixtralProcessor.prepare)")
        replacements = []
        for _, rows, columns in processed.grid_thw.tolist():
            rows, columns = rows // self.spatial_merge_size, columns // self.spatial_merge_size
            row = self.image_token * columns + self.image_break_token
            replacements.append(
                row * (rows - 1) + self.image_token * columns + self.image_end_token
            )
        return expand_markers(text, self.marker, replacements)


def _processor_tokens(processor: dict) -> dict[str, str]:
    """PixtralProcessor keeps its token strings in processor_config.json."""
    keys = ("image_token", "image_break_token", "image_end_token")
    return {k: processor[k] for k in keys if isinstance(processor.get(k), str) and processor[k]}
