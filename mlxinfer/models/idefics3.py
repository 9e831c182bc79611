"""Idefics3 and SmolVLM with images: a Llama network, SigLIP's tower and a pixel-shuffle
connector.

An ``Idefics3ForConditionalGeneration`` checkpoint (``model_type: idefics3``: Idefics3-8B,
SmolVLM-256M/500M/2B); config.py lifts its ``text_config`` (llama) to the top and keeps the
keys below beside it. With images, as transformers' ``Idefics3Model.forward`` does:

1. ``encode_images(pixels)``: every image's M x M frames (its tiles and its global view:
   vision/processors/idefics3.py) -> the tower (towers/idefics3.py: SigLIP with bucketized
   positions) -> the connector (pixel shuffle by ``scale_factor``, projection) -> (frames,
   image_seq_len, hidden);
2. ``image_inputs``: the ids' embeddings with each ``image_token_id`` position taking the next
   image token (``embeds``); attention stays causal;
3. ``model(ids, cache, embeds=...)``: the text network on those embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from . import llama
from .base import lm_head
from .mistral3 import merged_embeddings
from .towers.idefics3 import Connector, Idefics3VisionTransformer, VisionArgs
from .towers.siglip import SiglipVisionModel


@dataclasses.dataclass
class ModelArgs(llama.ModelArgs):
    vision_config: dict[str, Any] | None = None
    image_token_id: int = 128257
    scale_factor: int = 2
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        self.sliding_window = None  # a llama text model
        if not isinstance(self.vision_config, dict):
            raise ConfigError(
                f"config.json: a '{self.model_type}' checkpoint needs a 'vision_config' object"
            )
        self.vision = VisionArgs.from_dict(self.vision_config)
        side = self.vision.patches_per_side
        if self.scale_factor < 1 or side % self.scale_factor:
            raise ConfigError(
                f"config.json: scale_factor must divide the tower's {side} patches per side, "
                f"found {self.scale_factor!r}"
            )


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_model = Idefics3VisionTransformer(args.vision)
        self.connector = Connector(args.vision.hidden_size, args.hidden_size, args.scale_factor)

    def __call__(
        self, inputs: mx.array, cache: Any = None, *, embeds: mx.array | None = None
    ) -> mx.array:
        h = self.model(inputs, cache, embeds=embeds)
        return lm_head(h, self.head)  # (B, L, V)

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """``convert -q`` quantizes the language model; the tower and connector stay float."""
        return not path.startswith(("vision_model.", "connector."))

    def encode_images(self, pixel_values: mx.array, grid_thw: Any = None) -> mx.array:
        """(frames, C, M, M) -> (frames, image_seq_len, hidden); ``grid_thw`` (each image's
        frames and tiles) is the processor's, for the text only."""
        vision = self.args.vision
        if pixel_values.ndim != 4 or pixel_values.shape[1] != vision.num_channels:
            raise ValueError(
                f"pixel_values: expected shape (frames, {vision.num_channels}, M, M), "
                f"found {tuple(pixel_values.shape)}"
            )
        dtype = self.connector.modality_projection.proj.weight.dtype
        return self.connector(self.vision_model(pixel_values.astype(dtype)))

    def image_inputs(self, ids: list[int], features: mx.array) -> dict[str, mx.array]:
        """``embeds`` (1, L, hidden) for a prompt's ``ids`` whose image tokens take
        ``features`` (frames, T, hidden) in order."""
        return {"embeds": merged_embeddings(self, ids, features, self.args.image_token_id)}

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: llama.ModelArgs) -> dict[str, mx.array]:
        assert isinstance(args, ModelArgs)  # this family's (typed as the base's)
        tower: dict[str, mx.array] = {}
        rest: dict[str, mx.array] = {}
        for key, value in weights.items():
            for old, new in _RENAMES:
                if key.startswith(old):
                    key = new + key[len(old) :]
                    break
            (tower if key.startswith("vision_model.") else rest)[key] = value
        text = llama.Model.sanitize(rest, args)
        # SigLIP's sanitize: the patch convolution's PyTorch layout as MLX's (vision_model.*).
        return {**text, **SiglipVisionModel.sanitize(tower, args.vision)}


# transformers' (and the Hub's) names -> ours: model.text_model.* is the language model.
_RENAMES = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)
