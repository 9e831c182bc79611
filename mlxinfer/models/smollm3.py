"""SmolLM3: Llama's network with RoPE left out of every few layers ("NoPE" layers).

``no_rope_layers[i]`` is 1 where layer i rotates its queries and keys and 0 where it does
not; without the list, every ``no_rope_layer_interval``-th layer (the 4th, 8th, ...) has no
RoPE, as transformers derives it. The head is tied by default. The optional sliding window
on the NoPE layers (``use_sliding_window``) is not supported: a ConfigError says so.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from . import llama


@dataclasses.dataclass
class ModelArgs(llama.ModelArgs):
    tie_word_embeddings: bool = True
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.use_sliding_window:
            raise ConfigError(
                "config.json: smollm3 with use_sliding_window is not supported (NoPE layers "
                "with a sliding window)"
            )
        self.sliding_window = None
        n = self.num_hidden_layers
        if self.no_rope_layers is None:
            k = self.no_rope_layer_interval
            self.no_rope_layers = [int((i + 1) % k != 0) for i in range(n)]
        if len(self.no_rope_layers) != n:
            raise ConfigError(
                f"config.json: 'no_rope_layers' must have {n} entries (one per layer), "
                f"found {len(self.no_rope_layers)}"
            )


class NoRoPE(nn.Module):
    """A layer's positions left out: queries and keys as they are."""

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return x


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        assert args.no_rope_layers is not None  # derived by ModelArgs.__post_init__
        for layer, rotates in zip(self.layers, args.no_rope_layers):
            if not rotates:
                layer.self_attn.rope = NoRoPE()
