"""Pixtral's vision transformer (Mistral 3's tower, Pixtral-12B's): images of any size in, one
state per patch out.

pixel values (N, C, H, W), padded to the largest image, and each image's patch grid (rows,
cols) -> the patches of every image, image after image, as one sequence (sum rows*cols, hidden):

- the patch embedding is a convolution without bias whose kernel and stride are the patch size,
  run as one product over each image's own patches (the padding is never read), row-major;
- ``ln_pre``: RMSNorm (eps 1e-5, fixed, as transformers has it);
- 2-D RoPE: each patch rotates by its (row, col) inside its image; the frequencies
  1 / theta^(2i / head_dim) are split by parity, the even ones turned by the row and the odd
  ones by the column (half the head each), laid out for ``rotate_half``;
- pre-norm blocks (RMSNorm, attention without biases, RMSNorm, a gated MLP with the config's
  activation); the images of one call attend only within themselves (a block-diagonal mask);
- no final norm. ``hidden_states`` as transformers counts them: 0 is ``ln_pre``'s output, i the
  output of block i; a family reads the ones its ``vision_feature_layer`` names.

Parameter names are transformers' ``PixtralVisionModel``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base import BaseArgs
from ..layers import GatedMLP, RMSNorm, activation

EPS = 1e-5  # every RMSNorm of the tower (transformers hard-codes it)


@dataclasses.dataclass
class VisionArgs(BaseArgs):
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionArgs:
        # Every field has a default (PixtralVisionConfig's). transformers 5 keeps the RoPE base
        # under rope_parameters; older configs at the top.
        config = dict(config)
        params = config.get("rope_parameters")
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            config.setdefault("rope_theta", params["rope_theta"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = args.head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array) -> mx.array:
        B, P, D = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(B, P, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, nh, P, hd)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q = q * cos + rotate_half(q) * sin  # cos, sin (P, hd)
        k = k * cos + rotate_half(k) * sin
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, P, D))


class Layer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, eps=EPS)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, eps=EPS)
        act = activation(args.hidden_act, "config.json vision_config")
        self.feed_forward = GatedMLP(args.hidden_size, args.intermediate_size, act)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array) -> mx.array:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layers = [Layer(args) for _ in range(args.num_hidden_layers)]


class PixtralVisionModel(nn.Module):
    """Called on padded pixels (N, C, H, W) and each image's (rows, cols) of patches, gives the
    hidden states the caller names, each (sum rows*cols, hidden)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        p = args.patch_size
        self.patch_conv = nn.Conv2d(args.num_channels, args.hidden_size, p, stride=p, bias=False)
        self.ln_pre = RMSNorm(args.hidden_size, eps=EPS)
        self.transformer = Transformer(args)
        dim = args.head_dim
        inv_freq = 1.0 / args.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
        self._row_freq = mx.array(inv_freq[0::2])  # (hd / 4,): turned by the row
        self._col_freq = mx.array(inv_freq[1::2])  # (hd / 4,): turned by the column

    def embed(self, pixels: mx.array, grids: list[tuple[int, int]]) -> mx.array:
        """Each image's own patches, projected: (sum rows*cols, hidden)."""
        N, C = pixels.shape[:2]
        p = self.args.patch_size
        weight = self.patch_conv.weight  # (hidden, p, p, C): OHWI
        weight = weight.reshape(weight.shape[0], -1).T  # (p*p*C, hidden)
        out = []
        for image, (rows, cols) in zip(pixels, grids):
            x = image[:, : rows * p, : cols * p].reshape(C, rows, p, cols, p)
            x = x.transpose(1, 3, 2, 4, 0).reshape(rows * cols, p * p * C)  # weight's order
            out.append(x.astype(weight.dtype) @ weight)
        return mx.concatenate(out, axis=0)

    def rotation(self, grids: list[tuple[int, int]], dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """cos and sin (P, head_dim) of every patch's (row, col), image after image."""
        rows = np.concatenate([np.repeat(np.arange(r), c) for r, c in grids])
        cols = np.concatenate([np.tile(np.arange(c), r) for r, c in grids])
        angles = mx.concatenate(
            [
                mx.array(rows, dtype=mx.float32)[:, None] * self._row_freq,
                mx.array(cols, dtype=mx.float32)[:, None] * self._col_freq,
            ],
            axis=-1,
        )  # (P, hd / 2)
        angles = mx.concatenate([angles, angles], axis=-1)  # (P, hd): rotate_half's layout
        return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)

    def __call__(
        self, pixels: mx.array, grids: list[tuple[int, int]], layers: list[int]
    ) -> list[mx.array]:
        """The hidden states numbered ``layers`` (transformers' indices: 0 the embedding,
        -1 the last block's output), each (sum rows*cols, hidden)."""
        h = self.ln_pre(self.embed(pixels, grids))[None]  # (1, P, hidden)
        cos, sin = self.rotation(grids, h.dtype)
        image = np.repeat(np.arange(len(grids)), [r * c for r, c in grids])
        mask = mx.array(image[:, None] == image[None, :])  # (P, P): within each image only
        n = len(self.transformer.layers)
        wanted = {i % (n + 1) for i in layers}
        states = {0: h} if 0 in wanted else {}
        for i, layer in enumerate(self.transformer.layers[: max(wanted)], start=1):
            h = layer(h, cos, sin, mask)
            if i in wanted:
                states[i] = h
        return [states[i % (n + 1)][0] for i in layers]

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: VisionArgs) -> dict[str, mx.array]:
        """The tower's weights (names relative to the tower): the patch convolution's PyTorch
        (O, C, kh, kw) weight becomes MLX's (O, kh, kw, C); RoPE buffers are not weights."""
        out = {}
        for key, value in weights.items():
            if "inv_freq" in key:
                continue
            if (
                key == "patch_conv.weight"
                and value.ndim == 4
                and value.shape[1] == (args.num_channels) != value.shape[3]
            ):
                value = value.transpose(0, 2, 3, 1)
            out[key] = value
        return out
