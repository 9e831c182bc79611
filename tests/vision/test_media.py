"""mlxinfer/vision/media.py: images in, under the caps, hostile ones refused in one line.

Every image here is generated in the test (Pillow), and the hostile ones are hand-made headers:
a PNG that declares 30,000 x 30,000 pixels in a few dozen bytes, a GIF whose first frame reaches
past its canvas, a WebP canvas of 16,384 squared. Transparency is checked by pixel value against
white and against transformers' ``convert_to_rgb`` (what its image processors do).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import struct
import threading
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import features

from mlxinfer.errors import MediaError, MlxInferError
from mlxinfer.vision import MediaLimits, load_image
from mlxinfer.vision.header import declared_size, sniff_format


def encode(picture: PILImage.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    picture.save(out, fmt, **options)
    return out.getvalue()


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> PILImage.Image:
    channels = len(mode) if mode in ("RGB", "RGBA", "LA") else 1
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return PILImage.fromarray(array.squeeze(-1) if channels == 1 else array, mode)


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and holds a few bytes of data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, MlxInferError)
    assert "\n" not in message and message, message
    return message


# --- what comes in ----------------------------------------------------------------------------


def test_every_source_kind_gives_the_same_image_and_identity(tmp_path):
    data = encode(noise(23, 11), "PNG")
    path = tmp_path / "noise.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))  # MIME line breaks
    urlsafe = base64.urlsafe_b64encode(data).decode().rstrip("=")
    sources = [
        data,
        bytearray(data),
        path,
        str(path),
        f"data:image/png;base64,{b64}",
        f"DATA:image/PNG;charset=utf-8;base64,{b64}",
        b64,
        wrapped,
        urlsafe,
    ]
    digest = hashlib.sha256(data).hexdigest()
    reference = np.asarray(noise(23, 11))
    for source in sources:
        image = load_image(source)
        assert (image.sha256, image.width, image.height, image.format) == (digest, 23, 11, "PNG")
        assert image.pixels.mode == "RGB"
        assert np.array_equal(np.asarray(image.pixels), reference)
    assert load_image(data) == load_image(path)  # equal by identity, hashable
    assert len({load_image(data), load_image(b64)}) == 1


def test_a_changed_file_at_the_same_path_is_a_new_image(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encode(noise(8, 8, seed=1), "PNG"))
    first = load_image(path)
    path.write_bytes(encode(noise(8, 8, seed=2), "PNG"))
    assert load_image(path).sha256 != first.sha256


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF"])
def test_the_other_allowed_formats_decode(fmt):
    if fmt == "WEBP" and not features.check("webp"):
        pytest.skip("this Pillow was built without WebP")
    image = load_image(encode(noise(31, 17), fmt))
    assert (image.format, image.width, image.height, image.pixels.mode) == (fmt, 31, 17, "RGB")


def test_a_gif_gives_its_first_frame():
    frames = [PILImage.new("RGB", (12, 6), color) for color in ((250, 0, 0), (0, 0, 250))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50)
    image = load_image(out.getvalue())
    assert image.pixels.getpixel((3, 3))[0] > 200 and image.pixels.getpixel((3, 3))[2] < 50


def test_a_pillow_image_is_taken_as_it_is_with_an_identity_of_its_pixels():
    picture = noise(9, 5, "RGBA")
    image = load_image(picture)
    assert (image.format, image.width, image.height) == ("PIL", 9, 5)
    assert image.sha256 == load_image(picture.copy()).sha256
    assert image.sha256 != load_image(noise(9, 5, "RGBA", seed=3)).sha256


# --- orientation and transparency -------------------------------------------------------------


def test_exif_orientation_is_applied():
    """A 40 x 20 JPEG, left half red and right half blue, tagged orientation 6 (turn 90 degrees
    clockwise to view): it loads 20 x 40 with red on top."""
    picture = PILImage.new("RGB", (40, 20), (255, 0, 0))
    picture.paste((0, 0, 255), (20, 0, 40, 20))
    exif = PILImage.Exif()
    exif[0x0112] = 6
    image = load_image(encode(picture, "JPEG", exif=exif.tobytes(), quality=95))
    assert (image.width, image.height) == (20, 40)
    top, bottom = image.pixels.getpixel((10, 8)), image.pixels.getpixel((10, 32))
    assert top[0] > 200 and top[2] < 60, top
    assert bottom[2] > 200 and bottom[0] < 60, bottom


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_alpha_is_composited_on_white(mode):
    picture = PILImage.new(mode, (4, 2), (10, 20, 30, 0) if mode == "RGBA" else (10, 0))
    picture.putpixel((1, 0), (10, 20, 30, 255) if mode == "RGBA" else (10, 255))
    picture.putpixel((2, 0), (0, 0, 0, 128) if mode == "RGBA" else (0, 128))
    pixels = load_image(encode(picture, "PNG")).pixels
    assert pixels.getpixel((0, 0)) == (255, 255, 255)  # fully transparent: white, not its colour
    opaque = (10, 20, 30) if mode == "RGBA" else (10, 10, 10)
    assert pixels.getpixel((1, 0)) == opaque
    assert all(126 <= c <= 128 for c in pixels.getpixel((2, 0)))  # half black on white


def test_a_palette_with_a_transparent_index_is_composited_on_white():
    picture = PILImage.new("P", (4, 4), 0)
    picture.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    picture.putpixel((1, 1), 1)
    for fmt in ("PNG", "GIF"):
        pixels = load_image(encode(picture, fmt, transparency=0)).pixels
        assert pixels.getpixel((0, 0)) == (255, 255, 255), fmt
        assert pixels.getpixel((1, 1)) == (200, 30, 30), fmt


def test_transparency_matches_transformers_convert_to_rgb():
    """The image processors' ``do_convert_rgb`` (transformers.image_transforms.convert_to_rgb),
    not transformers' ``load_image`` (which drops alpha)."""
    convert_to_rgb = pytest.importorskip(
        "transformers.image_transforms", reason="transformers (test extras) is not installed"
    ).convert_to_rgb
    for picture in (noise(13, 7, "RGBA"), noise(13, 7, "LA")):
        data = encode(picture, "PNG")
        ours = np.asarray(load_image(data).pixels)
        theirs = convert_to_rgb(PILImage.open(io.BytesIO(data)), return_numpy=True)
        assert np.array_equal(ours, theirs)


# --- refused, in one line ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO"])
def test_formats_outside_the_allow_list_are_refused_by_name(fmt):
    with pytest.raises(MediaError) as excinfo:
        load_image(encode(noise(16, 16), fmt), label="image 2")
    message = one_line_error(excinfo)
    assert message.startswith("image 2") and fmt in message and "PNG, JPEG, WebP or GIF" in message


def test_the_byte_cap_holds_for_every_source(tmp_path):
    data = encode(noise(64, 64), "PNG")
    path = tmp_path / "big.png"
    path.write_bytes(data)
    limits = MediaLimits(max_bytes=1000)
    b64 = base64.b64encode(data).decode()
    for source in (data, path, b64, f"data:image/png;base64,{b64}"):
        with pytest.raises(MediaError) as excinfo:
            load_image(source, limits=limits)
        assert "over the cap" in one_line_error(excinfo) and "max_bytes" in str(excinfo.value)
    assert load_image(data, limits=MediaLimits(max_bytes=len(data))).width == 64


@pytest.mark.parametrize("side", [30_000, 10_000, 7_500])
def test_a_decompression_bomb_is_our_error_from_the_header_without_pillows_warning(side):
    """30,000 squared is past Pillow's own error, 10,000 squared past its warning only, 7,500
    squared under both and over our 50 Mpx: every one is our message, and nothing warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MediaError) as excinfo:
            load_image(png_header_only(side, side))
    message = one_line_error(excinfo)
    assert f"{side}x{side}" in message and "max_pixels" in message
    assert not [w for w in caught if "DecompressionBomb" in w.category.__name__]


def test_a_gif_whose_first_frame_outgrows_its_canvas_is_caught_from_the_header():
    """GIF canvas 10 x 10, first frame 20,000 x 20,000: Pillow would grow the canvas."""
    gif = (
        b"GIF89a"
        + struct.pack("<HHBBB", 10, 10, 0, 0, 0)
        + b"\x2c"
        + struct.pack("<HHHHB", 0, 0, 20_000, 20_000, 0)
        + b"\x02\x02\x44\x01\x00\x3b"
    )
    assert declared_size(gif, "GIF") == (20_000, 20_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MediaError) as excinfo:
            load_image(gif)
    assert "20000x20000" in one_line_error(excinfo)
    assert not [w for w in caught if "DecompressionBomb" in w.category.__name__]


def test_declared_sizes_are_read_from_each_header():
    for fmt in ("PNG", "JPEG", "GIF") + (("WEBP",) if features.check("webp") else ()):
        data = encode(noise(37, 21), fmt)
        assert sniff_format(data) == fmt
        assert declared_size(data, fmt) == (37, 21), fmt
    if features.check("webp"):
        assert declared_size(encode(noise(37, 21), "WEBP", lossless=True), "WEBP") == (37, 21)
        assert declared_size(encode(noise(37, 21, "RGBA"), "WEBP"), "WEBP") == (37, 21)  # VP8X
    jpeg = encode(noise(37, 21), "JPEG")
    after_app0 = 4 + int.from_bytes(jpeg[4:6], "big")
    junk = jpeg[:after_app0] + b"\x00junk" + jpeg[after_app0:]  # bytes between segments
    assert declared_size(junk, "JPEG") == PILImage.open(io.BytesIO(junk)).size == (37, 21)
    vp8x = b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\x0a\x00\x00\x00" + b"\x10\x00\x00\x00"
    vp8x += (16383).to_bytes(3, "little") * 2
    assert declared_size(vp8x, "WEBP") == (16384, 16384)
    with pytest.raises(MediaError) as excinfo:
        load_image(vp8x)
    assert "16384x16384" in one_line_error(excinfo)


def test_a_small_pixel_cap_refuses_a_real_image():
    with pytest.raises(MediaError) as excinfo:
        load_image(encode(noise(20, 20), "PNG"), limits=MediaLimits(max_pixels=399))
    assert "20x20" in one_line_error(excinfo)


def test_zero_size_truncated_and_garbage_are_one_line_errors():
    cases = {
        "zero": png_header_only(0, 10),
        "truncated": encode(noise(64, 64), "PNG")[:300],
        "truncated jpeg": encode(noise(64, 64), "JPEG")[:400],
        "no frame": b"GIF89a" + struct.pack("<HHBBB", 4, 4, 0, 0, 0) + b"\x3b",
        "garbage": b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,
        "text": b"hello, this is not an image",
        "empty": b"",
    }
    for what, data in cases.items():
        with pytest.raises(MediaError) as excinfo:
            load_image(data, label="image 3")
        message = one_line_error(excinfo)
        assert message.startswith("image 3"), (what, message)


def test_bad_strings_are_one_line_errors(tmp_path):
    png = base64.b64encode(encode(noise(4, 4), "PNG")).decode()
    cases = {
        "data:text/plain;base64," + png: "text/plain",
        "data:image/bmp;base64," + png: "image/bmp",
        "data:image/png," + png: "not base64",
        "data:image/png;base64,@@@@####": "invalid base64",
        "data:image/png;base64," + png[:-5] + "*" + png[-4:]: "invalid base64",
        "data:image/png" + png: "malformed",
        str(tmp_path / "missing.png"): "no such file",
        "cat.png": "no such file",
        "file:///etc/passwd": "file://",
        str(tmp_path): "no such file",  # a directory
    }
    for source, expected in cases.items():
        with pytest.raises(MediaError) as excinfo:
            load_image(source)
        assert expected in one_line_error(excinfo), (source[:40], str(excinfo.value))
    with pytest.raises(MediaError) as excinfo:
        load_image(12345)
    assert "found int" in one_line_error(excinfo)


def test_remote_urls_are_refused_unless_allowed():
    for url in ("https://example.com/cat.png", "HTTP://example.com/cat.png"):
        with pytest.raises(MediaError) as excinfo:
            load_image(url)
        assert "remote image URLs are refused" in one_line_error(excinfo)
        assert "allow_remote" in str(excinfo.value)


@pytest.fixture
def image_server():
    """A local HTTP server: /ok.png is a PNG, /big.png is 5,000 bytes of PNG, anything else 404."""
    body = encode(noise(10, 10), "PNG")
    big = encode(noise(40, 40), "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            payload = {"/ok.png": body, "/big.png": big}.get(self.path)
            if payload is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()  # no Content-Length: the cap is checked as the body streams
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.protocol_version = "HTTP/1.0"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", body, big
    finally:
        server.shutdown()
        server.server_close()


def test_an_allowed_remote_url_is_fetched_under_the_byte_cap(image_server):
    pytest.importorskip("httpx", reason="httpx is not installed")
    base, body, big = image_server
    image = load_image(f"{base}/ok.png", allow_remote=True)
    assert image.sha256 == hashlib.sha256(body).hexdigest()
    with pytest.raises(MediaError) as excinfo:
        load_image(f"{base}/big.png", allow_remote=True, limits=MediaLimits(max_bytes=len(big) - 1))
    assert "over the cap" in one_line_error(excinfo)
    with pytest.raises(MediaError) as excinfo:
        load_image(f"{base}/missing.png", allow_remote=True, label="image 1")
    message = one_line_error(excinfo)
    assert message.startswith("image 1") and "HTTP 404" in message
