"""Mistral 3 with images: the Mistral / Ministral 3 network, a Pixtral tower and Mistral 3's
projector.

A ``Mistral3ForConditionalGeneration`` checkpoint (``model_type: mistral3`` with a
``vision_config``: Mistral Small 3.1/3.2, Ministral 3); config.py lifts its ``text_config`` to
the top and keeps the keys below beside it, with ``text_model_type`` ("mistral" or
"ministral3"). The text network is ministral3's, which is Mistral's where the config names no
``llama_4_scaling_beta``. With images, as transformers' ``Mistral3Model.forward`` does:

1. ``encode_images(pixels, grid_thw)``: pixel values (N, C, H, W) padded to the largest image,
   each image's (1, rows, cols) of patches -> the tower's ``vision_feature_layer`` states ->
   projector -> (sum rows*cols / merge**2, hidden), image after image;
2. ``image_inputs``: the ids' embeddings with each ``image_token_index`` position taking the
   next image token (``embeds``); attention stays causal (no image blocks);
3. ``model(ids, cache, embeds=...)``: the text network on those embeddings, in chunks of any
   size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.kv import LayerCache
from ..errors import ConfigError
from . import llama, ministral3
from .base import language_model_weights, lm_head
from .towers.mistral3_projector import Mistral3MultiModalProjector
from .towers.pixtral import PixtralVisionModel, VisionArgs

TEXT_MODELS = ("mistral", "ministral3", "llama")


@dataclasses.dataclass
class ModelArgs(ministral3.ModelArgs):
    vision_config: dict[str, Any] | None = None
    image_token_index: int = 10
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    vision_feature_layer: Any = -1
    multimodal_projector_bias: bool = False
    text_model_type: str = "mistral"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.vision_config, dict):
            raise ConfigError(
                f"config.json: a '{self.model_type}' checkpoint needs a 'vision_config' object"
            )
        if self.text_model_type not in TEXT_MODELS:
            raise ConfigError(
                f"config.json: text_config model_type '{self.text_model_type}' under "
                f"'{self.model_type}' (expected one of {', '.join(TEXT_MODELS)})"
            )
        if self.text_model_type == "llama":
            self.sliding_window = None  # as llama.ModelArgs has it
        layer = self.vision_feature_layer
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ConfigError(
                f"config.json: vision_feature_layer must be an int for '{self.model_type}', "
                f"found {layer!r}"
            )
        self.vision = VisionArgs.from_dict(self.vision_config)


class Model(ministral3.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        vision = args.vision
        self.vision_tower = PixtralVisionModel(vision)
        self.multi_modal_projector = Mistral3MultiModalProjector(
            vision.hidden_size,
            args.hidden_size,
            args.spatial_merge_size,
            act=args.projector_hidden_act,
            bias=args.multimodal_projector_bias,
            eps=args.rms_norm_eps,
        )

    def __call__(
        self,
        inputs: mx.array,
        cache: list[LayerCache] | None = None,
        *,
        embeds: mx.array | None = None,
    ) -> mx.array:
        h = self.model(inputs, cache, embeds=embeds)
        return lm_head(h, self.head)  # (B, L, V)

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """``convert -q`` quantizes the language model; the tower and projector stay float
        (a small share of the weights, and the image features are the most sensitive)."""
        return not path.startswith(("vision_tower.", "multi_modal_projector."))

    def encode_images(self, pixel_values: mx.array, grid_thw: Any) -> mx.array:
        """Padded pixels (N, C, H, W) and each image's ``grid_thw`` (1, rows, cols) of patches
        -> (sum rows*cols / merge**2, hidden), image after image."""
        grids = [(int(r), int(c)) for _, r, c in np.asarray(grid_thw).reshape(-1, 3).tolist()]
        vision, p = self.args.vision, self.args.vision.patch_size
        if (
            pixel_values.ndim != 4
            or pixel_values.shape[0] != len(grids)
            or pixel_values.shape[1] != vision.num_channels
            or any(r * p > pixel_values.shape[2] or c * p > pixel_values.shape[3] for r, c in grids)
        ):
            raise ValueError(
                f"pixel_values: expected shape ({len(grids)}, {vision.num_channels}, H, W) "
                f"holding grids {grids} of {p} px patches, found {tuple(pixel_values.shape)}"
            )
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        (states,) = self.vision_tower(
            pixel_values.astype(dtype), grids, [self.args.vision_feature_layer]
        )
        return self.multi_modal_projector(states, grids)

    def image_inputs(self, ids: list[int], features: mx.array) -> dict[str, mx.array]:
        """``embeds`` (1, L, hidden) for a prompt's ``ids`` whose image tokens take
        ``features`` (T, hidden) in order."""
        return {"embeds": merged_embeddings(self, ids, features, self.args.image_token_index)}

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: llama.ModelArgs) -> dict[str, mx.array]:
        assert isinstance(args, ModelArgs)  # this family's (typed as the base's)
        tower, projector, rest = split_weights(weights)
        text = ministral3.Model.sanitize(language_model_weights(rest), args)
        tower = PixtralVisionModel.sanitize(tower, args.vision)
        return {
            **text,
            **{"vision_tower." + k: v for k, v in tower.items()},
            **{"multi_modal_projector." + k: v for k, v in projector.items()},
        }


# Where checkpoints keep the tower and the projector: transformers 5's save_pretrained first,
# then the Hub's (transformers 4) and our own layout.
_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def split_weights(
    weights: dict[str, mx.array],
) -> tuple[dict[str, mx.array], dict[str, mx.array], dict[str, mx.array]]:
    """(tower, projector, the rest) of an image-text checkpoint's weights, the first two under
    names relative to their module."""
    tower: dict[str, mx.array] = {}
    projector: dict[str, mx.array] = {}
    rest: dict[str, mx.array] = {}
    for key, value in weights.items():
        for prefixes, into in ((_TOWER_PREFIXES, tower), (_PROJECTOR_PREFIXES, projector)):
            prefix = next((p for p in prefixes if key.startswith(p)), None)
            if prefix is not None:
                into[key[len(prefix) :]] = value
                break
        else:
            rest[key] = value
    return tower, projector, rest


def merged_embeddings(model, ids: list[int], features: mx.array, image_token: int) -> mx.array:
    """(1, L, hidden): the ids' embeddings with position j of each ``image_token`` taking
    row (number of image tokens before j) of ``features`` (T, hidden) (or (N, T, hidden): one
    row per image)."""
    features = features.reshape(-1, features.shape[-1])
    tokens = np.asarray(ids, dtype=np.int64)
    is_image = tokens == image_token
    n_feat = features.shape[0]
    if int(is_image.sum()) != n_feat:
        raise ValueError(
            f"prompt: {int(is_image.sum())} image tokens for {n_feat} image features "
            "(expected the same count)"
        )
    rows = model.embedding.weight.shape[0]
    safe = np.where(is_image | (tokens >= rows), 0, tokens)  # an image id past the rows reads 0
    text = model.embedding(mx.array(safe[None], dtype=mx.int32))  # (1, L, hidden)
    order = np.clip(np.cumsum(is_image) - 1, 0, max(n_feat - 1, 0))
    image = features.astype(text.dtype)[mx.array(order)][None]
    return mx.where(mx.array(is_image)[None, :, None], image, text)
