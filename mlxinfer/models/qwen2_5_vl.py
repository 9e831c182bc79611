"""Qwen2.5-VL: the qwen2 network with multimodal RoPE, and the Qwen ViT with window attention.

A ``Qwen2_5_VLForConditionalGeneration`` checkpoint (``model_type: qwen2_5_vl`` with a
``vision_config``); config.py lifts its ``text_config`` to the top, keeps the keys below beside
it and moves ``mrope_section`` out of ``rope_parameters``. The language model is qwen2's block
(q/k/v biases, SwiGLU) whose RoPE takes three positions per token (layers/mrope.py). With
images, as transformers' ``Qwen2_5_VLModel.forward`` does:

1. ``encode_images(patches, grid_thw)``: the tower (towers/qwen_vit.py) -> one token per
   merged block, image after image;
2. ``image_inputs(ids, features)``: the ids' embeddings with each ``image_token_id`` position
   replaced by the next image token (``embeds`` (1, L, hidden)) and every token's (t, h, w)
   positions (``positions`` (1, L, 3): ``get_rope_index``);
3. ``model(ids, cache, embeds=..., positions=...)``: the text network on them, in chunks of
   any size (each chunk with its own slice of ``positions``).

The request's position state is ``delta`` (max position + 1 - prompt length): stored with its
cache (``cache[0].mrope_delta``) by the forward that was given positions, read by every
forward without them (decoding: position = offset + delta). Never on a module: one model
serves many requests. Text alone (no positions, delta 0) is plain RoPE, as qwen2 runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.kv import Cache, LayerCache
from ..errors import ConfigError
from . import qwen2
from .base import CausalLM, lm_head, per_layer, typed_masks
from .layers import RopeAttention
from .layers.mrope import frequency_axes, image_positions, rotate, rotation_table
from .towers.qwen_vit import VisionArgs, VisionModel


@dataclasses.dataclass
class ModelArgs(qwen2.ModelArgs):
    vision_config: dict[str, Any] | None = None
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.qwen3_text = self.model_type == "qwen3_vl"
        self.qk_norm = self.qwen3_text
        # Qwen2.5-VL: biases on q, k and v (none on o), as qwen2; Qwen3-VL follows attention_bias.
        self.qkv_bias = self.attention_bias or not self.qwen3_text
        self.o_bias = self.attention_bias and self.qwen3_text
        if not self.qwen3_text:
            self.head_dim = self.hidden_size // self.num_attention_heads  # no head_dim key
        if not isinstance(self.vision_config, dict):
            raise ConfigError(
                f"config.json: a '{self.model_type}' checkpoint needs a 'vision_config' object"
            )
        if self.rope_scaling is not None:
            raise ConfigError(
                f"config.json: {self.model_type}'s multimodal RoPE takes no rope_scaling, found "
                f"type '{self.rope_scaling.get('rope_type')}'"
            )
        self.vision = VisionArgs.from_dict(self.vision_config)
        if self.mrope_section is None:  # transformers' defaults
            self.mrope_section = [24, 20, 20] if self.qwen3_text else [16, 24, 24]
        self.frequency_axes = frequency_axes(
            self.mrope_section, self.head_dim // 2, interleaved=self.mrope_interleaved
        )


class MRopeAttention(RopeAttention):
    """qwen2/qwen3 attention whose ``rotate`` takes the forward's positions: an offset (int or
    (B,) array: plain RoPE, every token's three positions equal) or (cos, sin) tables."""

    def rotate(self, q: mx.array, k: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        if isinstance(offset, tuple):
            cos, sin = offset
            return rotate(q, cos, sin), rotate(k, cos, sin)
        return self.rope(q, offset=offset), self.rope(k, offset=offset)


class Block(qwen2.TransformerBlock):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__(args, layer_idx)
        attention = self.self_attn
        attention.__class__ = MRopeAttention  # same fields and parameters; rotate differs

    def __call__(self, x: mx.array, mask, cache: Cache | None, positions: Any = None) -> mx.array:
        # positions passed positionally: a backend's attention forwards them so (backends/cpu)
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


def request_delta(cache: list[Cache] | None) -> int | mx.array:
    """The request's ``delta`` as its cache holds it (0 for text alone)."""
    if not cache:
        return 0
    return getattr(cache[0], "mrope_delta", 0)


class TextModel(qwen2.Qwen2Model):
    """Embedding (or ``embeds``) -> blocks with multimodal RoPE -> norm; ``deepstack`` (n, B,
    L, hidden): added to the outputs of the first n blocks (Qwen3-VL)."""

    Block = Block

    def __init__(self, args: qwen2.ModelArgs):
        super().__init__(args)
        assert isinstance(args, ModelArgs)  # this family's (typed as the base's)
        exponents = np.arange(0, args.head_dim, 2, dtype=np.float32) / args.head_dim
        self._inv_freq = mx.array(1.0 / args.rope_theta**exponents)  # (head_dim / 2,)
        self._axes = mx.array(args.frequency_axes)

    def rotation(self, positions: mx.array | None, cache: list[Cache] | None, L: int) -> Any:
        """What each block's attention rotates by: with ``positions`` (B, L, 3), their (cos,
        sin) tables, and the request's delta recorded with its cache; without, the cache's
        offset + the recorded delta (plain RoPE)."""
        offset = cache[0].offset if cache else 0
        if positions is None:
            return offset + request_delta(cache)
        if cache:
            # (the chunk's last token's largest position + 1) - (its index + 1): after the
            # prompt's last chunk (text: a template's prompt ends in text, as get_rope_index's
            # max + 1 - L), every later token's position - index. Kept with the request's cache.
            last = positions[:, -1].max(axis=-1) + 1 - (offset + L)  # (B,)
            delta = cast(int, last.item()) if last.size == 1 else last  # an int array's item
            cache[0].mrope_delta = delta  # type: ignore[attr-defined]  # the request's own
        return rotation_table(positions, self._inv_freq, self._axes)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Cache] | None = None,
        *,
        embeds: mx.array | None = None,
        positions: mx.array | None = None,
        deepstack: mx.array | None = None,
    ) -> mx.array:
        h = self.embed_tokens(inputs) if embeds is None else embeds  # (B, L, hidden)
        kinds = self.args.layer_types
        assert kinds is not None  # derived by ModelArgs.__post_init__
        L = h.shape[1]
        rotation = self.rotation(positions, cache, L)
        masks = typed_masks(kinds, cache, L, self.args.sliding_window)
        for i, (layer, kind, c) in enumerate(
            zip(self.layers, kinds, per_layer(cache, len(self.layers)))
        ):
            h = layer(h, masks[kind], c, rotation)
            if deepstack is not None and i < deepstack.shape[0]:
                h = h + deepstack[i].astype(h.dtype)
        return self.norm(h)


class QwenImages(CausalLM):
    """What a Qwen-VL model adds to its language model (``visual``, the tower; ``args`` with
    ``vision``, ``image_token_id``): images encoded, merged into the prompt with their (t, h, w)
    positions, the tower float under ``-q``. Shared by Qwen2.5-VL, Qwen3-VL and Qwen3.5."""

    visual: VisionModel

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """``convert -q`` quantizes the language model; the tower stays float (a small share of
        the weights, and the image features are the most sensitive)."""
        return not path.startswith("visual.")

    def encode_images(self, pixel_values: mx.array, grid_thw: Any) -> dict[str, Any]:
        """Flattened patches (sum t*h*w, C*T*P*P) and their images' ``grid_thw`` (N, 3) ->
        ``tokens`` (sum t*h*w / merge**2, hidden), ``deepstack`` (a list of the same shape,
        Qwen3-VL), ``grid_thw`` (as numpy)."""
        grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        vision = self.args.vision
        expected = int(np.prod(grids, axis=-1).sum())
        if pixel_values.ndim != 2 or tuple(pixel_values.shape) != (expected, vision.patch_dim):
            raise ValueError(
                f"pixel_values: expected shape ({expected}, {vision.patch_dim}) for grids "
                f"{grids.tolist()}, found {tuple(pixel_values.shape)}"
            )
        tokens, deepstack = self.visual(pixel_values, grids)
        return {"tokens": tokens, "deepstack": deepstack, "grid_thw": grids}

    def split_image_features(self, features: dict[str, Any], sizes: list[int]) -> list[Any]:
        """``encode_images``' features as one such dict per image (``sizes``: each image's
        tokens, t*h*w / merge**2): its rows of ``tokens`` and of every deepstack level, its
        ``grid_thw`` row. The batching engine's encoder cache keeps each image's alone."""
        grids = np.asarray(features["grid_thw"], dtype=np.int64).reshape(-1, 3)
        if len(grids) != len(sizes) or features["tokens"].shape[0] != sum(sizes):
            raise ValueError(
                f"image features: {features['tokens'].shape[0]} tokens of {len(grids)} image(s) "
                f"for {sizes}"
            )
        ends = np.cumsum(sizes).tolist()
        return [
            {
                "tokens": features["tokens"][end - size : end],
                "deepstack": [d[end - size : end] for d in features["deepstack"]],
                "grid_thw": grids[i : i + 1],
            }
            for i, (size, end) in enumerate(zip(sizes, ends))
        ]

    def join_image_features(self, parts: list[Any]) -> dict[str, Any]:
        """Per-image features (``split_image_features``) as one call's, image after image."""
        levels = len(parts[0]["deepstack"]) if parts else 0
        return {
            "tokens": mx.concatenate([p["tokens"] for p in parts]),
            "deepstack": [
                mx.concatenate([p["deepstack"][k] for p in parts]) for k in range(levels)
            ],
            "grid_thw": np.concatenate([p["grid_thw"] for p in parts]).reshape(-1, 3),
        }

    def image_inputs(self, ids: list[int], features: dict[str, Any]) -> dict[str, mx.array]:
        """``embeds`` (1, L, hidden), ``positions`` (1, L, 3) and, for Qwen3-VL, ``deepstack``
        (n, 1, L, hidden: zero at text positions) for a prompt's ``ids`` whose image tokens take
        ``features`` (``encode_images``) in order."""
        tokens = np.asarray(ids, dtype=np.int64)
        is_image = tokens == self.args.image_token_id
        image_tokens: mx.array = features["tokens"]
        n_feat = image_tokens.shape[0]
        if int(is_image.sum()) != n_feat:
            raise ValueError(
                f"prompt: {int(is_image.sum())} image tokens for {n_feat} image features "
                "(expected the same count)"
            )
        text = self.embedding(mx.array(np.where(is_image, 0, tokens)[None], dtype=mx.int32))
        # Position j of the prompt reads image token (number of image tokens before j).
        order = mx.array(np.clip(np.cumsum(is_image) - 1, 0, max(n_feat - 1, 0)))
        where = mx.array(is_image)[None, :, None]

        def scattered(values: mx.array, rest: mx.array) -> mx.array:
            return mx.where(where, values.astype(text.dtype)[order][None], rest)

        positions, _ = image_positions(
            ids, self.args.image_token_id, features["grid_thw"], self.args.vision.spatial_merge_size
        )
        out = {
            "embeds": scattered(image_tokens, text),
            "positions": mx.array(positions[None], dtype=mx.int32),
        }
        if features["deepstack"]:
            zeros = mx.zeros_like(text)
            out["deepstack"] = mx.stack([scattered(f, zeros) for f in features["deepstack"]])
        return out


class Model(QwenImages, qwen2.Model):
    Inner = TextModel
    Tower: type[VisionModel] = VisionModel

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.visual = self.Tower(args.vision)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[LayerCache] | None = None,
        *,
        embeds: mx.array | None = None,
        positions: mx.array | None = None,
        deepstack: mx.array | None = None,
    ) -> mx.array:
        h = self.model(inputs, cache, embeds=embeds, positions=positions, deepstack=deepstack)
        return lm_head(h, self.head)  # (B, L, V)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: qwen2.ModelArgs) -> dict[str, mx.array]:
        tower, rest = split_tower(weights)
        return {**qwen2.Model.sanitize(rest, args), **tower}


def split_tower(weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(the tower's weights as ``visual.*``, sanitized; the rest with ``model.language_model.*``
    as ``model.*``)."""
    tower: dict[str, mx.array] = {}
    rest: dict[str, mx.array] = {}
    for key, value in weights.items():
        for prefix in _TOWER_PREFIXES:
            if key.startswith(prefix):
                tower[key[len(prefix) :]] = value
                break
        else:
            prefix = "model.language_model."
            rest["model." + key[len(prefix) :] if key.startswith(prefix) else key] = value
    return {"visual." + k: v for k, v in VisionModel.sanitize(tower).items()}, rest


# Where checkpoints keep the tower: transformers 5's save_pretrained (Qwen3-VL) first, then
# the Hub's and transformers 5's Qwen2.5-VL layout (and our own).
_TOWER_PREFIXES = ("model.visual.", "visual.")
