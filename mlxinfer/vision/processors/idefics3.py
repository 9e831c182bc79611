"""Idefics3 and SmolVLM: the image cut into tiles of the tower's size plus a global view.

The reference is transformers' ``Idefics3ImageProcessorPil`` (models/idefics3/
image_processing_pil_idefics3.py) as ``Idefics3Processor`` calls it, every resize LANCZOS
(``resample`` 1) on the uint8 picture:

- resized so its longest side is ``size.longest_edge`` (4 x 364 for Idefics3; the other side
  ``int(longest / aspect)``, made even; at most 4096);
- with ``do_image_splitting``: resized again to whole multiples of ``max_image_size.longest_edge``
  (M) on both sides (``resize_for_vision_encoder``), cut row by row into M x M tiles, and, when
  there is more than one, followed by the global view (the resized picture brought to M x M);
  without it: brought to M x M, no tiles;
- every frame rescaled and normalized: ``pixel_values`` (frames, C, M, M), the images' frames in
  order (all of them M x M, so the processor's padding and pixel mask change nothing);
  ``grid_thw`` holds each image's (frames, tile rows, tile columns);
- each ``<image>`` the chat template wrote becomes, for an image of rows x cols tiles, each
  tile's ``<fake_token_around_image><row_r_col_c>`` + ``<image>`` x ``image_seq_len`` (a newline
  after each row of tiles), then ``\\n<fake_token_around_image><global-img>`` + ``<image>`` x
  ``image_seq_len`` + ``<fake_token_around_image>``; an image that is one tile has only the
  global part, without the leading newline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image as PILImage

from ...errors import ConfigError
from ..media import Image
from .base import (
    IMAGENET_STANDARD,
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
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
MAX_IMAGE_SIZE = 4096


def resized_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' idefics3 ``get_resize_output_image_size``: the longest side to ``longest``,
    the other made even, both capped at 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """``resize_for_vision_encoder``: both sides up to whole tiles, the longer one first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True)
class Idefics3Processor(SettingsVariant):
    image_token_id: int
    image_seq_len: int
    image_token: str = IMAGE_TOKEN
    fake_image_token: str = FAKE_TOKEN
    global_image_token: str = GLOBAL_TOKEN
    longest_edge: int = 4 * 364
    tile: int = 364
    do_image_splitting: bool = True
    resample: int = 1
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    family: str = field(default="idefics3", init=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> Idefics3Processor:
        image, where, config = settings.image, settings.where, settings.config
        size = image.get("size") if image.get("size") is not None else {"longest_edge": 4 * 364}
        tile = image.get("max_image_size")
        tile = tile if tile is not None else {"longest_edge": 364}
        for key, value in (("size", size), ("max_image_size", tile)):
            if not isinstance(value, dict) or not isinstance(value.get("longest_edge"), int):
                raise ConfigError(f"{where}: {key} is {value!r} (expected {{'longest_edge': N}})")
        vision = config.get("vision_config") or {}
        patches = (vision.get("image_size") or 224) // (vision.get("patch_size") or 32)
        scale = config.get("scale_factor") or 2
        default_seq = (patches * patches) // (scale * scale)
        seq = integer(settings.processor.get("image_seq_len"), default_seq, "image_seq_len", where)
        if not flag(image.get("do_resize"), True):
            raise ConfigError(f"{where}: do_resize is false (expected the tiles' resizing)")
        return cls(
            image_token_id=settings.required_id(IMAGE_TOKEN, ("image_token_id",)),
            image_seq_len=seq,
            longest_edge=integer(size["longest_edge"], None, "size.longest_edge", where),
            tile=integer(tile["longest_edge"], None, "max_image_size.longest_edge", where),
            do_image_splitting=flag(image.get("do_image_splitting"), True),
            resample=resample_of(image.get("resample"), 1, where),
            **normalization(image, IMAGENET_STANDARD, IMAGENET_STANDARD, where),
        )

    @property
    def marker(self) -> str:
        return self.image_token

    def frames(self, picture: PILImage.Image) -> tuple[list[PILImage.Image], int, int]:
        """The image's M x M frames (tiles row by row, then the global view) and its tiles'
        rows and columns (0, 0: one frame, no tiles)."""
        height, width = resized_size(picture.height, picture.width, self.longest_edge)
        picture = resize(picture, height, width, self.resample)
        M = self.tile
        if not self.do_image_splitting:
            return [resize(picture, M, M, self.resample)], 0, 0
        height, width = tiled_size(picture.height, picture.width, M)
        picture = resize(picture, height, width, self.resample)
        if height <= M and width <= M:
            return [picture], 0, 0
        rows, cols = (height - M) // M + 1, (width - M) // M + 1
        tiles = [
            picture.crop((c * M, r * M, (c + 1) * M, (r + 1) * M))
            for r in range(rows)
            for c in range(cols)
        ]
        return [*tiles, resize(picture, M, M, self.resample)], rows, cols

    def prepare(self, images: Sequence[Image]) -> ProcessedImages:
        arrays, tokens, grids = [], [], []
        for image in images:
            frames, rows, cols = self.frames(to_rgb_array(image))
            for frame in frames:
                arrays.append(
                    rescale_normalize(
                        frame,
                        do_rescale=self.do_rescale,
                        rescale_factor=self.rescale_factor,
                        do_normalize=self.do_normalize,
                        mean=self.image_mean,
                        std=self.image_std,
                    )
                )
            tokens.append(len(frames) * self.image_seq_len)
            grids.append((len(frames), rows, cols))
        M = self.tile
        pixel_values = np.stack(arrays) if arrays else np.zeros((0, 3, M, M), np.float32)
        grid = np.array(grids, dtype=np.int64).reshape(-1, 3)  # (frames, tile rows, tile cols)
        rows_per_image = [int(f) for f in grid[:, 0]]  # its frames: its rows of pixel_values
        sha256 = [i.sha256 for i in images]
        return ProcessedImages(pixel_values, tokens, sha256, grid, rows_per_image)

    def expand(self, text: str, processed: ProcessedImages) -> str:
        seq = self.image_token * self.image_seq_len
        whole = f"{self.fake_image_token}{self.global_image_token}{seq}{self.fake_image_token}"
        replacements = []
        if processed.grid_thw is None:
            raise ValueError("Idefics3's expansion needs grid_thw (from Idefics3Processor.prepare)")
        for _, rows, cols in processed.grid_thw.tolist():
            if rows == 0 and cols == 0:
                replacements.append(whole)
                continue
            text_rows = [
                "".join(
                    f"{self.fake_image_token}<row_{r + 1}_col_{c + 1}>{seq}" for c in range(cols)
                )
                + "\n"
                for r in range(rows)
            ]
            replacements.append("".join(text_rows) + "\n" + whole)
        return expand_markers(text, self.marker, replacements)
