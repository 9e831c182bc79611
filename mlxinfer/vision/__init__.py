"""Images for vision-language models: decoding and the image processors (numpy + Pillow, no torch).

- ``media.py``: :func:`load_image`, bytes / a path / a data URL / base64 to an RGB
  :class:`Image` with its identity (SHA-256 of the encoded bytes), under byte and pixel caps;
- ``header.py``: the format and declared size an encoded image's first bytes give, read
  before Pillow decodes anything;
- ``processors/``: one module per model family, matching transformers' PIL image processors
  (pixel values and the expanded image markers), and :func:`load_processor`, which picks one
  from a checkpoint's files.

Sits after ``tokenization`` in the package order and imports neither models nor generation: the
towers and the generate wiring call into it.
"""

from .media import DEFAULT_LIMITS, Image, MediaLimits, decode_image, load_image
from .processors import ImageProcessor, ProcessedImages, load_processor

__all__ = [
    "DEFAULT_LIMITS",
    "Image",
    "ImageProcessor",
    "MediaLimits",
    "ProcessedImages",
    "decode_image",
    "load_image",
    "load_processor",
]
