"""Gemma 3 (text): the Gemma 2 network plus a per-head q/k norm and two RoPEs.

Differences from gemma2.py, all in the arguments:

- ``q_norm`` / ``k_norm``: Gemma's (1 + w) RMSNorm over each head, before RoPE;
- five local layers per global one by default (``layer_types``, else
  ``sliding_window_pattern``: layer i is global when (i + 1) % pattern == 0);
- local layers rotate with ``rope_local_base_freq`` (10k) and no scaling;
  global ones with ``rope_theta`` (1M) and ``rope_scaling`` (linear ×8 on the
  larger models). transformers 5 writes both as per-layer-type
  ``rope_parameters``, which config.py keeps as ``rope_parameters_by_layer_type``;
- no attention soft-capping (transformers ignores ``attn_logit_softcapping``
  here); final-logit soft-capping only when the config sets it.

Multimodal ``gemma3`` checkpoints (``language_model.*`` weights) are not read here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import FULL_ATTENTION, SLIDING_ATTENTION, layer_type_rope
from .gemma2 import Model  # noqa: F401  (the network is Gemma 2's)
from .gemma2 import ModelArgs as Gemma2Args


@dataclasses.dataclass
class ModelArgs(Gemma2Args):
    max_position_embeddings: int = 131072
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float = 10000.0
    sliding_window_pattern: int = 6
    rope_parameters_by_layer_type: dict[str, Any] | None = None

    def __post_init__(self):
        super().__post_init__()
        self.qk_norm = True
        # The config class declares attn_logit_softcapping, but transformers' Gemma 3
        # attention never applies it (released configs set it to null anyway).
        self.attn_logit_softcapping = None

    def default_layer_types(self) -> list[str]:
        pattern = self.sliding_window_pattern
        return [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
            for i in range(self.num_hidden_layers)
        ]

    def rope_parameters(self, kind: str) -> tuple[float, dict[str, Any] | None]:
        default: tuple[float, dict[str, Any] | None]
        if kind == SLIDING_ATTENTION:
            default = (self.rope_local_base_freq, None)
        else:
            default = (self.rope_theta, self.rope_scaling)
        return layer_type_rope(self.rope_parameters_by_layer_type, kind, default)
