"""Tensor parallelism's recurrent side: LFM2's short convolution and Qwen3-Next's Gated DeltaNet.

Both are per channel (or per head) from their input projection to their output projection,
so they split as attention does: rank r keeps its share of the channels or heads, rows of the
input projections, the same channels of the depthwise convolution, columns of ``out_proj``
(its bias on rank 0 only), and the layer's output is a partial sum that ``tensor.Summed``
adds over the ranks.

- ``ShortConv`` (LFM2): ``in_proj`` gives b, c, x (``dim`` rows each), the conv runs over
  ``dim`` channels, one filter each. Rank r keeps channels ``[r·dim/s, (r+1)·dim/s)``: those
  rows of each of the three parts, those filters, those columns of ``out_proj``.
- ``GatedDeltaNet`` (Qwen3-Next, Qwen3.5): by key heads, each key head's ``n_v / n_k`` value
  heads with it. ``in_proj_qkvz`` and ``in_proj_ba`` are laid out per key head (HF's
  ``fix_query_key_value_ordering``: head h's rows are ``[q | k | v of its value heads | z of
  them]``, then ``[b | a]``), so a rank's key heads are one contiguous run of rows of each;
  Qwen3.5's separate ``in_proj_qkv`` is [all q | all k | all v], cut part by part. The conv
  runs over [q | k | v] channels (cut part by part too), ``A_log`` and ``dt_bias`` are per
  value head (value head j belongs to key head j // (n_v / n_k): contiguous), the gated norm
  acts per value head (whole), ``out_proj``'s columns are the value heads' outputs.

Each rank's ``StateCache`` then holds its own channels' or heads' state only (the conv's last
inputs, Gated DeltaNet's (n_v/s, Dk, Dv) state): the layers size their states from their own
arrays, never from the config.
"""

from __future__ import annotations

import mlx.nn as nn

from ..models.layers.gated_delta import GatedDeltaNet
from ..models.lfm2 import ShortConv
from .experts import rows, split_fused_rows, split_linears

RECURRENT = (ShortConv, GatedDeltaNet)


def split_depthwise(conv: nn.Conv1d, parts: list[int], r: int, s: int) -> None:
    """Rank r's channels of each of the ``parts`` (channel counts) of a depthwise conv (weight
    (C, K, 1), one filter per channel, an optional bias (C,))."""
    split_fused_rows(conv, parts, r, s)
    conv.groups //= s


def split_short_conv(conv: ShortConv, r: int, s: int) -> None:
    """Rank r's channels of LFM2's gated short convolution (see above)."""
    dim = conv.conv.weight.shape[0]  # the conv is never quantized
    split_fused_rows(conv.in_proj, [dim, dim, dim], r, s)  # b, c, x
    split_depthwise(conv.conv, [dim], r, s)
    split_linears([], conv.out_proj, r, s)


def split_gated_delta(net: GatedDeltaNet, r: int, s: int) -> None:
    """Rank r's key heads (and their value heads) of a Gated DeltaNet layer (see above)."""
    parts = [net.key_dim, net.key_dim, net.value_dim]  # q, k, v channels
    if net.separate:
        split_fused_rows(net.in_proj_qkv, parts, r, s)
        split_linears([net.in_proj_z, net.in_proj_b, net.in_proj_a], net.out_proj, r, s)
    else:  # grouped by key head: a contiguous run of rows
        split_linears([net.in_proj_qkvz, net.in_proj_ba], net.out_proj, r, s)
    split_depthwise(net.conv1d, parts, r, s)
    net.A_log, net.dt_bias = rows(net.A_log, r, s), rows(net.dt_bias, r, s)
    net.n_k //= s
    net.n_v //= s
    net.key_dim //= s
    net.value_dim //= s


def split_recurrent(layer: nn.Module, r: int, s: int) -> None:
    """Rank r's share of a recurrent layer (one of ``RECURRENT``)."""
    if isinstance(layer, ShortConv):
        split_short_conv(layer, r, s)
    else:
        split_gated_delta(layer, r, s)


def recurrent_split_reason(layer: nn.Module, size: int) -> str | None:
    """Why a recurrent ``layer`` cannot be split over ``size`` ranks; None: it can."""
    if isinstance(layer, ShortConv):
        count, what = layer.conv.weight.shape[0], "conv channels"
    else:
        count, what = layer.n_k, "linear-attention key heads"
    return f"{count} {what} do not divide over {size} ranks" if count % size else None


def recurrent_share(model: nn.Module, r: int, s: int) -> str:
    """`` and channels a-b of D of each conv layer`` (or key heads of each linear-attention
    layer), for the log line (before the split); empty for a model without such layers."""
    for layer in model.layers:
        for child in layer.children().values():
            if isinstance(child, ShortConv):
                n, what = child.conv.weight.shape[0], "channels {} of {} of each conv layer"
            elif isinstance(child, GatedDeltaNet):
                n, what = child.n_k, "key heads {} of {} of each linear-attention layer"
                what = what if n // s > 1 else what.replace("heads", "head", 1)
            else:
                continue
            first, last = r * n // s, (r + 1) * n // s - 1
            return " and " + what.format(f"{first}-{last}" if last > first else first, n)
    return ""
