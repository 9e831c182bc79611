"""Multimodal RoPE (M-RoPE, Qwen2-VL and after): three positions per token, (t, h, w).

A text token's three positions are equal, so on text M-RoPE is plain RoPE at that position
(``mx.fast.rope`` with an offset). An image token gets its grid cell: t = the image's start,
h = start + row, w = start + column (rows and columns of merged patches); the text after an
image goes on from start + max(rows, cols), so positions run ahead of the token index by a
``delta`` that holds for every later token: decoding at cache offset o is position o + delta.

``mrope_section`` splits the head's ``head_dim / 2`` frequencies among t, h and w:

- chunked (Qwen2-VL, Qwen2.5-VL): the first ``section[0]`` frequencies follow t, the next
  ``section[1]`` h, the last ``section[2]`` w;
- interleaved (Qwen3-VL, Qwen3.5: ``mrope_interleaved``): frequency i follows h where
  i % 3 == 1 and i < 3 * section[1], w where i % 3 == 2 and i < 3 * section[2], t elsewhere.

The rotation itself is the non-traditional one (the halves of the head rotate together), as
transformers' ``apply_rotary_pos_emb`` with cos/sin repeated over both halves.

The positions of a request are data (``positions`` below, from the ids and the images'
grids; ``delta`` kept with the request's cache), never state on a module: one model serves
many requests, each with its own images.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ...errors import ConfigError


def frequency_axes(
    section: Sequence[int], half: int, *, interleaved: bool, source: str = "config.json"
) -> np.ndarray:
    """(half,) which position (0 = t, 1 = h, 2 = w) each of the ``half`` frequencies follows."""
    section = [int(s) for s in section]
    if len(section) != 3 or any(s < 0 for s in section):
        raise ConfigError(
            f"{source}: 'mrope_section' must list 3 counts >= 0, found {list(section)!r}"
        )
    if interleaved:
        axes = np.zeros(half, dtype=np.int32)
        for axis in (1, 2):
            axes[axis : min(3 * section[axis], half) : 3] = axis
        return axes
    if sum(section) != half:
        raise ConfigError(
            f"{source}: 'mrope_section' {section} must add up to head_dim / 2 = {half}, "
            f"found {sum(section)}"
        )
    return np.repeat(np.arange(3, dtype=np.int32), section)


def rotation_table(
    positions: mx.array, inv_freq: mx.array, axes: mx.array
) -> tuple[mx.array, mx.array]:
    """(cos, sin), each (B, 1, L, head_dim), for ``positions`` (B, L, 3): frequency i turns
    by ``positions[..., axes[i]] * inv_freq[i]``; float32."""
    chosen = mx.take(positions.astype(mx.float32), axes, axis=-1)  # (B, L, half)
    angles = chosen * inv_freq
    angles = mx.concatenate([angles, angles], axis=-1)[:, None]  # (B, 1, L, head_dim)
    return mx.cos(angles), mx.sin(angles)


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """``x * cos + rotate_half(x) * sin`` in float32, back in x's dtype; (B, n, L, head_dim)."""
    y = x.astype(mx.float32)
    half = y.shape[-1] // 2
    turned = mx.concatenate([-y[..., half:], y[..., :half]], axis=-1)
    return (y * cos + turned * sin).astype(x.dtype)


def image_positions(
    ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]], merge: int
) -> tuple[np.ndarray, int]:
    """(positions (L, 3), delta) of a prompt, as transformers' ``get_rope_index`` (Qwen2.5-VL,
    Qwen3-VL) gives them for one row of images: each run of ``image_token_id`` is the next
    image of ``grids`` ((t, h, w) patches, ``merge`` x ``merge`` patches per token); text
    goes on one by one after the largest position so far + 1. ``delta`` = max + 1 - L: the
    position of token index j after the last image is j + delta."""
    tokens = np.asarray(ids, dtype=np.int64)
    is_image = tokens == image_token_id
    out = np.zeros((len(tokens), 3), dtype=np.int64)
    images = iter(grids)
    start, i = 0, 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            out[i:j] = (start + np.arange(j - i))[:, None]
            start += j - i
        else:
            grid = next(images, None)
            if grid is None:
                raise ValueError(f"prompt: more runs of image tokens than the {len(grids)} grids")
            t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
            if t * h * w != j - i:
                raise ValueError(
                    f"prompt: a run of {j - i} image tokens for a grid of {t}x{h}x{w} merged "
                    "patches (expected the same count)"
                )
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            out[i:j] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()], axis=-1) + start
            start += max(h, w)
        i = j
    delta = int(out.max()) + 1 - len(tokens) if len(tokens) else 0
    return out, delta
