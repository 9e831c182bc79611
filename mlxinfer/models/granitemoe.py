"""Granite MoE (IBM's granite-3.x-*-a*m MoE models): Granite's multipliers with Mixtral's MoE.

Block: Granite's (embeddings × ``embedding_multiplier``, attention scores × ``attention_multiplier``,
sublayer outputs × ``residual_multiplier``, logits ÷ ``logits_scaling``; granite.py) with a routed
mixture of ``num_local_experts`` SwiGLU experts of ``intermediate_size`` in place of the MLP.
The router keeps the top ``num_experts_per_tok`` logits and softmaxes them, which is Mixtral's
softmax-then-renormalise (mixtral.SparseMoE).

Checkpoints keep the experts already stacked, under other names: ``block_sparse_moe.input_linear``
(E, 2I, H: gate rows then up rows), ``block_sparse_moe.output_linear`` (E, H, I) and
``block_sparse_moe.router.layer`` (E, H). ``sanitize`` renames them to Mixtral's fused layout
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, ``mlp.gate``); transformers 5's
in-memory names (``block_sparse_moe.experts.*``, ``block_sparse_moe.router``) map the same way.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from . import granite, mixtral
from .layers.moe import keep_routers_float, stack_experts

RENAMES = (
    (".block_sparse_moe.input_linear.", ".mlp.experts.gate_up_proj."),
    (".block_sparse_moe.output_linear.", ".mlp.experts.down_proj."),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
    (".block_sparse_moe.router.", ".mlp.gate."),
    (".block_sparse_moe.", ".mlp."),
)


@dataclasses.dataclass
class ModelArgs(granite.ModelArgs):
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    hidden_act: str = "silu"


class TransformerBlock(granite.TransformerBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        # ignore: granitemoe's ModelArgs (a Granite one) has every field mixtral's SparseMoE reads
        self.mlp = mixtral.SparseMoE(args)  # type: ignore[arg-type]


class GraniteMoeModel(granite.GraniteModel):
    Block = TransformerBlock


class Model(granite.Model):
    Inner = GraniteMoeModel

    quant_predicate = staticmethod(keep_routers_float)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
        def rename(key: str) -> str:
            for old, new in RENAMES:
                if old in key:
                    return key.replace(old, new)
            return key

        weights = {rename(k): v for k, v in weights.items()}
        return stack_experts(granite.Model.sanitize(weights, args), {})
