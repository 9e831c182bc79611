"""Images in: bytes, a local path, a data URL or base64 text to an RGB picture and its identity.

:func:`load_image` is the one way an image enters mlxinfer. It decodes with Pillow under an
allow-list of formats (PNG, JPEG, WebP, GIF: its first frame) and two caps, both checked before
anything is decoded: the encoded size (bytes, base64 text, a remote body as it streams) and the
pixel count, read from the file's header (:mod:`.header`), so a decompression bomb (a 30,000 x
30,000 PNG of a few KB) is a one-line :class:`~mlxinfer.errors.MediaError`, never Pillow's
``DecompressionBombError`` or its warning. EXIF orientation is applied; transparency (RGBA, LA,
a palette with a transparent index) is composited on white, as transformers' image processors
(``do_convert_rgb``), qwen-vl-utils and vLLM do (transformers' own ``load_image`` drops the alpha
channel instead, which turns transparent pixels black or into whatever colour they hold).

An image's identity is the SHA-256 of its encoded bytes (:attr:`Image.sha256`): two requests that
send the same file share encoder and prefix-cache entries whatever path or URL they came by, and a
changed file is a new image even at the same path.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image as PILImage
from PIL import ImageOps

from ..errors import MediaError, MediaLimitError
from .header import declared_size, sniff_format

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_FORMAT_NAMES = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}
_MEDIA_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/pjpeg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
}
# What Pillow raises on truncated or malformed data (its plugins parse with struct and zlib).
_DECODE_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    IndexError,
    TypeError,
    struct.error,
    zlib.error,
)
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/=_\-\s]+")
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


@dataclass(frozen=True)
class MediaLimits:
    """The caps an image must fit: ``max_bytes`` of encoded data (a file, the decoded base64, a
    remote body), ``max_pixels`` width x height as the header declares it, and ``timeout_s`` for
    a remote fetch (``allow_remote=True``). ``cap_name``: how errors name a cap, ``{}`` being
    ``bytes`` or ``pixels`` (the server names its flags: ``serve --max-image-{}``)."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 50_000_000
    timeout_s: float = 10.0
    cap_name: str = "limits.max_{}"


DEFAULT_LIMITS = MediaLimits()


@dataclass(frozen=True)
class Image:
    """A decoded image: ``pixels`` (a Pillow RGB image, orientation applied, transparency on
    white), ``sha256`` (hex digest of the encoded bytes: the image's identity for caches),
    ``width`` and ``height`` of ``pixels``, and the encoded ``format`` (``PNG``, ``JPEG``,
    ``WEBP``, ``GIF``; ``PIL`` for an image given as a Pillow object). Equal when the identity,
    size and format are; the pixels are not compared."""

    pixels: PILImage.Image = field(compare=False, repr=False)
    sha256: str
    width: int
    height: int
    format: str


def load_image(
    source: Any,
    *,
    allow_remote: bool = False,
    limits: MediaLimits | None = None,
    label: str | None = None,
) -> Image:
    """Decode ``source`` into an :class:`Image`.

    ``source`` is the encoded bytes, a local path (``str`` or ``Path``), a ``data:image/...;base64,``
    URL, bare base64 text, or a Pillow image (library callers; its identity is then the SHA-256 of
    its mode, size and raw pixels). ``http(s)://`` URLs are refused unless ``allow_remote``; they
    are then fetched with httpx under ``limits.timeout_s`` and ``limits.max_bytes``. ``label``
    (``"image 2"``) names the image in errors; every failure is a one-line :class:`MediaError`.
    """
    limits = limits or DEFAULT_LIMITS
    if isinstance(source, PILImage.Image):
        return _from_pil(source, label or "PIL image", limits)
    data, name = _read_source(source, allow_remote=allow_remote, limits=limits, label=label)
    return decode_image(data, name=name, limits=limits)


def decode_image(data: bytes, *, name: str = "image", limits: MediaLimits | None = None) -> Image:
    """Decode encoded image bytes (the second half of :func:`load_image`); ``name`` is used in
    errors."""
    limits = limits or DEFAULT_LIMITS
    _check_bytes(len(data), name, limits)
    if not data:
        raise MediaError(f"{name}: empty (expected PNG, JPEG, WebP or GIF data, found 0 bytes)")
    fmt = sniff_format(data)
    if fmt not in ALLOWED_FORMATS:
        found = f"{fmt} data" if fmt else f"data starting {data[:8]!r}"
        raise MediaError(
            f"{name}: not a supported image (expected PNG, JPEG, WebP or GIF, found {found})"
        )
    declared = declared_size(data, fmt)
    if declared is not None:
        _check_pixels(declared, name, fmt, limits)
    digest = hashlib.sha256(data).hexdigest()
    try:
        with PILImage.open(io.BytesIO(data), formats=[fmt]) as opened:
            _check_pixels(opened.size, name, fmt, limits)
            opened.load()  # first frame only (GIF, animated WebP, APNG)
            pixels = _to_rgb(ImageOps.exif_transpose(opened))
    except MediaError:
        raise
    except PILImage.UnidentifiedImageError:
        raise MediaError(
            f"{name}: truncated or corrupt {_FORMAT_NAMES[fmt]} data (Pillow cannot read its header)"
        ) from None
    except PILImage.DecompressionBombError:
        raise MediaError(
            f"{name}: {_FORMAT_NAMES[fmt]} declares more pixels than Pillow's own limit "
            f"(expected at most {limits.max_pixels / 1e6:.1f} Mpx)"
        ) from None
    except _DECODE_ERRORS as exc:
        raise MediaError(
            f"{name}: truncated or corrupt {_FORMAT_NAMES[fmt]} data ({_one_line(exc)})"
        ) from None
    return Image(pixels, digest, pixels.width, pixels.height, fmt)


def _from_pil(picture: PILImage.Image, name: str, limits: MediaLimits) -> Image:
    _check_pixels(picture.size, name, "PIL", limits)
    try:
        picture.load()
        pixels = _to_rgb(ImageOps.exif_transpose(picture))
    except _DECODE_ERRORS as exc:
        raise MediaError(f"{name}: the Pillow image cannot be read ({_one_line(exc)})") from None
    digest = hashlib.sha256()
    digest.update(f"pil:{picture.mode}:{picture.width}x{picture.height}:".encode())
    digest.update(picture.tobytes())
    return Image(pixels, digest.hexdigest(), pixels.width, pixels.height, "PIL")


def _to_rgb(picture: PILImage.Image) -> PILImage.Image:
    """RGB with any transparency composited on white: transformers' ``convert_to_rgb`` (the
    image processors' ``do_convert_rgb``), step for step."""
    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        rgba = picture.convert("RGBA")
        background = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(background, rgba).convert("RGB")
    return picture.convert("RGB")


# --- where the bytes come from ---------------------------------------------------------------


def _read_source(
    source: Any, *, allow_remote: bool, limits: MediaLimits, label: str | None
) -> tuple[bytes, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), label or "image bytes"
    if isinstance(source, os.PathLike):
        return _read_path(Path(source), label, limits), _named(label, os.fspath(source))
    if not isinstance(source, str):
        raise MediaError(
            f"{label or 'image'}: expected bytes, a path, a data URL or base64 text, "
            f"found {type(source).__name__}"
        )
    text = source.strip()
    lowered = text[:16].lower()
    if lowered.startswith("data:"):
        name = _named(label, "data URL")
        return _read_data_url(text, name, limits), name
    if lowered.startswith(("http://", "https://")):
        name = _named(label, _short(text))
        if not allow_remote:
            raise MediaError(
                f"{name}: remote image URLs are refused (expected a local path, a data URL or "
                "base64; allow_remote=True fetches them)"
            )
        return _fetch(text, name, limits), name
    if lowered.startswith("file://"):
        raise MediaError(
            f"{_named(label, _short(text))}: file:// URLs are not read (expected a plain path)"
        )
    if text and len(text) < 4096 and "\0" not in text and os.path.exists(text):
        return _read_path(Path(text), label, limits), _named(label, text)
    if len(text) >= 16 and _BASE64_TEXT.fullmatch(text[:4096]):
        name = _named(label, "base64 image")
        return _decode_base64(text, name, limits), name
    raise MediaError(
        f"{_named(label, _short(text))}: no such file, and not a data URL or base64 image data either"
    )


def _read_path(path: Path, label: str | None, limits: MediaLimits) -> bytes:
    name = _named(label, str(path))
    try:
        if not path.is_file():
            raise MediaError(f"{name}: no such file (expected an image file)")
        size = path.stat().st_size
        _check_bytes(size, name, limits)
        with path.open("rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except OSError as exc:
        raise MediaError(f"{name}: cannot read ({exc.strerror or _one_line(exc)})") from None
    _check_bytes(len(data), name, limits)
    return data


def _read_data_url(text: str, name: str, limits: MediaLimits) -> bytes:
    match = _DATA_URL.match(text)
    if not match:
        raise MediaError(f"{name}: malformed (expected data:image/<type>;base64,<data>)")
    media_type = match.group(1).strip().lower()
    params = [p.strip().lower() for p in match.group(2).split(";") if p.strip()]
    if media_type not in _MEDIA_TYPES:
        raise MediaError(
            f"{name}: media type {media_type or '(none)'!r} (expected image/png, image/jpeg, "
            "image/webp or image/gif)"
        )
    if "base64" not in params:
        raise MediaError(f"{name}: not base64-encoded (expected data:{media_type};base64,<data>)")
    return _decode_base64(text[match.end() :], name, limits)


def _decode_base64(text: str, name: str, limits: MediaLimits) -> bytes:
    most = 4 * -(-limits.max_bytes // 3)  # base64 characters of max_bytes
    if len(text) > 2 * most + 1024:  # room for line breaks; refused before any copy is made
        raise MediaLimitError(
            f"{name}: {len(text)} characters of base64, over the cap of "
            f"{_mb(limits.max_bytes)} decoded ({limits.cap_name.format('bytes')})",
            "max_bytes",
        )
    compact = "".join(text.split())
    if len(compact) > most + 4:
        raise MediaLimitError(
            f"{name}: {_mb(len(compact) * 3 // 4)} of base64 data, over the cap of "
            f"{_mb(limits.max_bytes)} ({limits.cap_name.format('bytes')})",
            "max_bytes",
        )
    if "-" in compact or "_" in compact:
        compact = compact.replace("-", "+").replace("_", "/")  # the URL-safe alphabet
    compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{name}: invalid base64 ({_one_line(exc)})") from None
    _check_bytes(len(data), name, limits)
    return data


def _fetch(url: str, name: str, limits: MediaLimits) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=limits.timeout_s, follow_redirects=True) as response:
            if response.status_code != 200:
                raise MediaError(f"{name}: HTTP {response.status_code} (expected 200)")
            declared = response.headers.get("content-length")
            if declared and declared.isdigit():
                _check_bytes(int(declared), name, limits)
            chunks, total = [], 0
            for chunk in response.iter_bytes():
                total += len(chunk)
                _check_bytes(total, name, limits)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise MediaError(f"{name}: fetch failed ({type(exc).__name__}: {_one_line(exc)})") from None
    return b"".join(chunks)


# --- the caps and the messages ----------------------------------------------------------------


def _check_bytes(size: int, name: str, limits: MediaLimits) -> None:
    if size > limits.max_bytes:
        raise MediaLimitError(
            f"{name}: {_mb(size)}, over the cap of {_mb(limits.max_bytes)} "
            f"({limits.cap_name.format('bytes')})",
            "max_bytes",
        )


def _check_pixels(size: tuple[int, int], name: str, fmt: str, limits: MediaLimits) -> None:
    width, height = size
    shown = _FORMAT_NAMES.get(fmt, fmt)
    if width <= 0 or height <= 0:
        raise MediaError(
            f"{name}: {shown} declares {width}x{height} pixels (expected both above 0)"
        )
    if width * height > limits.max_pixels:
        raise MediaLimitError(
            f"{name}: {shown} declares {width}x{height} pixels ({_px(width * height)}), "
            f"over the cap of {_px(limits.max_pixels)} "
            f"({limits.cap_name.format('pixels')})",
            "max_pixels",
        )


def _px(count: int) -> str:
    return f"{count / 1e6:.1f} Mpx" if count >= 100_000 else f"{count} px"


def _mb(size: int) -> str:
    return f"{size / (1024 * 1024):.1f} MiB" if size >= 1024 * 1024 else f"{size} bytes"


def _named(label: str | None, what: str) -> str:
    return f"{label} ({what})" if label else what


def _short(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
