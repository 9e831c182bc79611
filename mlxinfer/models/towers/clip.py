"""CLIP's vision transformer (LLaVA's tower): fixed-size images in, one state per patch and
the class token out.

pixel values (N, C, S, S) -> (N, 1 + P, hidden), P = (S / patch)^2:

- the patch embedding is a convolution without bias whose kernel and stride are the patch size,
  run as one product over the flattened patches (weight held OHWI, as MLX's ``nn.Conv2d``);
- a learned ``class_embedding`` before the patches, a learned position per token (no
  interpolation: the processor crops every image to the tower's size);
- ``pre_layrnorm`` (transformers' spelling), then pre-norm encoder layers as SigLIP's
  (LayerNorm, attention with biases, LayerNorm, MLP with the config's activation: quick-GELU
  for OpenAI's CLIP);
- ``hidden_states`` as transformers counts them: 0 is ``pre_layrnorm``'s output, i the output of
  layer i. LLaVA reads layer -2; nothing reads ``post_layernorm`` (it only pools the class
  token), so it is not built, and the layers past the deepest one read are not run.

Parameter names are transformers 5's ``CLIPVisionModel``'s (no ``vision_model.``).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from .siglip import EncoderLayer
from .siglip import VisionArgs as SiglipArgs


@dataclasses.dataclass
class VisionArgs(SiglipArgs):
    """CLIPVisionConfig's fields and defaults (SigLIP's fields, other defaults)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    image_size: int = 224
    patch_size: int = 32
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.patch_size = args.patch_size
        self.class_embedding = mx.zeros((args.hidden_size,))
        self.patch_embedding = nn.Conv2d(
            args.num_channels,
            args.hidden_size,
            kernel_size=args.patch_size,
            stride=args.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(args.patches_per_side**2 + 1, args.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        N, C, H, W = pixels.shape
        p = self.patch_size
        h, w = H // p, W // p
        # Patches row-major, each flattened in the weight's (kh, kw, C) order.
        x = pixels.reshape(N, C, h, p, w, p).transpose(0, 2, 4, 3, 5, 1)  # (N, h, w, p, p, C)
        x = x.reshape(N, h * w, p * p * C)
        weight = self.patch_embedding.weight  # (hidden, p, p, C): OHWI
        x = x.astype(weight.dtype) @ weight.reshape(weight.shape[0], -1).T  # (N, P, hidden)
        cls = mx.broadcast_to(self.class_embedding.astype(x.dtype), (N, 1, x.shape[-1]))
        x = mx.concatenate([cls, x], axis=1)  # (N, 1 + P, hidden)
        return x + self.position_embedding.weight[None, : h * w + 1]


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_hidden_layers)]


class ClipVisionModel(nn.Module):
    """Called on (N, C, S, S) pixels, gives the hidden states the caller names, each
    (N, 1 + P, hidden)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.encoder = Encoder(args)

    def __call__(self, pixels: mx.array, layers: list[int]) -> list[mx.array]:
        """The hidden states numbered ``layers`` (0 the embedding, -1 the last layer's)."""
        h = self.pre_layrnorm(self.embeddings(pixels))
        n = len(self.encoder.layers)
        wanted = {i % (n + 1) for i in layers}
        states = {0: h} if 0 in wanted else {}
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            h = layer(h)
            if i in wanted:
                states[i] = h
        return [states[i % (n + 1)] for i in layers]

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: VisionArgs) -> dict[str, mx.array]:
        """The tower's weights (names relative to the tower): the Hub's ``vision_model.``
        dropped, ``post_layernorm`` and position ids dropped, the patch convolution's PyTorch
        (O, C, kh, kw) weight as MLX's (O, kh, kw, C)."""
        out = {}
        for key, value in weights.items():
            key = key.removeprefix("vision_model.")
            if key.startswith("post_layernorm.") or key.endswith("position_ids"):
                continue
            if (
                key == "embeddings.patch_embedding.weight"
                and value.ndim == 4
                and value.shape[1] == args.num_channels != value.shape[3]
            ):
                value = value.transpose(0, 2, 3, 1)
            out[key] = value
        return out
