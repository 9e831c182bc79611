"""Gemma 3 with images: the gemma3_text network, a SigLIP tower and Gemma 3's projector.

A ``Gemma3ForConditionalGeneration`` checkpoint (``model_type: gemma3`` with a
``vision_config``); config.py lifts its ``text_config`` to the top and keeps the keys below
beside it. Text alone runs exactly as gemma3_text. With images, as transformers'
``Gemma3Model.forward`` does:

1. ``encode_images``: pixel values (N, 3, S, S) -> tower -> projector -> (N, T, hidden),
   T = ``mm_tokens_per_image`` soft tokens per image;
2. ``image_inputs``: the ids' embeddings, scaled by sqrt(hidden) as text always is, with each
   ``image_token_index`` position replaced by the next soft token, unscaled; plus the ids'
   image blocks (each image's run of soft tokens), which attend to each other both ways in
   every layer (in sliding layers the window still bounds the past);
3. ``model(ids, cache, embeds=..., blocks=...)``: the text network on those embeddings.

An image's soft tokens must be fed in one forward pass (one prefill chunk), or its first
tokens would miss the later ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ConfigError
from .base import language_model_weights, scaled_embedding
from .gemma2 import ModelArgs as Gemma2Args
from .gemma3_text import Model as TextModel
from .gemma3_text import ModelArgs as TextArgs
from .towers.gemma3_projector import Gemma3MultiModalProjector
from .towers.siglip import SiglipVisionModel, VisionArgs


@dataclasses.dataclass
class ModelArgs(TextArgs):
    vision_config: dict[str, Any] | None = None
    mm_tokens_per_image: int = 256
    image_token_index: int = 262144
    boi_token_index: int = 255999
    eoi_token_index: int = 256000

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.vision_config, dict):
            raise ConfigError("config.json: a 'gemma3' checkpoint needs a 'vision_config' object")
        self.vision = VisionArgs.from_dict(self.vision_config)


class Model(TextModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        vision = args.vision
        self.vision_tower = SiglipVisionModel(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision.hidden_size,
            args.hidden_size,
            vision.patches_per_side,
            args.mm_tokens_per_image,
            eps=vision.layer_norm_eps,
        )

    def quant_predicate(self, path: str, module) -> bool:
        """``convert -q`` quantizes the language model; the tower and projector stay float
        (a small share of the weights, and the image features are the most sensitive)."""
        return not path.startswith(("vision_tower.", "multi_modal_projector."))

    @property
    def image_size(self) -> int:
        return self.args.vision.image_size

    def encode_images(self, pixel_values: mx.array) -> mx.array:
        """(N, C, S, S) pixel values -> (N, mm_tokens_per_image, hidden) soft tokens."""
        expected = (self.args.vision.num_channels, self.image_size, self.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values: expected shape (N, {', '.join(map(str, expected))}), "
                f"found {tuple(pixel_values.shape)}"
            )
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        states = self.vision_tower(pixel_values.astype(dtype))  # (N, P, vision hidden)
        return self.multi_modal_projector(states)

    def image_inputs(self, ids: list[int], features: mx.array) -> dict[str, mx.array]:
        """``embeds`` (1, L, hidden) and ``blocks`` (L,) for a prompt's ``ids`` whose image
        tokens take ``features`` ((N, T, hidden) or (N * T, hidden)) in order (see the module
        doc)."""
        tokens = np.asarray(ids, dtype=np.int64)
        is_image = tokens == self.args.image_token_index
        features = features.reshape(-1, features.shape[-1])  # one row per image token
        n_feat = features.shape[0]
        if int(is_image.sum()) != n_feat:
            raise ValueError(
                f"prompt: {int(is_image.sum())} image tokens for {n_feat} image features "
                "(expected the same count)"
            )
        # An image token id past the embedding's rows (the released models') reads row 0;
        # its row is replaced anyway.
        rows = self.embedding.weight.shape[0]
        safe = np.where(is_image | (tokens >= rows), 0, tokens)
        text = self.embedding(mx.array(safe[None], dtype=mx.int32))
        text = scaled_embedding(text, math.sqrt(self.args.hidden_size))  # (1, L, hidden)
        # Position j of the prompt reads soft token (number of image tokens before j).
        order = np.clip(np.cumsum(is_image) - 1, 0, max(n_feat - 1, 0))
        soft = features.astype(text.dtype)[mx.array(order)]
        embeds = mx.where(mx.array(is_image)[None, :, None], soft[None], text)
        return {"embeds": embeds, "blocks": mx.array(image_blocks(is_image))}

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: Gemma2Args) -> dict[str, mx.array]:
        assert isinstance(
            args, ModelArgs
        )  # this family's (typed as the base's, which it overrides)
        tower: dict[str, mx.array] = {}
        rest: dict[str, mx.array] = {}
        for key, value in weights.items():
            for prefix in _TOWER_PREFIXES:
                if key.startswith(prefix):
                    tower[key[len(prefix) :]] = value
                    break
            else:
                for prefix in _PROJECTOR_PREFIXES:
                    if key.startswith(prefix):
                        rest["multi_modal_projector." + key[len(prefix) :]] = value
                        break
                else:
                    rest[key] = value
        text = TextModel.sanitize(language_model_weights(rest), args)
        # language_model_weights drops the projector (a vision prefix): put it back.
        text.update({k: v for k, v in rest.items() if k.startswith("multi_modal_projector.")})
        tower = SiglipVisionModel.sanitize(tower, args.vision)
        return {**text, **{"vision_tower." + k: v for k, v in tower.items()}}


# Where checkpoints keep the tower and the projector: transformers 5's save_pretrained first,
# then the Hub's (transformers 4) and our own layout.
_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def image_blocks(is_image: np.ndarray) -> np.ndarray:
    """(L,) block ids: each run of image tokens numbered from 0, -1 elsewhere (transformers'
    ``get_block_sequence_ids_for_mask``)."""
    is_image = np.asarray(is_image, dtype=bool)
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    return np.where(is_image, np.cumsum(starts) - 1, -1).astype(np.int32)
