"""An encoded image's header: the format its first bytes announce and the size it declares, read
before Pillow decodes anything (:mod:`.media` checks the pixel cap against it, so a
decompression bomb is refused before a pixel is allocated)."""

from __future__ import annotations

import struct


def sniff_format(data: bytes) -> str | None:
    """The format the leading bytes announce (Pillow's format names), or None when unknown; the
    formats outside the allow-list are named only so the error can say what was found."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head.startswith(b"BM"):
        return "BMP"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF"
    if head.startswith(b"\x00\x00\x01\x00"):
        return "ICO"
    if head[4:8] == b"ftyp":
        return "HEIF/AVIF"
    if head.startswith(b"8BPS"):
        return "PSD"
    if head.startswith(b"%PDF"):
        return "PDF"
    if head.lstrip().startswith(b"<"):
        return "SVG/XML/HTML"
    return None


def declared_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) as the header declares it, the largest of the canvas and the first frame
    where the format has both (GIF); None when the header is too short to say (Pillow then
    fails on it, or its size is checked once Pillow has read the header)."""
    try:
        if fmt == "PNG":
            if data[12:16] == b"IHDR":
                return struct.unpack(">II", data[16:24])
        elif fmt == "GIF":
            return _gif_size(data)
        elif fmt == "JPEG":
            return _jpeg_size(data)
        elif fmt == "WEBP":
            return _webp_size(data)
    except (struct.error, IndexError):
        return None
    return None


def _gif_size(data: bytes) -> tuple[int, int]:
    width, height, flags = struct.unpack("<HHB", data[6:11])
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while pos < len(data):
        block = data[pos]
        if block == 0x21:  # an extension: its label, then sub-blocks up to a zero length
            pos += 2
            while pos < len(data) and data[pos]:
                pos += data[pos] + 1
            pos += 1
        elif block == 0x2C:  # the first image descriptor: Pillow grows the canvas to hold it
            x, y, w, h = struct.unpack("<HHHH", data[pos + 1 : pos + 9])
            return max(width, x + w), max(height, y + h)
        else:
            break
    return width, height


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    pos = 2
    while pos + 4 <= len(data):
        while pos < len(data) and data[pos] != 0xFF:  # junk between segments: Pillow skips it
            pos += 1
        while pos < len(data) and data[pos] == 0xFF:
            pos += 1
        if pos >= len(data):
            return None
        marker = data[pos]
        pos += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            continue
        if marker in (0xD9, 0xDA):  # the image ends or its data starts before a frame header
            return None
        (length,) = struct.unpack(">H", data[pos : pos + 2])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", data[pos + 3 : pos + 7])
            return width, height
        pos += length
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    if chunk == b"VP8L":
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 ":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    return None
