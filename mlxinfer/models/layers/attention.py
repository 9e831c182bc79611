"""Attention as every family runs it: one ``attend`` step that backends may replace.

Every attention module derives from :class:`Attention` and computes the
attention proper through ``self.attend(q, k, v, ...)``: on Metal (and any
other GPU backend) that is ``mx.fast.scaled_dot_product_attention``, a fused
flash-style kernel. A backend that needs other kernels swaps in a subclass that
overrides ``attend``, once, at load (``mlxinfer/backends/cpu``); the modules
here never ask which backend runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, cast

import mlx.core as mx
import mlx.nn as nn

from ...cache.kv import Cache, Mask, Pages, QuantizedCache
from . import masks


def with_sinks(scores: mx.array, sinks: mx.array | None) -> mx.array:
    """Scores (B, n_kv, reps, L, T) with each query head's sink logit as one more column
    (gpt-oss): it takes a share of the softmax and, having no value, is dropped after it."""
    if sinks is None:
        return scores
    B, n_kv, reps, L, _ = scores.shape
    column = sinks.astype(scores.dtype).reshape(1, n_kv, reps, 1, 1)
    return mx.concatenate([scores, mx.broadcast_to(column, (B, n_kv, reps, L, 1))], axis=-1)


def quantized_attention(
    q: mx.array,
    k: Sequence[mx.array],
    v: Sequence[mx.array],
    *,
    scale: float,
    mask: Mask,
    group_size: int,
    bits: int,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention over a quantized cache's packed (weights, scales, biases) keys and values,
    multiplied without dequantizing them. (B, n_heads, L, D) queries; ``sinks`` (n_heads,)."""
    B, n_q, L, D = q.shape
    n_kv = k[0].shape[1]
    reps = n_q // n_kv
    q = (q * scale).reshape(B, n_kv, reps, L, D)  # (B, n_kv, reps, L, D): groups share a kv head
    k_packed, k_scales, k_biases = (a[:, :, None] for a in k)
    v_packed, v_scales, v_biases = (a[:, :, None] for a in v)
    scores = masks.apply(
        mx.quantized_matmul(
            q, k_packed, k_scales, k_biases, transpose=True, group_size=group_size, bits=bits
        ),
        masks.for_groups(mask),
    )
    probs = mx.softmax(with_sinks(scores, sinks), axis=-1, precise=True)
    if sinks is not None:
        probs = probs[..., :-1]
    out = mx.quantized_matmul(
        probs, v_packed, v_scales, v_biases, transpose=False, group_size=group_size, bits=bits
    )
    return out.reshape(B, n_q, L, -1)


def softcap_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Mask, softcap: float
) -> mx.array:
    """Attention whose logits are squashed to (-softcap, softcap) by ``softcap * tanh(s / softcap)``.

    The fused kernel cannot cap logits, so this one spells attention out:
    (B, n_heads, L, D) queries over (B, n_kv_heads, T, D) keys, query groups
    sharing a kv head without copying it.
    """
    B, n_q, L, D = q.shape
    n_kv = k.shape[1]
    reps = n_q // n_kv
    q = (q * scale).reshape(B, n_kv, reps, L, D)  # (B, n_kv, reps, L, D)
    scores = q @ k[:, :, None].swapaxes(-1, -2)  # (B, n_kv, reps, L, T)
    scores = masks.apply(mx.tanh(scores / softcap) * softcap, masks.for_groups(mask))
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ v[:, :, None]).reshape(B, n_q, L, -1)  # (B, n_heads, L, Dv)


def paged_attention(
    q: mx.array,
    pages: Pages,
    *,
    scale: float,
    exp: Callable[[mx.array], mx.array] = mx.exp,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of (B, n_heads, 1, D) decode queries over a paged cache's blocks where they
    lie: ``mx.gather_mm`` multiplies each row's query heads with each of its blocks' (block_size,
    D) key matrices, the softmax spans all of a row's blocks, and a second ``gather_mm`` takes
    the values the same way. No per-step copy of the keys (docs/batching.md). ``sinks``
    (n_heads,): a logit per head that joins the softmax's sum with no value (gpt-oss). A
    quantized pool's blocks are multiplied packed (``mx.gather_qmm``), as a quantized cache's
    keys are (:func:`quantized_attention`)."""
    B, n_q, L, D = q.shape
    quantized = pages.bits is not None
    first = pages.keys[0] if quantized else pages.keys
    n_blocks, n_kv, block, _ = first.shape

    def flat(side: Any) -> Any:  # (n_blocks · n_kv, block, width) each
        if quantized:
            return [a.reshape(n_blocks * n_kv, block, -1) for a in side]
        return side.reshape(n_blocks * n_kv, block, -1)

    def product(x: mx.array, side: Any, lhs: mx.array, transpose: bool) -> mx.array:
        if quantized:
            packed, scales, biases = side
            return mx.gather_qmm(
                x,
                packed,
                scales,
                biases,
                lhs_indices=lhs,
                rhs_indices=pages.blocks,
                transpose=transpose,
                group_size=pages.group_size,
                bits=pages.bits,
            )
        return mx.gather_mm(x, side.swapaxes(-1, -2) if transpose else side, lhs, pages.blocks)

    keys, values = flat(pages.keys), flat(pages.values)
    q = (q * scale).reshape(B * n_kv, (n_q // n_kv) * L, D)
    scores = product(q, keys, pages.queries, True)  # (B, n_kv, n, reps, block)
    scores = mx.where(pages.visible, scores.astype(mx.float32), -mx.inf)
    top = scores.max(axis=(2, 4), keepdims=True)  # (B, n_kv, 1, reps, 1)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, n_kv, 1, -1, 1)
        top = mx.maximum(top, sink)
    e = exp(scores - top)
    total = e.sum(axis=(2, 4), keepdims=True)[:, :, 0]  # (B, n_kv, reps, 1)
    if sinks is not None:
        total = total + exp(sink - top)[:, :, 0]
    n = pages.blocks.shape[-1]
    dtype = values[1].dtype if quantized else values.dtype  # a quantized pool's: its scales'
    e = e.astype(dtype).reshape(B * n_kv * n, n_q // n_kv, block)
    out = product(e, values, pages.order, False).sum(axis=2)  # (B, n_kv, reps, Dv)
    return (out / total).astype(dtype).reshape(B, n_q, L, -1)


class Attention(nn.Module):
    """Base of every attention module: the projections are the family's, ``attend`` is shared."""

    exp = staticmethod(mx.exp)  # the exponential of paged attention's softmax (a backend's own)

    def attend(
        self,
        q: mx.array,
        k: Any,
        v: Any,
        *,
        scale: float,
        mask: Mask,
        cache: Cache | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Scaled dot-product attention of (B, n_heads, L, D) queries over the keys and values
        (B, n_kv_heads, T, D), or a quantized cache's packed triples, or a paged cache's blocks
        where it offers them for this ``mask``. -> (B, n_heads, L, Dv). ``sinks`` (n_heads,):
        a learned logit per head that joins each softmax without a value (gpt-oss)."""
        pages = getattr(cache, "pages", None)
        pages = pages(mask) if pages is not None else None
        if pages is not None:
            return self.attend_pages(q, pages, scale=scale, sinks=sinks)
        return self.attend_keys(q, k, v, scale=scale, mask=mask, cache=cache, sinks=sinks)

    def attend_pages(
        self, q: mx.array, pages: Pages, *, scale: float, sinks: mx.array | None = None
    ) -> mx.array:
        """:meth:`attend` over a paged cache's blocks where they lie (decode)."""
        return paged_attention(q, pages, scale=scale, exp=self.exp, sinks=sinks)

    def attend_keys(
        self,
        q: mx.array,
        k: Any,
        v: Any,
        *,
        scale: float,
        mask: Mask,
        cache: Cache | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """:meth:`attend` over keys and values as arrays (or quantized triples)."""
        if cache is not None and cache.quantized:
            quantized = cast(QuantizedCache, cache)  # it says so: it has group_size and bits
            return quantized_attention(
                q,
                k,
                v,
                scale=scale,
                mask=mask,
                group_size=quantized.group_size,
                bits=quantized.bits,
                sinks=sinks,
            )
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


class RopeAttention(Attention):
    """Grouped-query attention with RoPE under HF's names (``q_proj k_proj v_proj o_proj``).

    The options cover the Llama-like families: biases on q/k/v and on o
    (Qwen2 has the first only), one fused ``qkv_proj`` (Phi-3), a per-head norm
    on queries and keys before RoPE (``q_norm``/``k_norm``: Qwen3, Gemma 3), and
    tanh soft-capping of the logits (Gemma 2), a learned sink logit per head
    (``sinks``: gpt-oss), and an output gate (``output_gate``: Qwen3-Next, whose
    ``q_proj`` gives each head's queries and then its gate, the output multiplied by
    ``sigmoid(gate)`` before ``o_proj``). ``rope`` is built by the family, so layers may
    differ in it (Gemma 3's local and global bases).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rope: nn.Module,
        scale: float | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        fused_qkv: bool = False,
        qk_norm: Callable[[int], nn.Module] | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        output_gate: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.output_gate = output_gate
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.fused_qkv = fused_qkv
        if fused_qkv:  # rows: [q heads | k heads | v heads]
            self.qkv_proj = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=qkv_bias)
        else:
            q_width = n_heads * head_dim * (2 if output_gate else 1)
            self.q_proj = nn.Linear(dim, q_width, bias=qkv_bias)
            self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
            self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=o_bias)
        self.has_qk_norm = qk_norm is not None
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(head_dim), qk_norm(head_dim)
        self.rope = rope
        if sinks:
            self.sinks = mx.zeros((n_heads,))

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as the projections give them: (B, L, heads * head_dim) each."""
        if self.fused_qkv:
            q_end = self.n_heads * self.head_dim
            q, k, v = mx.split(
                self.qkv_proj(x), [q_end, q_end + self.n_kv_heads * self.head_dim], -1
            )
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rotate(self, q: mx.array, k: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """RoPE on (B, heads, L, head_dim) queries and keys after ``offset`` cached tokens (an
        int, or a batch's (B,) offsets); a family whose queries depend on their position in
        another way too overrides it (Ministral 3)."""
        return self.rope(q, offset=offset), self.rope(k, offset=offset)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, positions: Any = None
    ) -> mx.array:
        """``positions``: the new tokens' positions in the family's own form, handed to its
        :meth:`rotate` instead of the cache's offset (Qwen-VL's multimodal RoPE)."""
        B, L, _ = x.shape
        q, k, v = self.project(x)
        gate = None
        if self.output_gate:  # per head: [queries | gate], (B, L, n, 2 * head_dim)
            q, gate = mx.split(q.reshape(B, L, self.n_heads, 2 * self.head_dim), 2, axis=-1)
            gate = gate.reshape(B, L, -1)
        # (B, L, n * head_dim) -> (B, L, n, head_dim); norms act per head, then -> (B, n, L, head_dim)
        q = q.reshape(B, L, self.n_heads, self.head_dim)
        k = k.reshape(B, L, self.n_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if positions is None:
            positions = cache.offset if cache is not None else 0
        q, k = self.rotate(q, k, positions)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.softcap is not None:
            out = softcap_attention(q, k, v, scale=self.scale, mask=mask, softcap=self.softcap)
        else:
            sinks = self["sinks"] if "sinks" in self else None
            out = self.attend(q, k, v, scale=self.scale, mask=mask, cache=cache, sinks=sinks)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # out was (B, n_heads, L, hd)
        if gate is not None:
            out = out * mx.sigmoid(gate)
        return self.o_proj(out)
