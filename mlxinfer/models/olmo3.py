"""OLMo 3 (AllenAI): OLMo 2's block with sliding-window attention on most layers.

Differences from olmo2.py, all in the arguments:

- ``layer_types`` says which layers slide (default: three of every four, each fourth full);
  sliding layers keep a rotating cache of ``sliding_window`` tokens, and each kind of layer
  gets its own mask;
- RoPE per layer kind: transformers 5 writes ``rope_parameters`` per kind (config.py keeps
  them as ``rope_parameters_by_layer_type``); an older config's ``rope_theta`` serves both
  kinds and its ``rope_scaling`` (YaRN on the long-context models) the full layers only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import olmo2, qwen2
from .base import FULL_ATTENTION, SLIDING_ATTENTION, check_layer_types, layer_type_rope
from .layers import make_rope


@dataclasses.dataclass
class ModelArgs(olmo2.ModelArgs):
    rope_theta: float = 500000.0
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    rope_parameters_by_layer_type: dict[str, Any] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = [
                FULL_ATTENTION if (i + 1) % 4 == 0 else SLIDING_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.sliding_window is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        if SLIDING_ATTENTION not in self.layer_types:
            self.sliding_window = None

    def rope_parameters(self, kind: str) -> tuple[float, dict[str, Any] | None]:
        """(base, rope_scaling) for the layers of one kind; scaling never on sliding layers."""
        default = (self.rope_theta, None if kind == SLIDING_ATTENTION else self.rope_scaling)
        return layer_type_rope(self.rope_parameters_by_layer_type, kind, default)


class TransformerBlock(olmo2.TransformerBlock):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args)
        assert args.layer_types is not None  # derived by ModelArgs.__post_init__
        base, scaling = args.rope_parameters(args.layer_types[layer])
        self.self_attn.rope = make_rope(args.head_dim, base, scaling, args.max_position_embeddings)


class Olmo3Model(qwen2.Qwen2Model):
    """Embedding → blocks (each on its layer type's mask) → norm."""

    Block = TransformerBlock


class Model(qwen2.Model):
    """Llama's LM shell; caches follow each layer's type (sliding or full)."""

    Inner = Olmo3Model
