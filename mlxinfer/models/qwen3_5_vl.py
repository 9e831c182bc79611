"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``, ``model_type: qwen3_5`` with a
``vision_config``; ``qwen3_5_moe`` the same over the experts' trunk): Qwen3-VL's tower over
Qwen3.5's hybrid trunk (qwen3_5.py: Gated DeltaNet and gated full-attention layers).

As transformers 5.25's ``Qwen3_5Model``:

- the tower is Qwen3-VL's (towers/qwen_vit.py ``Qwen3VisionModel``: learned position table
  resampled to each grid, LayerNorm/GELU blocks, no windows) without deepstack: its config
  has no ``deepstack_visual_indexes``, and only the final merger runs;
- images flow into the prompt as Qwen2.5-VL's (qwen2_5_vl.QwenImages: ``encode_images``,
  ``image_inputs`` -> ``embeds`` and (t, h, w) ``positions``, ``get_rope_index``'s);
- the full-attention layers rotate by interleaved multimodal RoPE (t, h, w, t, h, w ... over
  the rotated part only: partial RoPE, ``partial_rotary_factor`` of ``head_dim``;
  ``mrope_section`` [11, 11, 10] by default); the Gated DeltaNet layers take no positions;
- the request's ``delta`` lives with its cache (the first full-attention layer's:
  ``mrope_delta``), as Qwen2.5-VL's does: never on a module.

On text alone (no positions, delta 0) every layer runs exactly as qwen3_5.py's. Weights:
``model.language_model.*`` -> ``model.*``, ``model.visual.*`` -> ``visual.*``; the MTP layer
(``mtp.*``) as qwen3_next.py keeps it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.kv import Cache, LayerCache
from ..errors import ConfigError
from . import qwen3_5, qwen3_next
from .base import causal_mask, lm_head, per_layer
from .layers import RopeAttention
from .layers.moe import keep_routers_float
from .layers.mrope import frequency_axes, rotate, rotation_table
from .qwen2_5_vl import QwenImages, split_tower
from .towers.qwen_vit import Qwen3VisionModel, VisionArgs


@dataclasses.dataclass
class ModelArgs(qwen3_5.ModelArgs):
    vision_config: dict[str, Any] | None = None
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = True  # Qwen3.5's RoPE interleaves whatever the config says

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        # Qwen3.5-MoE's text_config names no dense intermediate_size: every block has experts.
        if config.get("num_experts") and "intermediate_size" not in config:
            config = {**config, "intermediate_size": config.get("moe_intermediate_size")}
        return super().from_dict(config)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.vision_config, dict):
            raise ConfigError(
                f"config.json: a '{self.model_type}' checkpoint needs a 'vision_config' object"
            )
        if self.rope_scaling is not None:
            raise ConfigError(
                f"config.json: {self.model_type}'s multimodal RoPE takes no rope_scaling, found "
                f"type '{self.rope_scaling.get('rope_type')}'"
            )
        # Qwen3.5's tower has no deepstack (transformers deletes the setting).
        self.vision = VisionArgs.from_dict({**self.vision_config, "deepstack_visual_indexes": []})
        self.rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if self.mrope_section is None:  # transformers' default
            self.mrope_section = [11, 11, 10]
        self.frequency_axes = frequency_axes(
            self.mrope_section, self.rotary_dim // 2, interleaved=True
        )


class MRopeAttention(RopeAttention):
    """Qwen3.5's gated attention whose ``rotate`` takes the forward's positions: an offset
    (int or (B,) array: plain partial RoPE) or (cos, sin) tables over the rotated part."""

    def rotate(self, q: mx.array, k: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        if not isinstance(offset, tuple):
            return self.rope(q, offset=offset), self.rope(k, offset=offset)
        cos, sin = offset  # (B, 1, L, rotary_dim)
        n = cos.shape[-1]

        def turned(x: mx.array) -> mx.array:  # the first n of head_dim rotate, the rest pass
            return mx.concatenate([rotate(x[..., :n], cos, sin), x[..., n:]], axis=-1)

        return turned(q), turned(k)


class Block(qwen3_next.DecoderLayer):
    """A hybrid block; its full-attention mixer rotates by ``rotation`` when one is given."""

    def __call__(
        self, x: mx.array, mask, cache: LayerCache | None, rotation: Any = None
    ) -> mx.array:
        if rotation is None or self.is_linear:
            return super().__call__(x, mask, cache)
        # positions passed positionally: a backend's attention forwards them so (backends/cpu)
        h = x + self.self_attn(self.input_layernorm(x), mask, cast("Cache | None", cache), rotation)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextModel(qwen3_next.Qwen3NextModel):
    """Embedding (or ``embeds``) -> hybrid blocks, the attention ones with multimodal RoPE
    (``positions`` (B, L, 3)) -> norm."""

    def __init__(self, args: qwen3_next.ModelArgs):
        super().__init__(args)
        assert isinstance(args, ModelArgs)  # this family's (typed as the base's)
        for layer in self.layers:  # same fields and parameters; the forward takes a rotation
            layer.__class__ = Block
            if not layer.is_linear:
                layer.self_attn.__class__ = MRopeAttention
        n = args.rotary_dim
        exponents = np.arange(0, n, 2, dtype=np.float32) / n
        self._inv_freq = mx.array(1.0 / args.rope_theta**exponents)  # (rotary_dim / 2,)
        self._axes = mx.array(args.frequency_axes)

    def rotation(self, positions: mx.array | None, cache: list[LayerCache] | None, L: int) -> Any:
        """What each attention layer rotates by: None (its own RoPE at the cache's offset) for
        text with no delta; the cache's offset + the request's delta after images; with
        ``positions`` (B, L, 3), their (cos, sin) tables, the delta recorded with the cache."""
        first = self.first_attention
        holder = cache[first if first is not None else 0] if cache else None
        offset = holder.offset if holder is not None else 0
        if positions is None:
            delta = getattr(holder, "mrope_delta", 0)
            return None if isinstance(delta, int) and delta == 0 else offset + delta
        if holder is not None:
            # the chunk's last token's largest position + 1 - (its index + 1): after the
            # prompt's last chunk, every later token's position - index (qwen2_5_vl.py).
            last = positions[:, -1].max(axis=-1) + 1 - (offset + L)  # (B,)
            delta = cast(int, last.item()) if last.size == 1 else last  # an int array's item
            holder.mrope_delta = delta  # type: ignore[union-attr]  # the request's own
        return rotation_table(positions, self._inv_freq, self._axes)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[LayerCache] | None = None,
        *,
        embeds: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        h = self.embed_tokens(inputs) if embeds is None else embeds  # (B, L, hidden)
        L = h.shape[1]
        if cache is None:
            mask = causal_mask(L)
        else:
            first = self.first_attention
            # the first attention layer's cache: a KV cache
            mask = cast(Cache, cache[first]).make_mask(L) if first is not None else None
        rotation = self.rotation(positions, cache, L)
        for layer, c in zip(self.layers, per_layer(cache, len(self.layers))):
            h = cast(Block, layer)(h, mask, c, rotation)  # made Blocks in __init__
        return self.norm(h)


class Model(QwenImages, qwen3_5.Model):
    Inner = TextModel

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.visual = Qwen3VisionModel(args.vision)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[LayerCache] | None = None,
        *,
        embeds: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        h = self.model(inputs, cache, embeds=embeds, positions=positions)
        return lm_head(h, self.head)  # (B, L, V)

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """The tower float (QwenImages), the experts' routers float (qwen3_next)."""
        return QwenImages.quant_predicate(self, path, module) and keep_routers_float(path, module)

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args: qwen3_next.ModelArgs) -> dict[str, mx.array]:
        tower, rest = split_tower(weights)
        return {**qwen3_5.Model.sanitize(rest, args), **tower}
