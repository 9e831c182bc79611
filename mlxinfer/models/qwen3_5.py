"""Qwen3.5 (``qwen3_5_text``, and ``qwen3_5_moe_text`` with experts): Qwen3-Next's hybrid.

The same blocks as qwen3_next.py (Gated DeltaNet and gated attention layers, ``(1 + w)``
norms), with the Gated DeltaNet's inputs from four separate projections (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and, in ``qwen3_5_text``, a dense SwiGLU in every
block. The Hub publishes Qwen3.5 as image-text checkpoints (``qwen3_5``, ``qwen3_5_moe``):
they run with their tower in qwen3_5_vl.py, over this network; without the tower's weights,
as this network alone (config.py lifts ``text_config``). RoPE: Qwen3.5's multimodal RoPE gives
a text token the same position on its three axes, which is the plain (partial) RoPE used here.
"""

from __future__ import annotations

import dataclasses

from . import qwen3_next


@dataclasses.dataclass
class ModelArgs(qwen3_next.ModelArgs):
    # dense qwen3_5_text configs name no experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    separate_projections: bool = True

    @classmethod
    def from_dict(cls, config):
        # Qwen3.5-MoE's configs name no dense intermediate_size: every block has experts, and
        # the size is only read by a dense block, which such a config never builds.
        if config.get("num_experts") and config.get("intermediate_size") is None:
            config = {**config, "intermediate_size": config.get("moe_intermediate_size")}
        return super().from_dict(config)


class Model(qwen3_next.Model):
    pass
