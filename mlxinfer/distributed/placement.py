"""Which rank holds what: contiguous layer ranges for the pipeline, head slices for tensor
parallelism, and the weight names each rank reads.

Nothing here knows a family: a model is ``models.base.CausalLM`` (``inner_name``,
``layers_name``, ``embed_name``, an optional ``lm_head``), and the weights of block ``i`` are
those named ``{inner}.{layers}.{i}.…``.
"""

from __future__ import annotations

import re

from mlx.utils import tree_flatten

from ..errors import DistributedError


def layer_ranges(n_layers: int, size: int, shares: list[int] | None = None) -> list[range]:
    """``n_layers`` blocks in ``size`` contiguous ranges, every block in exactly one, each rank
    at least one. Without ``shares`` the first ``n_layers % size`` ranks take one block more
    (8 over 3: 3, 3, 2); with them (each rank's memory, say) the blocks go in proportion to
    them, the blocks left by rounding down to the largest remainders, the first rank first
    on a tie (30 over 64 GB and 128 GB: 10, 20)."""
    if n_layers < size:
        raise DistributedError(
            f"pipeline: {n_layers} layer(s) cannot be split over {size} ranks (each rank needs "
            "at least one)"
        )
    if shares is None:
        shares = [1] * size
    if len(shares) != size or min(shares) <= 0:
        raise DistributedError(f"pipeline: expected {size} positive shares, found {shares}")
    # Each rank's first block is its own; the rest go in proportion to the shares.
    spare, total = n_layers - size, sum(shares)
    exact = [spare * w / total for w in shares]
    counts = [1 + int(e) for e in exact]
    order = sorted(range(size), key=lambda r: (-(exact[r] - int(exact[r])), r))
    for r in order[: n_layers - sum(counts)]:
        counts[r] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


class WeightNames:
    """Sorts a checkpoint's weight names by the part of the model they belong to."""

    def __init__(self, model):
        prefix = f"{model.inner_name}.{model.layers_name}."
        self.layer = re.compile(rf"^{re.escape(prefix)}(\d+)\.(.*)$")
        self.prefix = prefix
        self.embedding = f"{model.inner_name}.{model.embed_name}."

    def layer_of(self, key: str) -> int | None:
        m = self.layer.match(key)
        return int(m.group(1)) if m else None

    def renumber(self, key: str, layers: range) -> str | None:
        """``key`` (a weight or module path) with its block renumbered within ``layers``; None
        for a block outside them; other keys as they are."""
        m = self.layer.match(key + ".") if not key.endswith(".") else self.layer.match(key)
        if m is None:
            return key
        i = int(m.group(1))
        if i not in layers:
            return None
        return f"{self.prefix}{i - layers.start}.{m.group(2)}".rstrip(".")

    def for_pipeline(self, weights: dict, layers: range, *, embedding: bool, head: bool) -> dict:
        """The weights a pipeline rank holding ``layers`` reads, its blocks renumbered from 0:
        the embedding and LM head only where asked for, every other non-block weight (norms:
        small) everywhere. Arrays left out are never evaluated, so never read from disk."""
        out = {}
        for key, value in weights.items():
            if self.layer_of(key) is not None:
                if (local := self.renumber(key, layers)) is not None:
                    out[local] = value
            elif key.startswith(self.embedding):
                if embedding:
                    out[key] = value
            elif key.startswith("lm_head."):
                if head:
                    out[key] = value
            else:
                out[key] = value
        return out


def tensor_split_reason(model, size: int) -> str | None:
    """Why ``model`` cannot run with its heads split over ``size`` ranks (None: it can).

    Each block must hold one token mixer: a grouped-query attention (``RopeAttention``:
    separate or fused q/k/v, with or without sinks or an output gate), multi-head latent
    attention (DeepSeek V2/V3: split by heads, the latent path whole) or a recurrent layer
    (``recurrent.RECURRENT``: LFM2's short convolution, by channels; Gated DeltaNet, by key
    heads), and one gated MLP (gate and up separate or fused) or mixture of experts
    (``experts.is_moe``), with the attention heads, the KV heads, the conv channels or key
    heads and the MLP's (each expert's, each shared expert's) hidden size divisible by
    ``size``; its other parts may only be norms (vectors).
    """
    from ..models.layers.attention import RopeAttention
    from ..models.layers.mla import MultiHeadLatentAttention
    from ..models.layers.mlp import GatedMLP
    from .experts import is_fused_gated_mlp, is_moe, moe_split_reason
    from .recurrent import RECURRENT, recurrent_split_reason

    mixers = (RopeAttention, MultiHeadLatentAttention, *RECURRENT)
    for i, layer in enumerate(model.layers):
        children = layer.children().values()
        attn = [m for m in children if isinstance(m, mixers)]
        mlp = [m for m in children if type(m) is GatedMLP or is_fused_gated_mlp(m) or is_moe(m)]
        if len(attn) != 1 or len(mlp) != 1:
            return (
                f"layer {i} is not one attention (or recurrent layer) and one gated MLP or "
                "mixture of experts"
            )
        a, m = attn[0], mlp[0]
        if isinstance(a, RECURRENT):
            if reason := recurrent_split_reason(a, size):
                return reason
            sizes = []
        elif isinstance(a, MultiHeadLatentAttention):  # one latent for all heads: no KV heads
            sizes = [("attention heads", a.n_heads)]
        else:  # an output gate: each head's q_proj rows are [queries | gate], cut with it
            sizes = [("attention heads", a.n_heads), ("KV heads", a.n_kv_heads)]
        if type(m) is GatedMLP:
            sizes.append(("MLP hidden size", m.gate_proj.weight.shape[0]))
        elif is_fused_gated_mlp(m):
            sizes.append(("MLP hidden size", m.gate_up_proj.weight.shape[0] // 2))
        for name, count in sizes:
            if count % size:
                return f"{count} {name} do not divide over {size} ranks"
        if is_moe(m) and (reason := moe_split_reason(m, size)):
            return reason
        for name, child in layer.children().items():
            if child is a or child is m:
                continue
            params = child.parameters() if hasattr(child, "parameters") else {}
            if any(v.ndim > 1 for _, v in tree_flatten(params)):
                return f"layer {i}'s '{name}' is neither attention, MLP nor a norm"
    return None


def quantized_split_reason(model, record: dict, size: int) -> str | None:
    """Why ``model``'s quantized layers (as ``record``, the config's quantization) cannot be
    split over ``size`` ranks (None: they can). Rows of a quantized layer split as a float
    layer's (MLA's per-head ``k_b_proj``/``v_b_proj`` by heads); columns (``o_proj``, MLA's
    too, a recurrent layer's ``out_proj``, ``down_proj``) only at a group boundary: each rank's
    share of the inputs must be a whole number of groups; each expert's too."""
    from ..models.layers.attention import RopeAttention
    from ..models.layers.mla import MultiHeadLatentAttention
    from ..models.layers.mlp import GatedMLP
    from .experts import is_fused_gated_mlp, is_moe
    from .recurrent import RECURRENT

    paths = {id(m): path for path, m in model.named_modules()}
    default = record.get("group_size", 64)
    for i, layer in enumerate(model.layers):
        finals = []  # the layers whose inputs are cut: the mixer's output, MLPs' down projections
        for child in layer.children().values():
            if isinstance(child, (RopeAttention, MultiHeadLatentAttention)):
                finals.append(child.o_proj)
            elif isinstance(child, RECURRENT):  # short conv, Gated DeltaNet
                finals.append(child.out_proj)
            elif type(child) is GatedMLP or is_fused_gated_mlp(child):
                finals.append(child.down_proj)
            elif is_moe(child):  # each routed expert's down projection, each shared one's
                finals += [m.down_proj for m in child.children().values() if "down_proj" in m]
        for final in finals:
            entry = record.get(paths.get(id(final), ""))
            group = entry.get("group_size", default) if isinstance(entry, dict) else default
            inputs = final.weight.shape[-1]
            if inputs % size or (inputs // size) % group:
                return (
                    f"layer {i}'s {paths.get(id(final), 'output projection')}: {inputs} quantized "
                    f"inputs in groups of {group} do not split into whole groups over {size} ranks"
                )
    return None
