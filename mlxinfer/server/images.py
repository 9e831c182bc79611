"""Chat requests with images: decoded before any byte is sent, then run by the batching engine
like text requests (concurrent, batched, prefix blocks named by their images).

Every API's image parts reach ``Routes.start`` as ``{"type": "image", "image": url}`` in a
user message's content (``image_parts.py``). :func:`start_with_images` refuses a text-only
model in one line (the API's 400), decodes every image (a bad one is a 400 naming ``image N``),
and hands the decoded images, whose identity is the SHA-256 of their bytes, to
``Engine.start(images=...)``: the engine encodes them once on its thread (its encoder cache
skips an image seen before) and names the prefix blocks that hold image tokens by the images
(``batch/images.py``), so a system prompt is shared across images and no block is shared
between two images.

What a request's images may be is ``serve``'s (``limits.Limits``): at most ``max_images`` of
them, each within ``max_image_bytes`` and ``max_image_pixels``; an ``http(s)`` URL is fetched
only with ``allow_remote_images``. Past a cap, :func:`decode_images` raises :class:`ImageLimit`,
the route's 413 (too many images, too many bytes) or 400 (too many pixels, a remote URL refused)
in its API's shape, naming the cap and its flag.

A model whose image requests the engine cannot run (``Engine.image_refusal``: a forward that
takes inputs the engine does not feed) is served by :class:`ImageStream`:
``stream_generate(images=...)`` on a thread of its own, one such request at a time, each on a
fresh cache.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from ..generation import stream_generate

_ONE_AT_A_TIME = threading.Lock()  # requests outside the engine run one after another
_END = object()


def image_sources(messages: Any) -> list[Any]:
    """The image parts' sources, in order (empty for a text prompt)."""
    if not isinstance(messages, list):
        return []
    return [
        part.get("image")
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def takes_images(model) -> bool:
    return callable(getattr(model, "encode_images", None))


class ImageLimit(ValueError):
    """A request's images past one of ``serve``'s caps: answered with ``status`` (413: too many
    images or bytes; 400: too many pixels, a remote URL not allowed), OpenAI's ``code``."""

    def __init__(self, message: str, status: int, code: str):
        super().__init__(message)
        self.status, self.code = status, code

    def shaped(self, error):
        """``error`` (the API's 400 for this message) with this status and code."""
        error.status = self.status
        if hasattr(error, "code"):  # OpenAI's shape (Anthropic's and Ollama's have none)
            error.code = self.code
        return error


def is_remote(source: Any) -> bool:
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


def decode_images(sources: list, limits: Any) -> list:
    """The request's images decoded (``vision.Image``s), within ``limits`` (the app's
    ``limits.Limits``, not imported: limits -> shapes -> each API's request -> here): ImageLimit
    past a cap, MediaError (a ValueError) for an image that does not decode."""
    from ..errors import MediaLimitError
    from ..vision import load_image

    if len(sources) > limits.max_images:
        raise ImageLimit(
            f"{len(sources)} images in the request, over the cap of {limits.max_images} per "
            "request (serve --max-images)",
            413,
            "too_many_images",
        )
    images = []
    for i, source in enumerate(sources):
        label = f"image {i + 1}"
        if is_remote(source) and not limits.allow_remote_images:
            raise ImageLimit(
                f"{label}: remote image URLs are refused: only data URLs "
                "(data:image/...;base64,...) are accepted (serve --allow-remote-images fetches "
                "them)",
                400,
                "invalid_image_url",
            )
        try:
            images.append(
                load_image(
                    source,
                    allow_remote=limits.allow_remote_images,
                    limits=limits.media,
                    label=label,
                )
            )
        except MediaLimitError as e:
            status = 413 if e.limit == "max_bytes" else 400
            raise ImageLimit(str(e), status, "image_too_large") from None
    return images


def start_with_images(entry, messages, sources: list, timeout: float, options: dict, limits: Any):
    """A chat request with images, started: through ``entry.engine`` (a ``Stream``), or for a
    model it cannot run them for, an :class:`ImageStream`. Raises ValueError (MediaError) for a
    text-only model or an image that does not decode, ImageLimit past ``limits``, before
    anything runs."""
    if not takes_images(entry.model):
        raise ValueError(
            f"model '{entry.name}' takes text only (no vision tower): image parts are refused"
        )
    images = decode_images(sources, limits)
    if entry.engine.image_refusal() is None:
        return entry.engine.start(
            entry.tokenizer, messages, images=images, timeout=timeout, **options
        )
    return ImageStream(entry.model, entry.tokenizer, messages, images, timeout, **options)


class ImageStream:
    """``stream_generate(model, tokenizer, messages, images=..., **options)`` on its own thread
    (MLX ties a lazy array to the thread that built it, so one thread runs the whole request);
    iterate it for the results; ``cancel()`` stops it after the token in hand."""

    def __init__(self, model, tokenizer, messages, images: list[Any], timeout: float, **options):
        self._results: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self.timeout = timeout
        args = (model, tokenizer, messages, images, options)
        self._thread = threading.Thread(target=self._run, args=args, daemon=True)
        self._thread.start()

    def _run(self, model, tokenizer, messages, images, options) -> None:
        try:
            with _ONE_AT_A_TIME:
                results = stream_generate(model, tokenizer, messages, images=images, **options)
                try:
                    for r in results:
                        self._results.put(r)
                        if self._cancelled.is_set():
                            break
                finally:
                    results.close()
        except BaseException as e:  # handed to the reader, who raises it
            self._results.put(e)
        finally:
            self._results.put(_END)

    def __iter__(self) -> Iterator:
        while True:
            try:
                item = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.cancel()
                raise TimeoutError(f"no progress in {self.timeout:.0f} s") from None
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self._cancelled.set()
