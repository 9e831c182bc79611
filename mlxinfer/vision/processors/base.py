"""What every image processor shares: the interface, the result, and the numeric steps.

The steps are transformers' PIL backend (``transformers.image_processing_backends.PilBackend``
and ``image_transforms``) done in the same order with the same dtypes, so the result is the same
to the bit, not only within tolerance: resize the uint8 RGB picture with Pillow, rescale in
float64 and cast to float32, normalize in float32 with float32 mean and std.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from PIL import Image as PILImage

from ...errors import ConfigError, MediaError
from ..media import Image

# transformers' PILImageResampling values (Pillow's): what processor configs store as "resample".
RESAMPLING = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ProcessedImages:
    """A processor's output for the images of one prompt, in order.

    ``pixel_values``: float32; (N, C, H, W) for fixed-size families (Gemma 3; with pan and scan,
    each image's crops follow it), flattened patches (sum of t*h*w, C*T*P*P) for Qwen-VL.
    ``tokens_per_image``: placeholder tokens each image takes in the expanded text (and the
    tower's features it gets, in order). ``sha256``: each image's identity
    (:attr:`Image.sha256`). ``grid_thw``: (N, 3) int64 patch grids (Qwen-VL; Pixtral's
    (1, rows, cols); Idefics3's (frames, tile rows, tile cols)), else None. ``pixel_rows``: the
    rows of ``pixel_values`` each image takes where it is not one (Gemma 3's crops after the
    image, Idefics3's frames); flattened patches take t*h*w rows each, by ``grid_thw``.
    """

    pixel_values: np.ndarray
    tokens_per_image: list[int]
    sha256: list[str]
    grid_thw: np.ndarray | None = None
    pixel_rows: list[int] | None = None

    def image_rows(self) -> list[int]:
        """The rows of ``pixel_values`` each image takes, in order."""
        if self.pixel_rows is not None:
            rows = [int(r) for r in self.pixel_rows]
        elif self.pixel_values.ndim == 2 and self.grid_thw is not None:  # flattened patches
            rows = [int(n) for n in np.prod(self.grid_thw, axis=-1)]
        else:
            rows = [1] * len(self.tokens_per_image)
        if len(rows) != len(self.tokens_per_image) or sum(rows) != len(self.pixel_values):
            raise ValueError(
                f"pixel_values: {len(self.pixel_values)} rows for {len(self.tokens_per_image)} "
                f"image(s) of {rows} rows"
            )
        return rows

    def select(self, indices: Sequence[int]) -> ProcessedImages:
        """The images at ``indices`` (in that order) alone: their pixel rows, tokens, grids."""
        rows = self.image_rows()
        starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        take = [np.arange(starts[i], starts[i + 1]) for i in indices]
        pixels = self.pixel_values[np.concatenate(take) if take else np.zeros(0, np.int64)]
        return ProcessedImages(
            pixels,
            [self.tokens_per_image[i] for i in indices],
            [self.sha256[i] for i in indices],
            None if self.grid_thw is None else self.grid_thw[list(indices)].reshape(-1, 3),
            None if self.pixel_rows is None else [rows[i] for i in indices],
        )


class ImageProcessor(Protocol):
    """One family's processor, built from a checkpoint by :func:`load_processor`.

    ``image_token``/``image_token_id``: the placeholder token inside expanded text (its id is
    where the tower's features go); ``marker``: what the chat template emits per image, which
    :meth:`expand` replaces; ``variant``: a digest of every setting that changes the pixels or
    the token count (an encoder cache key is (image sha256, variant)).
    """

    @property
    def image_token(self) -> str: ...

    @property
    def image_token_id(self) -> int: ...

    @property
    def marker(self) -> str: ...

    @property
    def variant(self) -> str: ...

    def prepare(self, images: Sequence[Image]) -> ProcessedImages: ...

    def expand(self, text: str, processed: ProcessedImages) -> str: ...


def to_rgb_array(image: Image | PILImage.Image) -> PILImage.Image:
    picture = image.pixels if isinstance(image, Image) else image
    return picture if picture.mode == "RGB" else picture.convert("RGB")


def resize(picture: PILImage.Image, height: int, width: int, resample: int) -> PILImage.Image:
    """Pillow's resize to (height, width), as transformers' ``image_transforms.resize`` calls it
    (``reducing_gap=None``)."""
    return picture.resize((width, height), resample=PILImage.Resampling(resample))


def rescale_normalize(
    picture: PILImage.Image | np.ndarray,
    *,
    do_rescale: bool,
    rescale_factor: float,
    do_normalize: bool,
    mean: Sequence[float],
    std: Sequence[float],
) -> np.ndarray:
    """uint8 (H, W, C) to float32 (C, H, W): ``image_transforms.rescale`` (float64 product,
    then float32) and ``normalize`` (float32 arithmetic, mean and std cast to float32)."""
    array = np.asarray(picture)
    if array.ndim == 2:
        array = array[:, :, None]
    array = np.moveaxis(array, -1, 0)
    if do_rescale:
        array = (array.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        if not np.issubdtype(array.dtype, np.floating):
            array = array.astype(np.float32)
        m = np.asarray(mean, dtype=array.dtype)[:, None, None]
        s = np.asarray(std, dtype=array.dtype)[:, None, None]
        array = (array - m) / s
    return np.ascontiguousarray(array, dtype=np.float32)


def expand_markers(
    text: str, marker: str, replacements: Sequence[str], *, marker_name: str | None = None
) -> str:
    """Replace the i-th ``marker`` in ``text`` with ``replacements[i]``, in one pass (a
    replacement may contain the marker); a count mismatch is a one-line :class:`MediaError`."""
    count = text.count(marker)
    if count != len(replacements):
        shown = marker_name or marker
        raise MediaError(
            f"the prompt has {count} image marker{'s' if count != 1 else ''} ({shown}) for "
            f"{len(replacements)} image{'s' if len(replacements) != 1 else ''} (expected one "
            "marker per image, in order)"
        )
    pieces = iter(replacements)
    return re.sub(re.escape(marker), lambda _: next(pieces), text)


def variant_of(family: str, settings: dict[str, Any]) -> str:
    blob = json.dumps({"family": family, **settings}, sort_keys=True, default=list)
    return f"{family}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


class SettingsVariant:
    """``variant`` for a processor: a digest of its family and settings, its tokens left out (the
    encoder cache's key beside an image's SHA-256)."""

    family: str  # each processor's own (a plain annotation: not a dataclass field here)

    @property
    def variant(self) -> str:
        settings = {k: v for k, v in vars(self).items() if "token" not in k}
        return variant_of(self.family, settings)


def normalization(
    image: dict[str, Any], mean: Sequence[float], std: Sequence[float], where: str
) -> dict[str, Any]:
    """The rescale and normalize settings every family reads alike (transformers' defaults:
    rescale by 1/255, normalize by the family's mean and std), as processor fields."""
    return dict(
        do_rescale=flag(image.get("do_rescale"), True),
        rescale_factor=number(image.get("rescale_factor"), 1 / 255, "rescale_factor", where),
        do_normalize=flag(image.get("do_normalize"), True),
        image_mean=floats(image.get("image_mean"), mean, "image_mean", where),
        image_std=floats(image.get("image_std"), std, "image_std", where),
    )


def floats(value: Any, default: Sequence[float], key: str, where: str) -> tuple[float, ...]:
    """A mean/std setting: a number for every channel or three numbers."""
    if value is None:
        return tuple(default)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if (
        isinstance(value, list)
        and len(value) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return tuple(float(v) for v in value)
    raise ConfigError(f"{where}: {key} is {value!r} (expected a number or a list of 3 numbers)")


def integer(value: Any, default: int | None, key: str, where: str, *, minimum: int = 1) -> int:
    if value is None:
        if default is None:
            raise ConfigError(f"{where}: {key} is missing (expected an integer)")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{where}: {key} is {value!r} (expected an integer >= {minimum})")
    return value


def flag(value: Any, default: bool) -> bool:
    return default if value is None else bool(value)


def resample_of(value: Any, default: int, where: str) -> int:
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool) and value in RESAMPLING:
        return value
    raise ConfigError(f"{where}: resample is {value!r} (expected one of {sorted(RESAMPLING)})")


def number(value: Any, default: float, key: str, where: str) -> float:
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ConfigError(f"{where}: {key} is {value!r} (expected a positive number)")


@dataclass(frozen=True)
class Settings:
    """A checkpoint's image settings, as :func:`load_processor` found them: ``config`` is
    config.json; ``image`` the image processor's dict (processor_config.json's nested
    ``image_processor``, else preprocessor_config.json) and ``where`` the file it came from;
    ``processor`` the processor-level keys (``image_seq_length``...); ``tokens`` the special
    token strings tokenizer_config.json names (``image_token``, ``boi_token``...); ``vocab``
    maps a token string to its id where a tokenizer was given (None: ids from config.json only).
    """

    config: dict[str, Any]
    image: dict[str, Any]
    processor: dict[str, Any]
    tokens: dict[str, str]
    where: str
    config_file: str
    vocab: Any = None  # Callable[[str], int | None]

    def token_id(self, token: str, keys: Sequence[str], *, required: bool = True) -> int | None:
        """The id of ``token``: config.json's first of ``keys`` (checked against the tokenizer
        when one was given), else the tokenizer's."""
        from_config = next(
            (self.config[k] for k in keys if isinstance(self.config.get(k), int)), None
        )
        from_vocab = self.vocab(token) if self.vocab is not None else None
        if from_config is not None and from_vocab is not None and from_config != from_vocab:
            raise ConfigError(
                f"{self.config_file}: {keys[0]} is {from_config}, but the tokenizer gives "
                f"{token!r} the id {from_vocab} (expected the same token)"
            )
        found = from_config if from_config is not None else from_vocab
        if found is None and required:
            raise ConfigError(
                f"{self.config_file}: no {' or '.join(keys)} (expected the id of {token!r})"
            )
        return found

    def required_id(self, token: str, keys: Sequence[str]) -> int:
        """:meth:`token_id`, which must be found."""
        found = self.token_id(token, keys)
        assert found is not None  # token_id raised otherwise
        return found
