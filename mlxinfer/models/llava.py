"""LLaVA: a Llama / Mistral network, a CLIP tower (or Pixtral's: Pixtral-12B) and a
linear-act-linear projector.

A ``LlavaForConditionalGeneration`` checkpoint (``model_type: llava`` with a
``vision_config``); config.py lifts its ``text_config`` to the top and keeps the keys below
beside it, with ``text_model_type``. With images, as transformers' ``LlavaModel.forward`` does:

1. ``encode_images(pixels)``: the tower's hidden states numbered ``vision_feature_layer`` (-2:
   the second-to-last layer's; a list: concatenated), without the class token for the
   ``vision_feature_select_strategy`` "default" -> projector -> (N * tokens, hidden). A Pixtral
   tower takes each image's ``grid_thw`` too and gives (sum rows*cols, hidden) ("full");
2. ``image_inputs``: the ids' embeddings with each ``image_token_index`` position taking the
   next image token (``embeds``); attention stays causal;
3. ``model(ids, cache, embeds=...)``: the text network on those embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ConfigError
from . import llama, ministral3
from .base import language_model_weights
from .layers import activation
from .mistral3 import Model as Mistral3Model
from .mistral3 import merged_embeddings, split_weights
from .towers import clip, pixtral

TEXT_MODELS = ("llama", "mistral", "ministral3")


@dataclasses.dataclass
class ModelArgs(ministral3.ModelArgs):
    vision_config: dict[str, Any] | None = None
    image_token_index: int = 32000
    projector_hidden_act: str = "gelu"
    vision_feature_layer: Any = -2
    vision_feature_select_strategy: str = "default"
    multimodal_projector_bias: bool = True
    text_model_type: str = "llama"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.vision_config, dict):
            raise ConfigError("config.json: a 'llava' checkpoint needs a 'vision_config' object")
        if self.text_model_type not in TEXT_MODELS:
            raise ConfigError(
                f"config.json: text_config model_type '{self.text_model_type}' under 'llava' "
                f"(expected one of {', '.join(TEXT_MODELS)})"
            )
        if self.text_model_type == "llama":
            self.sliding_window = None  # as llama.ModelArgs has it
        layers = self.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else layers
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ):
            raise ConfigError(
                "config.json: vision_feature_layer must be an int or a list of ints, found "
                f"{self.vision_feature_layer!r}"
            )
        self.feature_layers = layers
        strategy = self.vision_feature_select_strategy
        self.tower_type = self.vision_config.get("model_type") or "clip_vision_model"
        if self.tower_type not in TOWERS:
            raise ConfigError(
                f"config.json: vision_config model_type '{self.tower_type}' under 'llava' "
                f"(expected one of {', '.join(TOWERS)})"
            )
        allowed = ("default", "full") if self.tower_type != "pixtral" else ("full",)
        if strategy not in allowed:
            raise ConfigError(
                f"config.json: vision_feature_select_strategy '{strategy}' for a "
                f"{self.tower_type} tower (expected one of {', '.join(allowed)})"
            )
        self.vision = TOWERS[self.tower_type][0].from_dict(self.vision_config)


TOWERS: dict[str, tuple[Any, Any]] = {
    "clip_vision_model": (clip.VisionArgs, clip.ClipVisionModel),
    "pixtral": (pixtral.VisionArgs, pixtral.PixtralVisionModel),
}


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = activation(act, "config.json projector_hidden_act")
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(self.act(self.linear_1(x)))


class Model(ministral3.Model):
    __call__ = Mistral3Model.__call__  # the text network, on ``embeds`` where given
    quant_predicate = Mistral3Model.quant_predicate  # tower and projector float under -q

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        vision = args.vision
        self.vision_tower = TOWERS[args.tower_type][1](vision)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(args.feature_layers),
            args.hidden_size,
            args.projector_hidden_act,
            args.multimodal_projector_bias,
        )

    def encode_images(self, pixel_values: mx.array, grid_thw: Any = None) -> mx.array:
        """(N, C, S, S) pixels -> (N, T, hidden) (a CLIP tower: one row per image, as the
        batching engine's encoder cache keeps them); a Pixtral tower: padded pixels and each
        image's ``grid_thw`` -> (sum rows*cols, hidden), image after image."""
        args = self.args
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        pixels = pixel_values.astype(dtype)
        if args.tower_type == "pixtral":
            if grid_thw is None:
                raise ValueError("pixel_values: a Pixtral tower needs each image's grid_thw")
            grids = [(int(r), int(c)) for _, r, c in np.asarray(grid_thw).reshape(-1, 3).tolist()]
            states = self.vision_tower(pixels, grids, args.feature_layers)
            return self.multi_modal_projector(mx.concatenate(states, axis=-1))
        size = args.vision.image_size
        expected = (args.vision.num_channels, size, size)
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values: expected shape (N, {', '.join(map(str, expected))}), "
                f"found {tuple(pixels.shape)}"
            )
        states = self.vision_tower(pixels, args.feature_layers)  # each (N, 1 + P, vision hidden)
        if args.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]  # the class token dropped
        return self.multi_modal_projector(mx.concatenate(states, axis=-1))  # (N, T, hidden)

    def image_inputs(self, ids: list[int], features: mx.array) -> dict[str, mx.array]:
        """``embeds`` (1, L, hidden) for a prompt's ``ids`` whose image tokens take
        ``features`` ((N, T, hidden) or (T, hidden)) in order."""
        return {"embeds": merged_embeddings(self, ids, features, self.args.image_token_index)}

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: llama.ModelArgs) -> dict[str, mx.array]:
        assert isinstance(args, ModelArgs)  # this family's (typed as the base's)
        tower, projector, rest = split_weights(weights)
        text = ministral3.Model.sanitize(language_model_weights(rest), args)
        tower = TOWERS[args.tower_type][1].sanitize(tower, args.vision)
        return {
            **text,
            **{"vision_tower." + k: v for k, v in tower.items()},
            **{"multi_modal_projector." + k: v for k, v in projector.items()},
        }
