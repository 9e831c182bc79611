"""SigLIP's vision transformer (Gemma 3's tower, Idefics3's): images in, one state per patch out.

pixel values (N, C, H, W) -> patches (N, P, hidden), P = (H / patch) * (W / patch):

- the patch embedding is a convolution whose kernel and stride are the patch size, run as one
  product over the flattened patches (its weight held as MLX's ``nn.Conv2d`` holds it, OHWI);
- a learned position embedding per patch (no interpolation: the image size is fixed);
- pre-norm encoder layers (LayerNorm, attention with biases, LayerNorm, GELU-tanh MLP);
- ``post_layernorm`` on the last states. The pooling head (``vision_use_head``) is not built:
  Gemma 3 reads the states before it.

Parameter names are transformers' ``SiglipVisionModel``'s, under ``vision_model``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base import BaseArgs
from ..layers import activation


@dataclasses.dataclass
class VisionArgs(BaseArgs):
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 896
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "VisionArgs":
        # Every field has a default (SiglipVisionConfig's): a config that names none is one.
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class VisionEmbeddings(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.patch_size = args.patch_size
        self.patch_embedding = nn.Conv2d(
            args.num_channels, args.hidden_size, kernel_size=args.patch_size, stride=args.patch_size
        )
        self.position_embedding = nn.Embedding(args.patches_per_side**2, args.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        N, C, H, W = pixels.shape
        p = self.patch_size
        h, w = H // p, W // p
        # A stride-p convolution with a p x p kernel is one product over non-overlapping patches,
        # each flattened in the weight's (kh, kw, C) order; patches in row-major order, as
        # transformers' conv output flattens.
        x = pixels.reshape(N, C, h, p, w, p).transpose(0, 2, 4, 3, 5, 1)  # (N, h, w, p, p, C)
        x = x.reshape(N, h * w, p * p * C)
        weight = self.patch_embedding.weight  # (hidden, p, p, C): OHWI
        x = x.astype(weight.dtype) @ weight.reshape(weight.shape[0], -1).T
        x = x + self.patch_embedding.bias  # (N, P, hidden)
        return x + self.position_embedding.weight[None, : h * w]


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = (dim // self.n_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=True)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        N, P, D = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(N, P, self.n_heads, -1).transpose(0, 2, 1, 3)  # (N, nh, P, hd)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        # Every patch sees every patch of its own image: images are rows of the batch, so
        # several images in one call never see each other (no mask needed).
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(N, P, D))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        self.act = activation(args.hidden_act, "config.json vision_config")

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = VisionAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_hidden_layers)]


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.embeddings = VisionEmbeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.embeddings(pixels)  # (N, P, hidden)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class SiglipVisionModel(nn.Module):
    """``vision_model``: the transformer; called on (N, C, H, W) pixels, gives (N, P, hidden)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.vision_model = VisionTransformer(args)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.vision_model(pixels)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: VisionArgs) -> dict[str, mx.array]:
        """The tower's weights (names relative to the tower) as this module holds them.

        transformers 5 saves them without ``vision_model.``; the pooling head is dropped; the
        patch embedding's PyTorch (O, C, kh, kw) weight becomes MLX's (O, kh, kw, C).
        """
        out = {}
        for key, value in weights.items():
            if not key.startswith("vision_model."):
                key = "vision_model." + key
            if key.startswith("vision_model.head."):
                continue
            if key == "vision_model.embeddings.patch_embedding.weight" and _is_oihw(value, args):
                value = value.transpose(0, 2, 3, 1)
            out[key] = value
        return out


def _is_oihw(weight: mx.array, args: VisionArgs) -> bool:
    """Whether a patch embedding weight is in PyTorch's layout (an MLX one is (O, p, p, C))."""
    return (
        weight.ndim == 4
        and weight.shape[1] == args.num_channels
        and weight.shape[3] != (args.num_channels)
    )
