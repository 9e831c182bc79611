"""Images as every API's request hands them on: one common part, ``{"type": "image", "image":
data URL}``, in a message's content list beside its text parts (``{"type": "text", "text"}``).
The OpenAI route's ``image_url`` parts, Anthropic's base64 ``image`` blocks, the Responses API's
``input_image`` parts and Ollama's ``images`` all become it, so ``Routes.start`` decodes and runs
them one way (a text-only model given one is a 400 in the API's shape, naming the model).

Only data URLs travel: a bare string that is not one could be read as a local path by
``vision.load_image``, which a server must never do for a client, so Ollama's bare base64 is
wrapped here. Images in a tool's output (Claude Code's Read of a picture, Codex's
``view_image``) are kept as images for a model that takes them; for a text-only model each
becomes a one-line note (:func:`tool_images_as_notes`), so that an agent's session goes on.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from ..models.config import WITH_TOWER
from ..vision.header import sniff_format
from .images import image_sources, takes_images

MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
NOTE = "[image omitted: model '{}' takes text only]"
TOWERS = (
    "vision_tower.",
    "visual.",
    "vision_model.",
)  # the towers' weight prefixes (loader._TOWERS)
MAX_HEADER = 100 << 20  # bytes of a safetensors header read (safetensors' own cap)


def image_part(url: str) -> dict:
    """The common image part for a data URL."""
    return {"type": "image", "image": url}


def data_url(media_type: str, data: str) -> str:
    """``data:<media_type>;base64,<data>`` (the media type is checked when the image is
    decoded: an unsupported one is that request's 400)."""
    return f"data:{media_type};base64,{data}"


def base64_url(data: str) -> str:
    """Bare base64 image data (Ollama's ``images``) as a data URL, its media type read from the
    first bytes (PNG when they name none: the decoder then says what they are)."""
    head = "".join(data[:64].split())[:24]
    try:
        fmt = sniff_format(base64.b64decode(head + "=" * (-len(head) % 4)))
    except (binascii.Error, ValueError):
        fmt = None
    return data_url(MEDIA_TYPES.get(fmt or "", "image/png"), data)


def has_images(messages: Any) -> bool:
    return bool(image_sources(messages))


def model_takes_images(entry) -> bool:
    """Whether a served model (a registry entry) reads images: a loaded one has a vision tower
    (``encode_images``); one not loaded yet is judged by its config (``config_takes_images``)."""
    if entry.model is not None:
        return takes_images(entry.model)
    return config_takes_images(entry.path)


def config_takes_images(directory) -> bool:
    """Whether the checkpoint in ``directory`` would load with its vision tower (read from its
    files, not loaded): a family whose tower runs here (``models.config.WITH_TOWER``) with a
    ``vision_config``, and the tower's weights among the tensors the safetensors headers name
    (the loader runs the language model alone without them)."""
    if directory is None:
        return False
    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not (
        isinstance(config, dict)
        and config.get("model_type") in WITH_TOWER
        and isinstance(config.get("vision_config"), dict)
    ):
        return False
    return any(tower in name for name in _tensor_names(directory) for tower in TOWERS)


def _tensor_names(directory: Path) -> list[str]:
    """The tensor names of a checkpoint's safetensors files (their JSON headers only)."""
    names: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= MAX_HEADER:
                    continue
                header = json.loads(f.read(size))
        except (OSError, ValueError):
            continue
        if isinstance(header, dict):
            names += [k for k in header if k != "__metadata__"]
    return names


def for_model(entry, messages: Any) -> Any:
    """``messages`` as ``entry``'s model takes them: as they are for a model that reads images;
    for a text-only one, the images in tool turns as notes (:func:`tool_images_as_notes`)."""
    if not isinstance(messages, list) or not has_images(messages) or model_takes_images(entry):
        return messages
    return tool_images_as_notes(messages, entry.name)


def tool_images_as_notes(messages: list[dict], name: str) -> list[dict]:
    """``messages`` with the image parts of tool turns replaced by a one-line note naming the
    model ``name`` (for a text-only model); a tool turn left with text only becomes a string,
    as the text-only path takes it. Images elsewhere are left for ``Routes.start`` to refuse."""
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "tool" and isinstance(content, list):
            text = "".join(
                NOTE.format(name) if p.get("type") == "image" else str(p.get("text", ""))
                for p in content
            )
            m = {**m, "content": text}
        out.append(m)
    return out
