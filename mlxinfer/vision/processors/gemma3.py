"""Gemma 3: a fixed-size picture, and ``<start_of_image>`` expanded to its soft tokens.

The reference is transformers' ``Gemma3ImageProcessorPil`` (models/gemma3/
image_processing_pil_gemma3.py; ``Gemma3ImageProcessor`` is the torchvision one, whose bilinear
resize gives other pixels) called through ``Gemma3Processor``: resize to ``size`` (896 x 896 in
the released checkpoints) with ``resample`` (2: bilinear), rescale by ``rescale_factor``,
normalize with ``image_mean``/``image_std``, channels first. Each ``boi_token`` the chat template
wrote becomes ``"\\n\\n" + boi + image_token * image_seq_length + eoi + "\\n\\n"``
(``Gemma3Processor.full_image_sequence``).

Pan and scan is off, as ``Gemma3Processor`` has it whatever the image processor's config says
(its ``images_kwargs`` pass ``do_pan_and_scan=False`` and the crop settings 256 / 4 / 1.2 on
every call); ``pan_and_scan=True`` turns it on with those settings: an image wider or taller
than 1.2 : 1 is also cut into 2 to 4 crops, each resized like the whole, and its text becomes
``"Here is the original image " + seq + " and here are some crops to help you see better " +
" ".join([seq] * crops)``. Its pixel rows are then the image followed by its crops, and
``tokens_per_image`` counts them all (rows = tokens / image_seq_length).
"""

from __future__ import annotations

import itertools
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

IMAGE_TOKEN = "<image_soft_token>"
BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"


@dataclass(frozen=True)
class Gemma3Processor(SettingsVariant):
    height: int
    width: int
    image_seq_length: int
    image_token_id: int
    image_token: str = IMAGE_TOKEN
    boi_token: str = BOI_TOKEN
    eoi_token: str = EOI_TOKEN
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    resample: int = 2
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    family: str = field(default="gemma3", init=False)

    @classmethod
    def from_settings(cls, settings: Settings, *, pan_and_scan: bool = False) -> Gemma3Processor:
        image, where = settings.image, settings.where
        size = image.get("size") if image.get("size") is not None else {"height": 224, "width": 224}
        if not (isinstance(size, dict) and {"height", "width"} <= size.keys()):
            raise ConfigError(f"{where}: size is {size!r} (expected {{'height': H, 'width': W}})")
        height = integer(size["height"], None, "size.height", where)
        width = integer(size["width"], None, "size.width", where)
        vision = settings.config.get("vision_config") or {}
        if image.get("do_resize", True) and isinstance(vision.get("image_size"), int):
            if (height, width) != (vision["image_size"],) * 2:
                raise ConfigError(
                    f"{where}: size is {height}x{width}, but {settings.config_file}'s "
                    f"vision_config.image_size is {vision['image_size']} (expected the same)"
                )
        seq = settings.processor.get("image_seq_length", image.get("image_seq_length"))
        tokens = settings.config.get("mm_tokens_per_image")
        if seq is not None and tokens is not None and seq != tokens:
            raise ConfigError(
                f"{where}: image_seq_length is {seq}, but {settings.config_file}'s "
                f"mm_tokens_per_image is {tokens} (expected the same)"
            )
        seq = integer(seq if seq is not None else tokens, 256, "image_seq_length", where)
        image_token = settings.tokens.get("image_token", IMAGE_TOKEN)
        boi = settings.tokens.get("boi_token", BOI_TOKEN)
        eoi = settings.tokens.get("eoi_token", EOI_TOKEN)
        return cls(
            height=height,
            width=width,
            image_seq_length=seq,
            image_token=image_token,
            image_token_id=settings.required_id(
                image_token, ("image_token_index", "image_token_id")
            ),
            boi_token=boi,
            eoi_token=eoi,
            boi_token_id=settings.token_id(
                boi, ("boi_token_index", "boi_token_id"), required=False
            ),
            eoi_token_id=settings.token_id(
                eoi, ("eoi_token_index", "eoi_token_id"), required=False
            ),
            resample=resample_of(image.get("resample"), 2, where),
            do_resize=flag(image.get("do_resize"), True),
            **normalization(image, IMAGENET_STANDARD, IMAGENET_STANDARD, where),
            pan_and_scan=pan_and_scan,
        )

    @property
    def marker(self) -> str:
        return self.boi_token

    @property
    def full_image_sequence(self) -> str:
        soft = self.image_token * self.image_seq_length
        return f"\n\n{self.boi_token}{soft}{self.eoi_token}\n\n"

    def prepare(self, images: Sequence[Image]) -> ProcessedImages:
        rows, tokens, counts = [], [], []
        for image in images:
            picture = to_rgb_array(image)
            pictures = [picture] + (self._crops(picture) if self.pan_and_scan else [])
            for one in pictures:
                if self.do_resize:
                    one = resize(one, self.height, self.width, self.resample)
                rows.append(
                    rescale_normalize(
                        one,
                        do_rescale=self.do_rescale,
                        rescale_factor=self.rescale_factor,
                        do_normalize=self.do_normalize,
                        mean=self.image_mean,
                        std=self.image_std,
                    )
                )
            tokens.append(len(pictures) * self.image_seq_length)
            counts.append(len(pictures))  # the image's row, then its crops'
        channels, height, width = rows[0].shape if rows else (3, self.height, self.width)
        pixel_values = (
            np.stack(rows) if rows else np.zeros((0, channels, height, width), np.float32)
        )
        sha256 = [image.sha256 for image in images]
        return ProcessedImages(pixel_values, tokens, sha256, pixel_rows=counts)

    def expand(self, text: str, processed: ProcessedImages) -> str:
        replacements = []
        for count in processed.tokens_per_image:
            crops = count // self.image_seq_length - 1
            full = self.full_image_sequence
            if crops <= 0:
                replacements.append(full)
            else:
                replacements.append(
                    f"Here is the original image {full} and here are some crops to help you "
                    "see better " + " ".join([full] * crops)
                )
        return expand_markers(text, self.marker, replacements)

    def _crops(self, picture: PILImage.Image) -> list[PILImage.Image]:
        """``Gemma3ImageProcessorPil.pan_and_scan``, on the uint8 picture before the resize."""
        width, height = picture.size
        min_crop = self.pan_and_scan_min_crop_size
        if width >= height:
            if width / height < self.pan_and_scan_min_ratio_to_activate:
                return []
            crops_w = int(math.floor(width / height + 0.5))
            crops_w = min(int(math.floor(width / min_crop)), crops_w)
            crops_w = min(self.pan_and_scan_max_num_crops, max(2, crops_w))
            crops_h = 1
        else:
            if height / width < self.pan_and_scan_min_ratio_to_activate:
                return []
            crops_h = int(math.floor(height / width + 0.5))
            crops_h = min(int(math.floor(height / min_crop)), crops_h)
            crops_h = min(self.pan_and_scan_max_num_crops, max(2, crops_h))
            crops_w = 1
        crop_w = int(math.ceil(width / crops_w))
        crop_h = int(math.ceil(height / crops_h))
        if min(crop_w, crop_h) < min_crop:
            return []
        array = np.asarray(picture)
        return [
            PILImage.fromarray(np.ascontiguousarray(array[y : y + crop_h, x : x + crop_w]))
            for y, x in itertools.product(
                [crop_h * i for i in range(crops_h)], [crop_w * i for i in range(crops_w)]
            )
        ]
