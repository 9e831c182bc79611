"""The Qwen vision transformers (Qwen2.5-VL's, Qwen3-VL's): patches in, merged image tokens out.

Input: the processor's flattened patches (sum of t*h*w, C * T * P * P) and each image's
``grid_thw`` (t, h, w patches); patches come in ``merge`` x ``merge`` blocks (the processor's
order), so a block of neighbours is ``merge**2`` consecutive rows. Output: one token per
block, (sum of t*h*w / merge**2, out_hidden_size), image after image, in the blocks' order.

- patch embedding: a Conv3d whose kernel and stride are (T, P, P), i.e. one product of the
  flattened patches with the kernel flattened to (hidden, C*T*P*P) (held so: ``sanitize``);
- 2D rotary embeddings: a head's first half of frequencies turn with the patch's row, the
  second with its column (frequencies over head_dim / 2), rotated as non-traditional RoPE;
- attention inside each image (each frame: ``cu_seqlens``): several images in one call never
  see each other; the runs (images, or windows) go as one padded batch (``Segments``), so a
  window costs its own square, not the call's;
- Qwen2.5-VL (``VisionModel``): RMSNorm + SwiGLU blocks; every block except those in
  ``fullatt_block_indexes`` attends inside windows of ``window_size`` pixels (of merged
  blocks): the tokens are permuted window by window first (``window_index``) and back after
  the merger; merger = RMSNorm, then (merge**2 * hidden) -> GELU MLP -> out;
- Qwen3-VL (``Qwen3VisionModel``): LayerNorm + GELU-tanh blocks, no windows; a learned
  square position table resampled bilinearly (align_corners) to each image's grid and added
  after the patch embedding; the states after each block of ``deepstack_visual_indexes`` go
  through their own merger (LayerNorm after the merge) to be added to the language model's
  first layers' outputs.

Parameter names are transformers' (``visual.patch_embed.proj``, ``visual.blocks.N.attn.qkv``,
``visual.merger.mlp.0`` ...). Numbers follow transformers' ``Qwen2_5_VisionTransformer
PretrainedModel`` and ``Qwen3VLVisionModel`` (5.25), with ``vision_utils``' indices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base import BaseArgs
from ..layers import RMSNorm, activation
from ..layers.mlp import GatedMLP
from ..layers.mrope import rotate


@dataclasses.dataclass
class VisionArgs(BaseArgs):
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    hidden_act: str = "silu"
    window_size: int = 112
    fullatt_block_indexes: list[int] = dataclasses.field(default_factory=lambda: [7, 15, 23, 31])
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = dataclasses.field(default_factory=list)
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionArgs:
        # Every field has a default (the released configs'): a config that names none is one.
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and isinstance(rope.get("rope_theta"), (int, float)):
            values["rope_theta"] = float(rope["rope_theta"])
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


# --- per-call indices (numpy; from the grids alone) ----------------------------------------


def patch_rows_cols(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(sum t*h*w, 2) each patch's (row, column) in its image, in the processor's block order
    (``vision_utils.get_vision_position_ids``)."""
    out = []
    for t, h, w in np.asarray(grid_thw).tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).ravel()
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).ravel()
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out) if out else np.zeros((0, 2), np.int64)


def frame_segments(grid_thw: np.ndarray) -> np.ndarray:
    """(sum t*h*w,) which frame (image) each patch belongs to: ``cu_seqlens`` as labels."""
    sizes = [h * w for t, h, w in np.asarray(grid_thw).tolist() for _ in range(t)]
    return np.repeat(np.arange(len(sizes)), sizes)


def window_index(
    grid_thw: np.ndarray, merge: int, window_size: int, patch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(order, windows): ``order`` lists the merged blocks window by window (padded windows
    at the right and bottom edges are ragged), ``windows`` labels each block's window, in that
    order (``vision_utils.get_vision_window_index``; its ``cu_window_seqlens`` as labels)."""
    side = window_size // merge // patch_size  # merged blocks per window side
    order, labels, base, n_windows = [], [], 0, 0
    for t, h, w in np.asarray(grid_thw).tolist():
        gh, gw = h // merge, w // merge
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t * nh * nw, side * side)
        for window in padded:
            kept = window[window >= 0]
            if kept.size:
                order.append(kept + base)
                labels.append(np.full(kept.size, n_windows))
                n_windows += 1
        base += t * gh * gw
    if not order:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(order), np.concatenate(labels)


def bilinear_taps(grid_thw: np.ndarray, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (sum t*h*w, 4): the learned ``side`` x ``side`` position table
    resampled bilinearly with aligned corners to each image's h x w patches, in block order
    (``vision_utils.get_vision_interpolation_indices_and_weights``, Qwen3-VL's settings)."""
    rows_cols = patch_rows_cols(grid_thw, merge)
    sizes = np.concatenate(
        [np.tile([[h, w]], (t * h * w, 1)) for t, h, w in np.asarray(grid_thw).tolist()]
        or [np.zeros((0, 2), np.int64)]
    )

    def taps(index: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1)
        src = src.astype(np.float32)
        floor = np.floor(src)
        offsets = np.arange(2)
        where = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        weight = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
        return where, weight.astype(np.float32)

    h_at, h_w = taps(rows_cols[:, 0], sizes[:, 0])
    w_at, w_w = taps(rows_cols[:, 1], sizes[:, 1])
    indices = (h_at[:, :, None] * side + w_at[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return indices, weights


# --- layers ---------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (T, P, P) over one patch each: a product with the kernel
    flattened to (hidden, C*T*P*P) in the patches' (C, T, P, P) order."""

    def __init__(self, args: VisionArgs, bias: bool):
        super().__init__()
        self.proj = nn.Linear(args.patch_dim, args.hidden_size, bias=bias)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


@dataclasses.dataclass
class Segments:
    """Contiguous runs of patches that attend only among themselves (``cu_seqlens``: images,
    frames or windows), laid out as a padded batch: S runs of at most ``width`` patches, so
    attention costs the runs' squares, not the whole call's."""

    gather: mx.array | None  # (S, width) patch index per slot (padding: 0); None: one run
    keys: mx.array | None  # (S, 1, 1, width) bool: the slots that hold a patch; None: all do
    scatter: mx.array | None  # (N,) each patch's slot in the flattened (S * width) output

    @classmethod
    def of(cls, labels: np.ndarray) -> Segments:
        """From each patch's run label (runs contiguous)."""
        n = len(labels)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(labels)) + 1]).astype(np.int64)
        if len(starts) <= 1:
            return cls(None, None, None)
        lengths = np.diff(np.concatenate([starts, [n]]))
        width = int(lengths.max())
        valid = np.arange(width)[None] < lengths[:, None]  # (S, width)
        gather = np.where(valid, starts[:, None] + np.arange(width)[None], 0)
        keys = None if valid.all() else mx.array(valid[:, None, None, :])
        return cls(mx.array(gather), keys, mx.array(np.flatnonzero(valid.ravel())))


class VisionAttention(nn.Module):
    """Non-causal attention with 2D RoPE over the patches of several images at once, each
    patch seeing only its own run (``Segments``: its image, or its window)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, runs: Segments) -> mx.array:
        N = x.shape[0]
        qkv = self.qkv(x).reshape(N, 3, self.num_heads, self.head_dim)
        q, k, v = (qkv[:, i].transpose(1, 0, 2)[None] for i in range(3))  # (1, heads, N, hd)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if runs.gather is not None:  # (1, heads, N, hd) -> (S, heads, width, hd)
            q, k, v = (t[0][:, runs.gather].transpose(1, 0, 2, 3) for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.head_dim**-0.5, mask=runs.keys
        )  # (S, heads, width, hd)
        out = out.transpose(0, 2, 1, 3).reshape(-1, self.num_heads * self.head_dim)
        if runs.scatter is not None:  # padded slots dropped, patches back in order
            out = out[runs.scatter]
        return self.proj(out)  # (N, hidden)


class VisionMLP(nn.Module):
    """Qwen3-VL's block MLP: fc2(act(fc1(x)))."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        self.act = activation(args.hidden_act, "config.json vision_config")

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs, layer_norm: bool):
        super().__init__()
        self.norm1: nn.Module
        self.norm2: nn.Module
        if layer_norm:  # Qwen3-VL
            self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
            self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
            self.mlp: nn.Module = VisionMLP(args)
        else:  # Qwen2.5-VL
            self.norm1 = RMSNorm(args.hidden_size, eps=1e-6)
            self.norm2 = RMSNorm(args.hidden_size, eps=1e-6)
            act = activation(args.hidden_act, "config.json vision_config")
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, act, bias=True)
        self.attn = VisionAttention(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, runs: Segments) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``merge**2`` neighbouring patches -> one token. Qwen2.5-VL: ``ln_q`` (RMSNorm per patch)
    and ``mlp`` [Linear, GELU, Linear]; Qwen3-VL: ``norm`` (LayerNorm, per patch or after the
    merge: ``postshuffle``), ``linear_fc1``, GELU, ``linear_fc2``."""

    def __init__(self, args: VisionArgs, qwen3: bool, postshuffle: bool = False):
        super().__init__()
        self.merged = args.hidden_size * args.spatial_merge_size**2
        self.qwen3, self.postshuffle = qwen3, postshuffle
        if qwen3:
            width = self.merged if postshuffle else args.hidden_size
            self.norm = nn.LayerNorm(width, eps=1e-6)
            self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
            self.linear_fc2 = nn.Linear(self.merged, args.out_hidden_size, bias=True)
        else:
            self.ln_q = RMSNorm(args.hidden_size, eps=1e-6)
            self.mlp = [
                nn.Linear(self.merged, self.merged, bias=True),
                nn.GELU(),
                nn.Linear(self.merged, args.out_hidden_size, bias=True),
            ]

    def __call__(self, x: mx.array) -> mx.array:
        if not self.qwen3:
            x = self.ln_q(x).reshape(-1, self.merged)
            for layer in self.mlp:
                x = layer(x)
            return x
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle else self.norm(x)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x.reshape(-1, self.merged))))


class VisionModel(nn.Module):
    """Qwen2.5-VL's tower (see the module doc). ``__call__(patches, grid_thw)`` ->
    (tokens (sum t*h*w / merge**2, out_hidden_size), [] : no deepstack features)."""

    qwen3 = False

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args, bias=self.qwen3)
        self.blocks = [VisionBlock(args, layer_norm=self.qwen3) for _ in range(args.depth)]
        self.merger = PatchMerger(args, qwen3=self.qwen3)
        half = args.head_dim // 2  # frequencies: a quarter of the head for rows, one for columns
        self._inv_freq = mx.array(
            1.0 / args.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half)
        )

    def rotary(self, rows_cols: np.ndarray) -> tuple[mx.array, mx.array]:
        """(cos, sin), each (1, 1, N, head_dim): rows turn the first quarter's frequencies,
        columns the second's, repeated over both halves of the head."""
        angles = mx.array(rows_cols.astype(np.float32))[:, :, None] * self._inv_freq  # (N, 2, q)
        angles = angles.reshape(angles.shape[0], -1)  # (N, head_dim / 2): rows', then columns'
        angles = mx.concatenate([angles, angles], axis=-1)[None, None]
        return mx.cos(angles), mx.sin(angles)

    def embed(self, patches: mx.array, grid_thw: np.ndarray) -> mx.array:
        return self.patch_embed(patches.astype(self.patch_embed.proj.weight.dtype))

    def __call__(self, patches: mx.array, grid_thw: np.ndarray) -> tuple[mx.array, list[mx.array]]:
        args, unit = self.args, self.args.spatial_merge_size**2
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        x = self.embed(patches, grid_thw)  # (N, hidden)
        rows_cols = patch_rows_cols(grid_thw, args.spatial_merge_size)
        frames = frame_segments(grid_thw)
        order, windows = window_index(
            grid_thw, args.spatial_merge_size, args.window_size, args.patch_size
        )
        # Window by window: blocks of ``unit`` patches permuted together.
        patch_order = (order[:, None] * unit + np.arange(unit)).ravel()
        x = x[mx.array(patch_order)]
        cos, sin = self.rotary(rows_cols[patch_order])
        full = Segments.of(frames[patch_order])  # images stay contiguous window by window
        windowed = Segments.of(np.repeat(windows, unit))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in args.fullatt_block_indexes else windowed)
        tokens = self.merger(x)  # (N / unit, out) in window order
        return tokens[mx.array(np.argsort(order))], []

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The Conv3d kernel (hidden, C, T, P, P) flattened for :class:`PatchEmbed`."""
        key = "patch_embed.proj.weight"
        if key in weights and weights[key].ndim == 5:
            weights = {**weights, key: weights[key].reshape(weights[key].shape[0], -1)}
        return weights


class Qwen3VisionModel(VisionModel):
    """Qwen3-VL's tower (see the module doc): ``__call__`` -> (tokens, deepstack features:
    one (tokens, out_hidden_size) per ``deepstack_visual_indexes`` entry)."""

    qwen3 = True

    def __init__(self, args: VisionArgs):
        super().__init__(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.side = int(args.num_position_embeddings**0.5)
        self.deepstack_merger_list = [
            PatchMerger(args, qwen3=True, postshuffle=True) for _ in args.deepstack_visual_indexes
        ]

    def embed(self, patches: mx.array, grid_thw: np.ndarray) -> mx.array:
        x = super().embed(patches, grid_thw)
        indices, weights = bilinear_taps(grid_thw, self.side, self.args.spatial_merge_size)
        table = self.pos_embed(mx.array(indices))  # (N, 4, hidden)
        return x + (table * mx.array(weights)[:, :, None].astype(table.dtype)).sum(axis=1)

    def __call__(self, patches: mx.array, grid_thw: np.ndarray) -> tuple[mx.array, list[mx.array]]:
        args = self.args
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        x = self.embed(patches, grid_thw)
        cos, sin = self.rotary(patch_rows_cols(grid_thw, args.spatial_merge_size))
        runs = Segments.of(frame_segments(grid_thw))
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, runs)
            if i in args.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[args.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
