"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention, caching only the latent.

Per token, MLA projects the hidden state down to one latent ``c`` of
``kv_lora_rank`` values (``kv_a_proj_with_mqa``, then ``kv_a_layernorm``) and one
RoPE key ``k_pe`` of ``qk_rope_head_dim`` values shared by all heads. Head h's
key and value are linear in the latent::

    k_h = [W_k[h] c ; k_pe]        W_k[h]: (qk_nope_head_dim, kv_lora_rank)
    v_h =  W_v[h] c                W_v[h]: (v_head_dim, kv_lora_rank)

(``W_k``/``W_v`` are the two halves of HF's ``kv_b_proj``, per head). So the
cache (``LatentKVCache``) holds only ``c`` and ``k_pe``: ``kv_lora_rank +
qk_rope_head_dim`` values per token per layer instead of
``n_heads × (qk_head_dim + v_head_dim)`` — 576 vs 40,960 for DeepSeek-V3
(see :func:`cache_bytes_per_token`).

Two ways to attend over it, equal up to rounding:

- expanded (prefill, L > 1): rebuild every head's keys and values from the
  cached latents and run ordinary attention — compute-bound anyway;
- absorbed (decode, L == 1): fold ``W_k`` into the query and ``W_v`` into the
  output, so attention runs over the latents themselves and per-head keys and
  values are never materialised::

      q_h · k_h(t) = (q_nope_h W_k[h]) · c(t) + q_pe_h · k_pe(t)
      out_h        = W_v[h] (Σ_t p_h(t) c(t))
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...cache.kv import Cache, LatentKVCache, LayerCache, Mask
from ...cache.rotating import RotatingKVCache
from . import masks
from .attention import Attention
from .norms import RMSNorm


class PerHeadLinear(nn.Module):
    """One (out, in) matrix per head, stacked as (n_heads, out, in); no bias.

    ``x @ W[h].T`` for (B, n_heads or 1, L, in) inputs, or with
    ``transpose=False`` ``x @ W[h]`` for (B, n_heads, L, out) inputs.
    """

    def __init__(self, n_heads: int, in_dims: int, out_dims: int):
        super().__init__()
        scale = in_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (n_heads, out_dims, in_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return x @ (self.weight.swapaxes(-1, -2) if transpose else self.weight)

    def to_quantized(
        self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_
    ) -> "QuantizedPerHeadLinear":
        return QuantizedPerHeadLinear.from_per_head_linear(self, group_size, bits, mode)


class QuantizedPerHeadLinear(nn.Module):
    """:class:`PerHeadLinear` with affine-quantized rows (groups along ``in``, as for a Linear)."""

    def __init__(
        self,
        n_heads: int,
        in_dims: int,
        out_dims: int,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight = mx.zeros((n_heads, out_dims, in_dims * bits // 32), mx.uint32)
        self.scales = mx.zeros((n_heads, out_dims, in_dims // group_size))
        self.biases = mx.zeros((n_heads, out_dims, in_dims // group_size))
        self.freeze()

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(
            x,
            self.weight,
            self.scales,
            self.biases,
            transpose=transpose,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    @classmethod
    def from_per_head_linear(
        cls, layer: PerHeadLinear, group_size: int, bits: int, mode: str = "affine"
    ) -> "QuantizedPerHeadLinear":
        n_heads, out_dims, in_dims = layer.weight.shape
        q = cls(n_heads, in_dims, out_dims, group_size, bits, mode)
        q.weight, q.scales, q.biases = mx.quantize(layer.weight, group_size, bits, mode=mode)
        q.freeze()
        return q


class MultiHeadLatentAttention(Attention):
    """MLA under HF's names, except ``kv_b_proj``, split per head into ``k_b_proj`` and
    ``v_b_proj`` (see :func:`split_kv_b_proj`).

    Args:
        rope: the RoPE for the ``qk_rope_head_dim`` part (interleaved pairs in DeepSeek).
        scale: the softmax scale (``qk_head_dim ** -0.5``, times yarn's mscale² when set).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool,
        rope: nn.Module,
        scale: float,
        k_b_transposed: bool = False,
    ):
        super().__init__()
        self.n_heads, self.scale, self.rope = n_heads, scale, rope
        self.nope_dim, self.rope_dim, self.kv_lora_rank = (
            qk_nope_head_dim,
            qk_rope_head_dim,
            kv_lora_rank,
        )
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = nn.Linear(dim, n_heads * qk_head_dim, bias=False)
        else:  # queries through their own low-rank bottleneck (V2, V3; not V2-Lite)
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(
                q_lora_rank, eps=1e-6
            )  # HF's default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=1e-6)
        # ``k_b_transposed``: W_k[h] stored as (kv_lora_rank, qk_nope_head_dim), as llama.cpp's
        # GGUF files hold it (``attn_k_b``, quantized along qk_nope): the products flip.
        self.k_b_t = k_b_transposed
        if k_b_transposed:
            self.k_b_proj = PerHeadLinear(n_heads, qk_nope_head_dim, kv_lora_rank)
        else:
            self.k_b_proj = PerHeadLinear(n_heads, kv_lora_rank, qk_nope_head_dim)
        self.v_b_proj = PerHeadLinear(n_heads, kv_lora_rank, v_head_dim)
        self.o_proj = nn.Linear(n_heads * v_head_dim, dim, bias=bias)

    def __call__(self, x: mx.array, mask: Mask, cache: Cache | None) -> mx.array:
        B, L, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, qk_head_dim)
        q_nope, q_pe = mx.split(q, [self.nope_dim], axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (B, 1, L, kv_lora_rank): one "head" for all
        k_pe = k_pe[:, None]  # (B, 1, L, qk_rope_head_dim)
        offset = cache.offset if cache is not None else 0
        q_pe, k_pe = self.rope(q_pe, offset=offset), self.rope(k_pe, offset=offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)  # (B, 1, T, ·) each
        if L == 1:
            out = self._absorbed(q_nope, q_pe, latent, k_pe, mask)
        else:
            out = self._expanded(q_nope, q_pe, latent, k_pe, mask)
        return self.o_proj(
            out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        )  # out: (B, H, L, v_head_dim)

    def _expanded(self, q_nope, q_pe, latent, k_pe, mask) -> mx.array:
        k_nope = self.k_b_proj(latent, transpose=not self.k_b_t)  # (B, H, T, qk_nope_head_dim)
        v = self.v_b_proj(latent)  # (B, H, T, v_head_dim)
        k = mx.concatenate(
            [k_nope, mx.broadcast_to(k_pe, (*k_nope.shape[:-1], self.rope_dim))], axis=-1
        )
        q = mx.concatenate([q_nope, q_pe], axis=-1)
        return self.attend(q, k, v, scale=self.scale, mask=mask, cache=None)  # keys: qk_head_dim

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask) -> mx.array:
        q_latent = self.k_b_proj(q_nope * self.scale, transpose=self.k_b_t)  # (B, H, L, rank)
        scores = q_latent @ latent.swapaxes(-1, -2) + (q_pe * self.scale) @ k_pe.swapaxes(
            -1, -2
        )  # (B, H, L, T)
        probs = mx.softmax(masks.apply(scores, mask), axis=-1, precise=True)
        return self.v_b_proj(probs @ latent)  # (B, H, L, kv_lora_rank) -> (B, H, L, v_head_dim)


def split_kv_b_proj(
    weights: dict[str, mx.array], n_heads: int, qk_nope_head_dim: int
) -> dict[str, mx.array]:
    """HF's ``kv_b_proj`` (n_heads·(nope + v), kv_lora_rank) -> ``k_b_proj`` (n_heads, nope, rank) and
    ``v_b_proj`` (n_heads, v, rank). Rows are output channels, so packed weights, scales and biases
    of a quantized checkpoint split the same way. Idempotent."""
    out = {}
    for key, value in weights.items():
        head, _, kind = key.rpartition(".")
        if not head.endswith(".kv_b_proj"):
            out[key] = value
            continue
        base = head[: -len("kv_b_proj")]
        per_head = value.reshape(n_heads, -1, value.shape[-1])  # (H, nope + v, ·)
        out[f"{base}k_b_proj.{kind}"] = per_head[:, :qk_nope_head_dim]
        out[f"{base}v_b_proj.{kind}"] = per_head[:, qk_nope_head_dim:]
    return out


def make_latent_caches(
    n_layers: int, *, max_kv_size: int | None = None, kv_bits: int | None = None, **_
) -> list[LayerCache]:
    """One :class:`LatentKVCache` per layer; ``max_kv_size`` bounds it (with 4 sink tokens) instead."""
    if kv_bits is not None:
        raise ValueError(
            "--kv-bits is not supported with multi-head latent attention "
            "(its cache is already the compressed latent)"
        )
    if max_kv_size is not None:
        return [RotatingKVCache.bounded(max_kv_size) for _ in range(n_layers)]
    return [LatentKVCache() for _ in range(n_layers)]


def cache_bytes_per_token(args: Any, itemsize: int = 2) -> dict[str, int]:
    """Cache bytes per token, whole model: MLA's latent cache vs the equivalent multi-head cache.

    ``args`` has ``num_hidden_layers``, ``num_attention_heads``, ``kv_lora_rank``,
    ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``. DeepSeek-V3 in float16:
    {"latent": 70272, "mha": 4997120} — 71× smaller.
    """
    n = args.num_hidden_layers * itemsize
    latent = n * (args.kv_lora_rank + args.qk_rope_head_dim)
    mha = (
        n
        * args.num_attention_heads
        * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    )
    return {"latent": latent, "mha": mha}
