"""Building blocks shared by the model families.

A model's whole contract is::

    model(inputs: (B, L) int array, cache: list[LayerCache] | None) -> logits (B, L, V)
    model.make_cache(max_kv_size=None, kv_bits=None) -> list[LayerCache]
    Model.sanitize(weights) -> weights           # checkpoint fix-ups, HF names kept
    model.layers                                 # the transformer blocks, in order
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import Cache, KVCache, LayerCache, Mask, StateCache
from ..cache.quantized import QuantizedKVCache
from ..cache.rotating import RotatingKVCache
from ..errors import ConfigError
from .config import normalize_rope, require
from .layers import masks

Args = TypeVar("Args", bound="BaseArgs")
C = TypeVar("C")


@dataclasses.dataclass
class BaseArgs:
    """Model hyperparameters; ``from_dict`` keeps only the declared fields."""

    @classmethod
    def required(cls) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]

    @classmethod
    def from_dict(cls: type[Args], config: dict[str, Any]) -> Args:
        require(config, cls.required())
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


def make_layer_caches(
    n_layers: int,
    *,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    sliding_window: int | None = None,
) -> list[LayerCache]:
    """The standard per-layer caches for a decoder, as chosen by the user's flags.

    A model with sliding-window attention always gets rotating caches of its
    window; ``max_kv_size`` bounds the others, keeping 4 leading "sink" tokens
    (attention mass collects on the first tokens, so dropping them hurts most).
    """
    if sliding_window is not None:
        if kv_bits is not None:
            raise ValueError("--kv-bits is not supported with sliding-window attention")
        return [RotatingKVCache(sliding_window) for _ in range(n_layers)]
    if max_kv_size is not None:
        if kv_bits is not None:
            raise ValueError("--kv-bits and --max-kv-size cannot be combined")
        return [RotatingKVCache.bounded(max_kv_size) for _ in range(n_layers)]
    if kv_bits is not None:
        return [QuantizedKVCache(kv_group_size, kv_bits) for _ in range(n_layers)]
    return [KVCache() for _ in range(n_layers)]


def make_hybrid_caches(
    is_recurrent: list[bool],
    state_arrays: int,
    *,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> list[LayerCache]:
    """Caches for a hybrid decoder: a ``StateCache`` of ``state_arrays`` arrays for each
    recurrent layer, the attention layers' caches as the user's flags choose."""
    kv = iter(
        make_layer_caches(
            is_recurrent.count(False),
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )
    )
    return [StateCache(state_arrays) if r else next(kv) for r in is_recurrent]


def causal_mask(n_queries: int, offset: int = 0, window: int | None = None) -> Mask:
    """Mask for ``n_queries`` new tokens after ``offset`` cached ones, no cache object."""
    if n_queries == 1:
        return None
    return "causal" if window is None else masks.windowed(n_queries, offset, window)


def lm_head(h: mx.array, head: nn.Module) -> mx.array:
    """Logits from the last hidden states through ``head``: the token embedding (tied) or a Linear."""
    if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)):
        return head.as_linear(h)
    return head(h)


class CausalLM(nn.Module):
    """The shell every decoder family shares: ``Inner`` (embedding → blocks → final norm) plus a
    head tied to the embedding or a separate ``lm_head``.

    A family sets ``Inner`` and overrides ``make_cache`` or ``sanitize`` where it differs. The
    attribute names follow the checkpoints' weight names: ``model.embed_tokens`` and
    ``model.layers`` by default, ``transformer.wte`` and ``transformer.h`` for GPT-2, say.
    """

    Inner: type[nn.Module]
    inner_name, embed_name, layers_name = "model", "embed_tokens", "layers"
    # Positions come only from ``cache.offset`` (RoPE, or a table or bias built from it with
    # ``positions``), so a batch may give one per row (a (B,) array). A family that needs one
    # int offset says False.
    positions_from_offset = True

    def __init__(self, args):
        super().__init__()
        self.args = args
        setattr(self, self.inner_name, self.Inner(args))
        if not self.tied:
            hidden = self.embedding.weight.shape[-1]
            self.lm_head = nn.Linear(hidden, args.vocab_size, bias=False)

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding."""
        return self.args.tie_word_embeddings

    @property
    def embedding(self) -> nn.Module:
        return self[self.inner_name][self.embed_name]

    def __call__(self, inputs: mx.array, cache: list[LayerCache] | None = None) -> mx.array:
        h = self[self.inner_name](inputs, cache)
        return lm_head(h, self.head)  # (B, L, V)

    @property
    def head(self) -> nn.Module:
        """The LM head: the token embedding when tied, else ``lm_head``."""
        return self.embedding if self.tied else self.lm_head

    def head_logits(self, h: mx.array) -> mx.array:
        """The LM head over final-norm states ``h`` (B, L, H): logits (B, L, V)."""
        return lm_head(h, self.head)

    def trunk(self, inputs: mx.array, cache: list[LayerCache] | None = None):
        """(states (B, L, H) after the final norm, logits (B, L, V)): what an MTP head reads.
        Meant for a family whose ``__call__`` is this class's (``layers/mtp.new_head_block``
        checks before a trained head is attached); families with heads override it."""
        h = self[self.inner_name](inputs, cache)
        return h, self.head_logits(h)

    @property
    def mtp_heads(self) -> list:
        """The MTP heads attached to this model (``layers/mtp.attach_head``: a head trained by
        ``mlxinfer train-mtp``); none unless one was. Families that ship heads override it."""
        return list(self.__dict__.get("attached_mtp_heads", ()))

    @property
    def layers(self) -> list[nn.Module]:
        return self[self.inner_name][self.layers_name]

    def make_cache(
        self, *, max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64
    ) -> list[LayerCache]:
        return make_layer_caches(
            len(self.layers),
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            sliding_window=getattr(self.args, "sliding_window", None),
        )

    @staticmethod
    def sanitize(weights: dict[str, mx.array], args) -> dict[str, mx.array]:
        # Precomputed RoPE tables are buffers, not weights; a tied head is the embedding.
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        # Saved from transformers' base model (AutoModel: Qwen3-Embedding): no "model." prefix.
        if "embed_tokens.weight" in weights and not any(k.startswith("model.") for k in weights):
            weights = {f"model.{k}": v for k, v in weights.items()}
        if args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights


# Per-layer attention kinds, as transformers 5 writes them in config.json's ``layer_types``.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def check_layer_types(
    layer_types: list[str], n_layers: int, source: str = "config.json"
) -> list[str]:
    if len(layer_types) != n_layers or not set(layer_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ConfigError(
            f"{source}: 'layer_types' must list {n_layers} entries of '{FULL_ATTENTION}' or "
            f"'{SLIDING_ATTENTION}', found {layer_types!r}"
        )
    return list(layer_types)


def make_typed_caches(
    layer_types: list[str],
    sliding_window: int | None,
    *,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> list[LayerCache]:
    """Caches for a decoder whose layers mix sliding-window and full attention.

    Sliding layers always get a rotating cache of their window (float: it is
    small); full layers get what the user's flags choose (see make_layer_caches).
    """
    n_full = sum(t != SLIDING_ATTENTION or sliding_window is None for t in layer_types)
    full = iter(
        make_layer_caches(
            n_full, max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size
        )
    )
    return [
        RotatingKVCache(sliding_window)
        if t == SLIDING_ATTENTION and sliding_window is not None
        else next(full)
        for t in layer_types
    ]


def layer_type_rope(
    config_by_kind: dict[str, Any] | None,
    kind: str,
    default: tuple[float, dict[str, Any] | None],
) -> tuple[float, dict[str, Any] | None]:
    """(base, rope_scaling) for the layers of one attention ``kind``: transformers 5's per-kind
    ``rope_parameters`` (config.py keeps them as ``rope_parameters_by_layer_type``) where the
    config has them, else ``default`` (the family's reading of an older config)."""
    by_kind = config_by_kind or {}
    if kind not in by_kind:
        return default
    params = {"rope_theta": default[0], **by_kind[kind]}
    params = normalize_rope(
        {"rope_parameters": params}, source=f"config.json rope_parameters.{kind}"
    )
    return params["rope_theta"], params["rope_scaling"]


def per_layer(cache: list[C] | None, n_layers: int) -> list[C] | list[None]:
    """``cache``, or a None for each of ``n_layers`` layers (a forward without a cache)."""
    if cache is not None:
        return cache
    return [None] * n_layers


def positions(offset: int | mx.array, n: int) -> mx.array:
    """Positions of ``n`` new tokens after ``offset`` cached ones: (n,) for one int offset,
    (B, n) for a batch's (B,) offsets (each row at its own position)."""
    if isinstance(offset, int):
        return mx.arange(offset, offset + n)
    return offset[:, None] + mx.arange(n)[None]


def typed_masks(
    layer_types: list[str], cache: list[Cache] | None, n_queries: int, sliding_window: int | None
) -> dict[str, Mask]:
    """One mask per attention kind, from the first layer of that kind (its cache knows the positions)."""
    masks: dict[str, Mask] = {}
    for i, kind in enumerate(layer_types):
        if kind in masks:
            continue
        if cache is None:
            window = sliding_window if kind == SLIDING_ATTENTION else None
            masks[kind] = causal_mask(n_queries, window=window)
        else:
            masks[kind] = cache[i].make_mask(n_queries)
    return masks


def scaled_embedding(h: mx.array, scale: float) -> mx.array:
    """Multiply embeddings by ``scale`` rounded to their dtype first, as transformers does
    (Gemma's sqrt(3072) = 55.43 becomes 55.5 in bfloat16)."""
    return h * mx.array(scale, dtype=h.dtype)


def alibi_slopes(n_heads: int) -> mx.array:
    """ALiBi's per-head slopes: a geometric series 2^(-8/n), interleaved for non-powers of two."""
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-(8.0 / closest) * i) for i in range(1, closest + 1)]
    if closest != n_heads:
        extra = [2 ** (-(8.0 / (2 * closest)) * i) for i in range(1, 2 * closest + 1, 2)]
        slopes += extra[: n_heads - closest]
    return mx.array(slopes, dtype=mx.float32)


# A multimodal checkpoint's weight names, as the Hub (and transformers' save_pretrained) lays
# them out, mapped to the language model's own; the vision side is left out.
_LANGUAGE_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),  # Idefics3 / SmolVLM
)
_VISION_PREFIXES: tuple[str, ...]
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
_VISION_PREFIXES += ("model.multi_modal_projector.", "model.visual.", "visual.")


def language_model_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The language model's weights of a multimodal checkpoint, under its own names."""
    out = {}
    for key, value in weights.items():
        if key.startswith(_VISION_PREFIXES):
            continue
        for old, new in _LANGUAGE_PREFIXES:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    return out


def embedding_rows(model) -> int | None:
    """How many token ids ``model`` can be fed (its embedding's rows; None for a model without
    the ``embedding`` of models.base.CausalLM and without ``args.vocab_size``)."""
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        return int(embedding.weight.shape[0])
    return getattr(getattr(model, "args", None), "vocab_size", None)
