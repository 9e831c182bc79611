"""What the image tests of the server's APIs share: the tiny random Gemma 3 image-text checkpoint
(``gemma3_vlm``) with two test pictures, a text-only copy of it, and data URLs."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

from gemma3_vlm import make_gemma3_vlm, random_image

SIZES = [(150, 118), (131, 170)]  # non-square, larger than the tower's 56 px input


def vlm_with_images(root: Path) -> tuple[Path, list[Path]]:
    """The checkpoint under ``root/model`` and two PNG files beside it."""
    path, _, _ = make_gemma3_vlm(root / "model")
    files = []
    for i, size in enumerate(SIZES):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    return path, files


def text_only_copy(source: Path, dest: Path) -> Path:
    """``source`` without its tower's and projector's weights (it loads as a text model)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, dest)
    weights = load_file(dest / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "vision" not in k and "projector" not in k},
        dest / "model.safetensors",
        metadata={"format": "pt"},
    )
    return dest


def b64(path: Path) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def data_url(path: Path) -> str:
    return "data:image/png;base64," + b64(path)


def hostile_images(good: Path) -> dict[str, bytes]:
    """Images a server must refuse in one line: a 30,000 x 30,000 PNG of a few bytes (a
    decompression bomb), ``good`` cut short, a BMP (outside the allow-list), nothing at all."""
    import io
    import struct
    import zlib

    from PIL import Image

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    bomb = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 30_000, 30_000, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )
    bmp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(bmp, "BMP")
    data = Path(good).read_bytes()
    return {"bomb": bomb, "truncated": data[: len(data) // 3], "bmp": bmp.getvalue(), "empty": b""}
