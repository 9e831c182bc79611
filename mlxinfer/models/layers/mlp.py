"""Feed-forward layers: HF's activation names and the gated MLP (SwiGLU, GeGLU)."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ...errors import ConfigError

# HF activation names (``hidden_act`` / ``hidden_activation`` / ``activation_function``).
# The "new"/"tanh"/"fast" GELUs are one formula: 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))).
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": nn.silu,
    "swish": nn.silu,
    "relu": nn.relu,
    "gelu": nn.gelu,  # exact (erf)
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
    "quick_gelu": lambda x: x * mx.sigmoid(1.702 * x),  # CLIP's: x·σ(1.702x)
}


def activation(name: str, source: str = "config.json") -> Callable[[mx.array], mx.array]:
    if name not in ACTIVATIONS:
        raise ConfigError(
            f"{source}: unsupported activation '{name}' (expected one of {', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with a GELU."""

    def __init__(
        self, dim: int, hidden: int, act: Callable[[mx.array], mx.array], bias: bool = False
    ):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.combine(self.gate_proj(x), self.up_proj(x)))

    def combine(self, gate: mx.array, up: mx.array) -> mx.array:
        """act(gate) * up."""
        return self.act(gate) * up
