"""RMS norms: the plain one and Gemma's ``(1 + w)`` form, both through one ``normalize`` step.

``normalize`` is ``mx.fast.rms_norm``, one Metal kernel. A backend without that
kernel swaps in a subclass that overrides ``normalize`` (``mlxinfer/backends/cpu``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and names): ``x / rms(x) * w``, statistics in float32."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.normalize(x, self["weight"])

    def normalize(self, x: mx.array, weight: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's ``x / rms(x) * (1 + w)``, computed in float32 and cast back, as transformers does.

    (1 + w) is formed in float32: in bfloat16 it would round w to steps of 1/128.
    The weight is stored as the offset from 1, so it starts at zero.
    """

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__(dims, eps)
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return self.normalize(x, 1.0 + self.weight.astype(mx.float32)).astype(x.dtype)
