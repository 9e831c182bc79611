"""Tensor parallelism: every rank runs every block on its share of the heads and hidden units.

Megatron's split, applied to a loaded model from the outside: rank r keeps query heads
``[r·n/s, (r+1)·n/s)`` (rows of ``q_proj``, and the matching KV heads' rows of ``k_proj`` and
``v_proj``: grouped-query attention keeps its grouping, since n/s and n_kv/s are whole) and
the same columns of ``o_proj``; an output gate (Qwen3-Next's) comes from each head's own
``q_proj`` rows, ``[queries | gate]``, so it goes with its head. In multi-head latent
attention (DeepSeek V2/V3, :func:`split_mla`) the same heads' rows of its query and per-head
key and value projections and columns of its ``o_proj``, the latent path whole. In a
recurrent layer (``recurrent.py``: LFM2's short convolution, Gated DeltaNet) its share of the
channels or key heads, each rank's state cache holding that share's state only. And its share
of the feed-forward's hidden units (``experts.py``): of the gated MLP (rows of
``gate_proj``/``up_proj``, columns of ``down_proj``), or in a mixture of experts, of every
routed and shared expert, the router whole on every rank. A fused projection (Phi-3's
``qkv_proj``, ``gate_up_proj``) is cut part by part (``experts.split_fused_rows``). The
attention (or recurrent) output and the MLP or MoE output are then partial sums;
:class:`Summed` adds them over the ranks (``all_sum``) before the residual. A bias of
``o_proj``, ``out_proj`` or a down projection stays on rank 0 only, so it is added once. Where
the sizes do not divide (``placement.tensor_split_reason``) the model runs as a pipeline
instead, with one line saying why.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache
from ..generation.drafts import first_blocks
from ..models.layers.attention import RopeAttention
from ..models.layers.mla import MultiHeadLatentAttention
from ..models.layers.mlp import GatedMLP
from .experts import (
    is_fused_gated_mlp,
    is_moe,
    rows,
    split_fused_rows,
    split_gated_mlp,
    split_linears,
    split_moe,
)
from .group import Ranks
from .pipeline import SYNC_ROWS, RankModel, kv_nbytes
from .recurrent import RECURRENT, split_recurrent


def shard(model: nn.Module, ranks: Ranks) -> list[tuple[nn.Module, str]]:
    """Cut every block's attention (or recurrent layer) and MLP or MoE weights (loaded) to this
    rank's share; returns the (block, child name) pairs whose outputs must be summed over the ranks."""
    r, s = ranks.rank, ranks.size
    summed = []
    for block in model.layers:
        for name, child in block.children().items():
            if isinstance(child, RopeAttention):
                if child.fused_qkv:  # rows: [q heads | k heads | v heads]
                    q_rows, kv_rows = (
                        n * child.head_dim for n in (child.n_heads, child.n_kv_heads)
                    )
                    split_fused_rows(child.qkv_proj, [q_rows, kv_rows, kv_rows], r, s)
                    split_linears([], child.o_proj, r, s)
                else:
                    q, k, v = child.q_proj, child.k_proj, child.v_proj
                    split_linears([q, k, v], child.o_proj, r, s)
                if "sinks" in child:  # one per query head (gpt-oss)
                    child.sinks = rows(child.sinks, r, s)
                child.n_heads //= s
                child.n_kv_heads //= s
            elif isinstance(child, MultiHeadLatentAttention):
                split_mla(child, r, s)
            elif isinstance(child, RECURRENT):
                split_recurrent(child, r, s)
            elif type(child) is GatedMLP or is_fused_gated_mlp(child):
                split_gated_mlp(child, r, s)
            elif is_moe(child):
                split_moe(child, r, s)
            else:
                continue
            summed.append((block, name))
    return summed


def split_mla(attn: MultiHeadLatentAttention, r: int, s: int) -> None:
    """Rank r's heads ``[r·n/s, (r+1)·n/s)`` of multi-head latent attention: rows of the query's
    last projection (``q_proj`` or ``q_b_proj``: head h's ``qk_head_dim`` rows are rows
    ``[h·qk_head_dim, (h+1)·qk_head_dim)``), the first axis of ``k_b_proj`` and ``v_b_proj``
    ((n_heads, out, in), float or quantized), the matching columns of ``o_proj`` (head h's
    ``v_head_dim`` inputs). The latent path (``q_a_proj``, ``q_a_layernorm``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``) stays whole on every rank: every rank computes
    and caches the same latent (the latent KV cache is replicated, not split), and each head
    reads all of it, so ``o_proj``'s partial sums over the ranks' heads make the output."""
    q = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    # ``rows`` cuts axis 0: a Linear's output rows, a PerHeadLinear's heads (its packed weight,
    # scales and biases alike when quantized).
    split_linears([q, attn.k_b_proj, attn.v_b_proj], attn.o_proj, r, s)
    attn.n_heads //= s


class Summed(nn.Module):
    """A block's attention, MLP or mixture of experts whose partial outputs are added over the
    ranks."""

    def __init__(self, part: nn.Module, ranks: Ranks):
        super().__init__()
        self.part = part
        self._group = ranks.group

    def __call__(self, *args, **kwargs) -> mx.array:
        return mx.distributed.all_sum(self.part(*args, **kwargs), group=self._group)


def sum_outputs(summed: list[tuple[nn.Module, str]], ranks: Ranks) -> None:
    """Put :class:`Summed` around each part (after the backend has swapped its layers in)."""
    for block, name in summed:
        block[name] = Summed(block[name], ranks)


class TensorModel(RankModel):
    """The model of one tensor-parallel rank, called as the whole model is. Every rank holds
    the embedding and the head, so every rank computes the same logits."""

    def __init__(self, model: nn.Module, ranks: Ranks):
        super().__init__(model, ranks)
        self.embedding = model.embedding

    @property
    def part(self) -> str:
        """This rank's part of the model (the disk prefix tier's files are per part)."""
        return f"tensor rank {self.ranks.rank}/{self.ranks.size}"

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        self.steps += 1
        self.ranks.steps += 1
        step = f"tensor step {self.steps}"
        self.ranks.check_same(inputs, step)
        logits = self.model(inputs, cache)
        states = [c.state for c in cache] if cache is not None else []
        if cache is not None:
            self.ranks.kv_bytes = max(self.ranks.kv_bytes, kv_nbytes(cache))
        # One evaluation per step, the collectives inside it; a long chunk's logits (a
        # prefill's) are left lazy: nobody reads them.
        todo = [logits, *states] if inputs.shape[1] <= SYNC_ROWS else states
        self.ranks.run(step, todo, kind="computing")
        return logits

    def first_blocks(self, n: int) -> DraftView:
        """A self-draft's view (``SelfDraft``): the rank's first ``n`` blocks (their outputs
        summed over the ranks), the final norm and the head, each step evaluated at once."""
        return DraftView(first_blocks(self.model, n), self.ranks, n)


class DraftView:
    """The first blocks of a tensor rank's model, called as the model is. Their all-sums make
    each call a collective: every rank drafts the same number of tokens from the same ones
    (the logits, and so the tokens drawn with the shared seed, are equal on every rank; the
    verification's token check compares the drafts). Each call is one evaluation under the
    watchdog, as a step of :class:`TensorModel` is, so a dead or stalled peer ends the draft."""

    def __init__(self, view: nn.Module, ranks: Ranks, n: int):
        self.view, self.ranks, self.n = view, ranks, n
        self.steps = 0

    def __call__(self, inputs: mx.array, cache: list[Cache]) -> mx.array:
        self.steps += 1
        logits = self.view(inputs, cache)  # (B, L, V); only the first n caches are written
        states = [c.state for c in cache[: self.n]]
        step = f"tensor draft step {self.steps} (the first {self.n} blocks)"
        self.ranks.run(step, [logits, *states], kind="computing")
        return logits
