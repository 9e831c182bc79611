"""Images in a single request: decoded, processed, encoded by the model's tower, prefilled.

For a model with a vision tower (``model.encode_images``: models/gemma3.py, qwen2_5_vl.py,
qwen3_vl.py; given the images' ``grid_thw`` where the processor has them):

1. :func:`load_images`: each source (a path, bytes, a data URL, a Pillow image) decoded by
   ``vision.media.load_image``, with the checkpoint's image processor (``vision.processors``);
2. :class:`PromptImages` gives ``prepare_prompt`` the image parts the chat template renders as
   markers (``{"type": "image"}``, before the text of the last user message unless the
   messages already hold one per image) and expands each marker into the image's placeholder
   tokens;
3. :func:`image_inputs`: what the model's ``image_inputs`` gives, one row per prompt position:
   the tower's tokens merged into the prompt's embeddings (``embeds``), and the model's own
   (Gemma 3's image ``blocks``; Qwen-VL's (t, h, w) ``positions`` and deepstack features), for
   :func:`prefill_images`, which feeds each chunk its own rows (a chunk never splits a block:
   its tokens see each other both ways, so they must be in one forward pass). A model whose
   positions run apart from the token index (Qwen-VL) keeps that with the request's cache.

No cache keyed by token ids may hold a prompt with images: every image's placeholder ids are
the same, so a reused prefix would silently carry another image's keys. A request with images
therefore runs on a fresh cache of its own (``stream_generate``), never the caller's
``prompt_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from ..backends import prefill_schedule
from ..cache.prompt import PromptCache
from ..errors import MediaError, PromptTooLongError
from ..models.layers.rope import prompt_reach
from ..vision import load_image, load_processor
from ..vision.media import Image
from ..vision.processors import ImageProcessor, ProcessedImages
from .prefill import MAX_RESERVED_DECODE, _Growing


@dataclass
class PromptImages:
    """A request's images, processed: what the prompt needs (the markers and their expansion)
    and what the model needs (the pixel values)."""

    processor: ImageProcessor
    processed: ProcessedImages

    @property
    def count(self) -> int:
        return len(self.processed.tokens_per_image)

    @property
    def sha256(self) -> list[str]:
        return list(self.processed.sha256)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with one ``{"type": "image"}`` part per image: as they are if they hold
        that many already, else the parts put before the text of the last user message."""
        parts = [
            part
            for m in messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
            if isinstance(part, dict) and part.get("type") == "image"
        ]
        if len(parts) == self.count:
            return messages
        if parts:
            raise MediaError(
                f"prompt: {len(parts)} image part(s) in the messages for {self.count} image(s)"
            )
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise MediaError("prompt: images need a user message to go in (found none)")
        last = messages[users[-1]]
        content = last.get("content")
        text = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        images = [{"type": "image"} for _ in range(self.count)]
        out = list(messages)
        out[users[-1]] = {**last, "content": images + list(text)}
        return out

    def expand(self, text: str) -> str:
        """The rendered prompt with each image marker expanded into its placeholder tokens."""
        marker = self.processor.marker
        if text.count(marker) != self.count:
            raise MediaError(
                f"prompt: the chat template wrote {text.count(marker)} image marker(s) "
                f"({marker!r}) for {self.count} image(s)"
            )
        return self.processor.expand(text, self.processed)


def images_in_messages(prompt: Any) -> tuple[Any, list[Any]]:
    """A chat prompt's images given in its messages' content parts, as the chat templates take
    them: each ``{"type": "image", "image": source}`` (a path, bytes, a data URL, a Pillow
    image) and OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` becomes the
    template's marker ``{"type": "image"}``; returns (the messages so, the sources in order). A
    text prompt, token ids, or messages without such parts come back as they are, with []."""
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(m, dict) for m in prompt):
        return prompt, []
    sources: list[Any] = []
    out = []
    for m in prompt:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            source = _part_source(part)
            if source is not None:
                sources.append(source)
                part = {"type": "image"}
            parts.append(part)
        out.append({**m, "content": parts})
    return (out, sources) if sources else (prompt, [])


def _part_source(part: Any) -> Any:
    """The image a content part carries (None for a text part or a bare marker)."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image":
        return part.get("image")
    if part.get("type") == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise MediaError("image_url part: expected {'url': a data URL or path}")
        return url
    return None


def load_images(model, tokenizer, sources: Sequence[Any]) -> PromptImages:
    """Decode and process ``sources`` for ``model`` (a ``vision.Image`` as it is); a model
    without a vision tower is a one-line MediaError naming it."""
    directory = getattr(model, "source_dir", None)
    if not callable(getattr(model, "encode_images", None)) or directory is None:
        name = Path(directory).name if directory is not None else type(model).__module__
        kind = getattr(getattr(model, "args", None), "model_type", "?")
        raise MediaError(f"{name}: a model without a vision tower ({kind}) cannot take images")
    processor = load_processor(directory, tokenizer=tokenizer)
    if processor is None:
        raise MediaError(f"{Path(directory).name}: no vision_config in config.json: no images")
    images = [
        s if isinstance(s, Image) else load_image(s, label=f"image {i + 1}")
        for i, s in enumerate(sources)
    ]  # an Image decoded already (the server's, before any byte is sent) keeps its identity
    return PromptImages(processor, processor.prepare(images))


def image_inputs(model, ids: list[int], images: PromptImages) -> dict[str, mx.array]:
    """The model's extra inputs for a prompt's ``ids``: ``embeds`` (1, L, hidden), ``blocks``
    (L,). The ids must hold every image's placeholder tokens (a truncated prompt is refused)."""
    want = sum(images.processed.tokens_per_image)
    found = ids.count(images.processor.image_token_id)
    if found != want:
        raise PromptTooLongError(
            f"prompt: {found} image tokens for {images.count} image(s) of "
            f"{want} in all (a prompt with images cannot be truncated)"
        )
    return model.image_inputs(ids, encode_images(model, images.processed))


def encode_images(model, processed: ProcessedImages) -> Any:
    """The tower's features of ``processed`` (``model.encode_images``, given the images'
    ``grid_thw`` where the processor has them)."""
    grids = processed.grid_thw
    pixels = mx.array(processed.pixel_values)
    return model.encode_images(pixels) if grids is None else model.encode_images(pixels, grids)


def _chunk(value: mx.array, start: int, end: int) -> mx.array:
    """Positions ``start:end`` of a per-position input: its only axis, or its next-to-last
    ((..., L, features): embeds (1, L, hidden), positions (1, L, 3), deepstack (n, 1, L, hidden))."""
    return value[start:end] if value.ndim == 1 else value[..., start:end, :]


def prefill_images(
    model,
    pc: PromptCache,
    ids: list[int],
    inputs: dict[str, mx.array],
    step: int,
    *,
    then: int = 1,
) -> None:
    """``prefill`` for the first ``len(ids)`` positions of a prompt with images, into a fresh
    ``pc``: chunks of about ``step`` tokens, each with its own slice of every input in
    ``inputs`` (one row per position: :func:`_chunk`); where the inputs have ``blocks`` (images
    whose tokens see each other both ways), a chunk is stretched to the end of an image it would
    cut."""
    if pc.tokens:
        raise ValueError("prefill_images: the cache must be fresh (never reused across images)")
    blocks = np.array(inputs["blocks"]) if "blocks" in inputs else np.full(len(ids), -1)
    y = mx.array(ids, dtype=mx.int32)
    growable = [c for c in pc.cache if isinstance(c, _Growing)]
    for c in growable:
        c.reserve(c.offset + len(ids) + 1)
    with prefill_schedule(model), prompt_reach(len(ids) + 1):
        start = 0
        while start < len(ids):
            end = min(start + step, len(ids))
            while end < len(ids) and blocks[end] >= 0 and blocks[end] == blocks[end - 1]:
                end += 1  # inside an image: take the rest of it
            model(
                y[None, start:end],
                pc.cache,
                **{name: _chunk(value, start, end) for name, value in inputs.items()},
            )
            mx.eval([c.state for c in pc.cache])  # one chunk's graph at a time (prefill.py)
            pc.tokens.extend(ids[start:end])
            start = end
    for c in growable:
        c.grow(c.offset + max(1, min(then, MAX_RESERVED_DECODE)))
