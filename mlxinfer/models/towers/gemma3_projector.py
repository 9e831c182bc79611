"""Gemma 3's multimodal projector: a tower's patch states into the language model's soft tokens.

(N, P, vision hidden) -> (N, mm_tokens_per_image, text hidden):

- the P = s x s patch states, laid out on their s x s grid, are average-pooled in k x k
  windows (k = s / sqrt(mm_tokens_per_image); 64 x 64 -> 16 x 16 = 256 tokens for the
  released models), in row-major order;
- ``mm_soft_emb_norm``: Gemma's RMSNorm, ``x / rms(x) * (1 + w)`` (transformers' Gemma3RMSNorm,
  weights stored as the offset from 1), eps from the vision config;
- ``mm_input_projection_weight``: a bare (vision hidden, text hidden) matrix, multiplied on
  the right (not a Linear: the checkpoint stores it in that orientation).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ...errors import ConfigError
from ..layers import OffsetRMSNorm


class Gemma3MultiModalProjector(nn.Module):
    def __init__(
        self,
        vision_hidden: int,
        text_hidden: int,
        patches_per_side: int,
        tokens_per_image: int,
        eps: float = 1e-6,
    ):
        super().__init__()
        side = math.isqrt(tokens_per_image)
        if side * side != tokens_per_image or side == 0 or patches_per_side % side:
            raise ConfigError(
                f"config.json: 'mm_tokens_per_image' must be a square whose side divides the "
                f"{patches_per_side} patches per side, found {tokens_per_image}"
            )
        self.patches_per_side, self.tokens_per_side = patches_per_side, side
        self.mm_input_projection_weight = mx.zeros((vision_hidden, text_hidden))
        self.mm_soft_emb_norm = OffsetRMSNorm(vision_hidden, eps=eps)

    def __call__(self, states: mx.array) -> mx.array:
        N, P, D = states.shape
        s, t = self.patches_per_side, self.tokens_per_side
        k = s // t
        # Patch i sits at row i // s, column i % s; each k x k window averages to one token.
        x = states.reshape(N, t, k, t, k, D).mean(axis=(2, 4)).reshape(N, t * t, D)
        x = self.mm_soft_emb_norm(x)
        return (x @ self.mm_input_projection_weight).astype(states.dtype)  # (N, t*t, text hidden)
