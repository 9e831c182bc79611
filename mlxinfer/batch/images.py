"""A request's images inside the batch: their runs of tokens, their names in the prefix cache,
and their encoding, once, on the engine's thread.

:class:`RowImages` is made at ``submit`` from the request's ids and its processed images
(``generation.images.load_images``: decoding and the processor run on the caller's thread, in
numpy). The engine's thread encodes them (:meth:`RowImages.encode`: the tower, through the
:class:`EncoderCache`, and ``model.image_inputs``) when the row's first prefill chunk is cut,
and keeps the merged embeddings until its prompt is in; each chunk feeds its slice
(``embeds=``), and stretches to the end of an image it would cut (:meth:`RowImages.chunk_end`):
an image's tokens see each other both ways, so all of them are in the forward that computes
any of them (the mask: ``views.StepBatch``'s ``blocks``). A model with multimodal RoPE (Qwen-VL)
gives every token (t, h, w) ``positions``: each chunk takes its slice, and the row keeps its
``delta``, with which the scheduler's decode steps give the row its own positions
(``scheduler._row_positions``): the request's state, never the model's.

The prefix cache. Every image's placeholder ids are the same, so a block that holds image
tokens is named by the images too: its *salt*, hashed into its chain hash after its token ids
(``pool.block_hash``), lists each image whose tokens fall in the block as (the image's SHA-256,
the processor's ``variant``, the ordinal of its first token there). Chained, a block's name is
(its parent's name, its ids, its salt): the blocks before the first image keep the names a text
prompt gives them (a new image never loses the shared system prompt, as it would with one hash
of the whole request salting every block), and two requests whose text is the same but whose
images differ part at the first block that holds an image token. The disk tier names its files
by the same chain hashes. A prefix hit never ends inside an image (:meth:`RowImages.cut`).

The encoder cache keeps each image's features alone, for every family: the processor's output
is cut per image (``ProcessedImages.image_rows``: one pixel row, Gemma 3's crops, Idefics3's
frames, Qwen-VL's t*h*w patches, Pixtral's padded row with its grid), the tower runs once over
the images it misses (``ProcessedImages.select``), its output is cut back per image by the
tokens each takes (``tokens_per_image``; a model whose features are not one array of rows,
Qwen-VL's with deepstack and grids, cuts and joins them itself: ``split_image_features``,
``join_image_features``), and the request's features are the images' joined in order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import PromptTooLongError
from ..generation.images import PromptImages, _chunk, encode_images, image_inputs

DEFAULT_ENCODER_BYTES = 256 << 20  # the encoder cache's features, at most
# What a model's image_inputs may give, one row per prompt position: the merged embeddings,
# Gemma 3's image blocks, Qwen-VL's (t, h, w) positions and Qwen3-VL's deepstack features.
PER_POSITION = ("embeds", "blocks", "positions", "deepstack")


@dataclass
class RowImages:
    """One request's images in the engine: ``images`` (processed), ``runs`` (L,) each image
    run's number at its tokens, -1 elsewhere, ``salts`` (block index -> salt, blocks holding
    image tokens only) and, from the first prefill chunk to the last, ``inputs``."""

    images: PromptImages
    runs: np.ndarray
    salts: dict[int, bytes]
    inputs: dict[str, mx.array] | None = field(default=None, repr=False)
    # Set by encode(): whether an image's tokens see each other both ways (the model gave
    # ``blocks``: Gemma 3), and the row's M-RoPE ``delta`` (the model gave ``positions``:
    # Qwen-VL; a later token's position is its index + delta, 0 for the others).
    both_ways: bool = False
    delta: int = 0
    encoded: bool = False

    @classmethod
    def make(cls, ids: list[int], images: PromptImages, block_size: int) -> RowImages:
        """The request's images over ``ids``, every placeholder token there (a prompt cut
        inside an image is refused: PromptTooLongError, as ``image_inputs`` refuses it)."""
        token = images.processor.image_token_id
        per_image = images.processed.tokens_per_image
        is_image = np.asarray(ids, np.int64) == token
        if int(is_image.sum()) != sum(per_image):
            raise PromptTooLongError(
                f"prompt: {int(is_image.sum())} image tokens for {images.count} image(s) of "
                f"{sum(per_image)} in all (a prompt with images cannot be truncated)"
            )
        starts = is_image & ~np.concatenate([[False], is_image[:-1]])
        runs = np.where(is_image, np.cumsum(starts) - 1, -1).astype(np.int32)
        return cls(images, runs, block_salts(is_image, images, block_size))

    def cut(self, n_blocks: int, block_size: int) -> int:
        """The most of ``n_blocks`` shared leading blocks after which prefill may start: never
        inside an image (its first tokens would be read without the rest of it)."""
        while n_blocks and self.inside(n_blocks * block_size):
            n_blocks -= 1
        return n_blocks

    def inside(self, position: int) -> bool:
        """Whether ``position`` is inside an image's run (not its first token)."""
        runs = self.runs
        return (
            0 < position < len(runs)
            and runs[position] >= 0
            and runs[position - 1] == runs[position]
        )

    def chunk_end(self, end: int) -> int:
        """``end`` of a prefill chunk moved past the image run it would cut."""
        while self.inside(end):
            end += 1
        return end

    def encode(self, model, ids: list[int], cache: EncoderCache | None) -> None:
        """The tower's features merged into the prompt's embeddings (``inputs``), on the
        engine's thread: the images the encoder cache holds are not encoded again."""
        if not self.encoded:
            features = cache.features(model, self.images) if cache is not None else None
            if features is None:
                self.inputs = image_inputs(model, ids, self.images)
            else:
                self.inputs = model.image_inputs(ids, features)
            unknown = set(self.inputs) - set(PER_POSITION)
            if unknown:
                raise ValueError(
                    f"images: the batching engine feeds {', '.join(PER_POSITION)}, found "
                    f"{', '.join(sorted(unknown))} too"
                )
            self.both_ways = "blocks" in self.inputs
            if "positions" in self.inputs:  # (1, L, 3): the last token's, less its index
                last = self.inputs["positions"][0, -1]
                self.delta = int(last.max().item()) + 1 - len(ids)
            mx.eval(list(self.inputs.values()))
            self.encoded = True

    def chunk(self, start: int, end: int) -> tuple[dict[str, mx.array], np.ndarray | None]:
        """The chunk's inputs (``embeds`` (1, end - start, hidden), Qwen-VL's ``positions``
        and ``deepstack``: each per-position input's slice) and, for a model whose image
        tokens see each other both ways, its image runs (end - start,), else None."""
        assert self.inputs is not None, "encode() first"
        extra = {k: _chunk(v, start, end) for k, v in self.inputs.items() if k != "blocks"}
        return extra, self.runs[start:end] if self.both_ways else None

    def done(self) -> None:
        """The prompt is in: its embeddings go."""
        self.inputs = None


def block_salts(is_image: np.ndarray, images: PromptImages, block_size: int) -> dict[int, bytes]:
    """Each block holding image tokens -> its salt: per image with tokens there, in order, its
    SHA-256, the processor's variant and the ordinal (within the image) of its first token in
    the block."""
    variant = getattr(images.processor, "variant", "")
    owner = np.repeat(np.arange(images.count), images.processed.tokens_per_image)  # per token
    positions = np.flatnonzero(is_image)
    salts: dict[int, list[str]] = {}
    seen: set[tuple[int, int]] = set()
    for ordinal_all, position in enumerate(positions):
        block, image = int(position) // block_size, int(owner[ordinal_all])
        if (block, image) in seen:
            continue
        seen.add((block, image))
        first = ordinal_all - int(np.searchsorted(owner, image))  # its ordinal within the image
        salts.setdefault(block, []).append(f"{images.sha256[image]}/{variant}/{first};")
    return {block: "".join(parts).encode() for block, parts in salts.items()}


class EncoderCache:
    """Image features by (SHA-256, processor variant), one entry per image, least recently used
    out past ``max_bytes``: an image seen in an earlier request skips the tower, whatever the
    others beside it. The engine's thread alone uses it. ``calls``: the tower's calls;
    ``hits``: images served from the cache; ``encoded``: images the tower saw."""

    def __init__(self, max_bytes: int = DEFAULT_ENCODER_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.nbytes = self.calls = self.hits = self.encoded = 0

    def __len__(self) -> int:
        return len(self._items)

    def features(self, model, images: PromptImages) -> Any:
        """The features of ``images`` as ``model.image_inputs`` takes them, the ones the cache
        misses from one tower call over them together."""
        processed = images.processed
        variant = getattr(images.processor, "variant", "")
        keys = [(sha, variant) for sha in images.sha256]
        first = {k: i for i, k in reversed(list(enumerate(keys)))}  # an image twice: once
        missing = [i for k, i in first.items() if k not in self._items]
        fresh: dict[tuple[str, str], Any] = {}
        if missing:
            self.calls += 1
            self.encoded += len(missing)
            subset = processed.select(missing)
            parts = split_features(model, encode_images(model, subset), subset.tokens_per_image)
            fresh = {keys[i]: _copy(part) for i, part in zip(missing, parts)}
            mx.eval(_arrays(list(fresh.values())))
        self.hits += images.count - len(missing)
        out = [fresh[k] if k in fresh else self._touch(k) for k in keys]
        for k, f in fresh.items():
            self._put(k, f)
        return join_features(model, out)

    def _touch(self, key: tuple[str, str]) -> mx.array:
        self._items.move_to_end(key)
        return self._items[key]

    def _put(self, key: tuple[str, str], features: Any) -> None:
        size = _nbytes(features)
        if key in self._items or size > self.max_bytes:
            return
        while self._items and self.nbytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= _nbytes(old)
        self._items[key] = features
        self.nbytes += size


def split_features(model, features: Any, sizes: list[int]) -> list[Any]:
    """One tower call's ``features`` as each image's (``sizes``: the tokens each takes): the
    model's ``split_image_features`` where it has one, else rows of the features taken as
    (sum sizes, hidden) ((N, T, hidden) flattened)."""
    split = getattr(model, "split_image_features", None)
    if split is not None:
        return split(features, sizes)
    rows = features.reshape(-1, features.shape[-1])
    if rows.shape[0] != sum(sizes):
        raise ValueError(
            f"image features: {rows.shape[0]} rows for images of {sizes} tokens (expected "
            f"{sum(sizes)})"
        )
    ends = np.cumsum(sizes).tolist()
    return [rows[end - size : end] for size, end in zip(sizes, ends)]


def join_features(model, parts: list[Any]) -> Any:
    """Each image's features (:func:`split_features`) as one call's, image after image."""
    join = getattr(model, "join_image_features", None)
    return join(parts) if join is not None else mx.concatenate(parts)


def _copy(tree: Any) -> Any:
    """``tree`` (arrays in dicts and lists) with each mx.array copied out of its call's buffer
    (a slice would keep all of it alive)."""
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(v) for v in tree)
    return mx.array(tree) if isinstance(tree, mx.array) else tree


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [tree]


def _arrays(tree: Any) -> list[mx.array]:
    return [v for v in _leaves(tree) if isinstance(v, mx.array)]


def _nbytes(tree: Any) -> int:
    return sum(int(v.nbytes) for v in _leaves(tree) if isinstance(v, (mx.array, np.ndarray)))
