"""Idefics3's tower (SmolVLM's too) and its connector.

The tower is SigLIP's (towers/siglip.py: patch convolution with bias, pre-norm layers,
``post_layernorm``) with positions for frames of any size: a frame of h x w patches reads the
position table (``image_size / patch`` per side, N) at bucketized fractional coordinates, row
``bucket(i / h)`` and column ``bucket(j / w)`` (transformers' ``Idefics3VisionEmbeddings``, in
float32 as it computes them); for a frame of the tower's own size that is the table in order.

The connector: ``pixel_shuffle`` folds each ``scale_factor`` x ``scale_factor`` block of patch
states into one (channels in transformers' order: the block's columns, then its rows), then
``modality_projection.proj`` (a Linear without bias) to the text width.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import siglip


@dataclasses.dataclass
class VisionArgs(siglip.VisionArgs):
    """Idefics3VisionConfig's defaults."""

    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    image_size: int = 224
    patch_size: int = 32


def position_ids(n_side: int, h: int, w: int) -> np.ndarray:
    """(h * w,) rows of the position table for a frame of h x w patches (all of them real)."""
    boundaries = np.arange(1 / n_side, 1.0, 1 / n_side).astype(np.float32)

    def buckets(n: int) -> np.ndarray:
        fractions = np.arange(n, dtype=np.float32) * (np.float32(1.0) / np.float32(n))
        return np.searchsorted(boundaries, np.minimum(fractions, np.float32(1 - 1e-6)), "right")

    return (buckets(h)[:, None] * n_side + buckets(w)[None, :]).reshape(-1)


class Embeddings(siglip.VisionEmbeddings):
    def __call__(self, pixels: mx.array) -> mx.array:
        N, C, H, W = pixels.shape
        p = self.patch_size
        h, w = H // p, W // p
        x = pixels.reshape(N, C, h, p, w, p).transpose(0, 2, 4, 3, 5, 1)  # (N, h, w, p, p, C)
        x = x.reshape(N, h * w, p * p * C)
        weight = self.patch_embedding.weight  # (hidden, p, p, C): OHWI
        x = x.astype(weight.dtype) @ weight.reshape(weight.shape[0], -1).T
        x = x + self.patch_embedding.bias  # (N, P, hidden)
        n_side = int(round(self.position_embedding.weight.shape[0] ** 0.5))
        ids = mx.array(position_ids(n_side, h, w))
        return x + self.position_embedding.weight[ids][None]


class Idefics3VisionTransformer(siglip.VisionTransformer):
    """SigLIP's transformer with :class:`Embeddings`: (N, C, M, M) frames -> (N, P, hidden).
    Its weights are the checkpoint's ``model.vision_model.*``."""

    def __init__(self, args: VisionArgs):
        super().__init__(args)
        self.embeddings = Embeddings(args)


class Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int):
        super().__init__()
        self.scale = scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(
            vision_hidden * scale_factor**2, text_hidden, bias=False
        )

    def __call__(self, states: mx.array) -> mx.array:
        B, P, D = states.shape
        s, side = self.scale, int(round(P**0.5))
        # transformers' pixel_shuffle, step by step: (B, h, w/s, D s) -> (B, w/s, h, D s)
        # -> (B, w/s, h/s, D s^2) -> (B, h/s, w/s, D s^2)
        x = states.reshape(B, side, side // s, D * s).transpose(0, 2, 1, 3)
        x = x.reshape(B, side // s, side // s, D * s * s).transpose(0, 2, 1, 3)
        x = x.reshape(B, P // (s * s), D * s * s)
        return self.modality_projection.proj(x)  # (B, P / s^2, text hidden)
