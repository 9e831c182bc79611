"""Building blocks shared by the model families.

A model's whole contract is::

    model(inputs: (B, L) int array, cache: list[Cache] | None) -> logits (B, L, V)
    model.make_cache(max_kv_size=None, kv_bits=None) -> list[Cache]
    Model.sanitize(weights) -> weights           # checkpoint fix-ups, HF names kept
    model.layers                                 # the transformer blocks, in order
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from ..cache import Cache, KVCache, Mask, QuantizedKVCache, RotatingKVCache
from ..config import require


@dataclasses.dataclass
class BaseArgs:
    """Model hyperparameters; ``from_dict`` keeps only the declared fields."""

    @classmethod
    def required(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "BaseArgs":
        require(config, cls.required())
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


def make_layer_caches(n_layers: int, *, max_kv_size: int | None = None, kv_bits: int | None = None,
                      kv_group_size: int = 64, sliding_window: int | None = None) -> list[Cache]:
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
        return [RotatingKVCache(max_kv_size, keep=4) for _ in range(n_layers)]
    if kv_bits is not None:
        return [QuantizedKVCache(kv_group_size, kv_bits) for _ in range(n_layers)]
    return [KVCache() for _ in range(n_layers)]


def causal_mask(n_queries: int, offset: int = 0, window: int | None = None) -> Mask:
    """Mask for ``n_queries`` new tokens after ``offset`` cached ones, no cache object."""
    if n_queries == 1:
        return None
    if window is None:
        return "causal"
    q = mx.arange(offset, offset + n_queries)[:, None]
    k = mx.arange(offset + n_queries)[None]
    return (k <= q) & (q - k < window)


def attention(q: mx.array, k: Any, v: Any, *, scale: float, mask: Mask, cache: Cache | None) -> mx.array:
    """Scaled dot-product attention over (B, n_heads, L, head_dim) queries.

    Plain keys/values go to ``mx.fast.scaled_dot_product_attention`` (fused
    flash-style kernels on Metal); a quantized cache hands back packed triples
    that are multiplied without dequantizing them.
    """
    if cache is not None and cache.quantized:
        return _quantized_attention(q, k, v, scale=scale, mask=mask,
                                    group_size=cache.group_size, bits=cache.bits)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _quantized_attention(q, k, v, *, scale, mask, group_size, bits) -> mx.array:
    B, n_q, L, D = q.shape
    n_kv, T = k[0].shape[1], k[0].shape[2]
    reps = n_q // n_kv
    q = (q * scale).reshape(B, n_kv, reps, L, D)  # (B, n_kv, reps, L, D): query groups share a kv head
    k = [a[:, :, None] for a in k]
    v = [a[:, :, None] for a in v]
    scores = mx.quantized_matmul(q, *k, transpose=True, group_size=group_size, bits=bits)
    if isinstance(mask, str):
        qi = mx.arange(T - L, T)[:, None]
        mask = mx.arange(T)[None] <= qi
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(probs, *v, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, n_q, L, -1)
