"""Gated DeltaNet: linear attention with a decaying, delta-rule-updated state (Qwen3-Next).

Per value head the layer keeps a (Dk, Dv) state S. Each token, with key k, value v, query q
(k and q L2-normalised, q scaled by Dk^-0.5), decay g <= 0 and learning rate beta in (0, 1):

    S <- exp(g) * S                     # forget
    S <- S + k (beta (v - S^T k))^T     # the delta rule: write only what S does not predict
    o  = S^T q

Decode runs that step (:func:`gated_delta_step`). Prefill runs it chunk by chunk
(:func:`gated_delta_chunked`): within a chunk of C tokens the C sequential updates become a
triangular system (the "UT transform" of the DeltaNet paper), solved here by a product of
log2(C) matrix squarings rather than a triangular solver, so that the whole prefill is
matmuls (Metal has no triangular solve). Both are plain MLX ops; there is no custom kernel.

Before it, the layer's q, k, v run through a depthwise causal convolution of width K whose
last K - 1 inputs are carried from token to token; the layer's ``StateCache`` holds those
inputs and S, a fixed size whatever the context.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ...cache.kv import StateCache
from .norms import RMSNorm

CHUNK = 64


def _l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def gated_delta_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token. q, k (B, H, Dk), v (B, H, Dv), g, beta (B, H), state (B, H, Dk, Dv), float32
    -> (output (B, H, Dv), new state)."""
    state = state * mx.exp(g)[..., None, None]
    predicted = (state * k[..., None]).sum(axis=-2)  # (B, H, Dv): what S already says for k
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(axis=-2), state


def _unit_lower_inverse(strict: mx.array) -> mx.array:
    """(I + N)^-1 for strictly lower triangular (..., C, C) N: N is nilpotent, so the inverse
    is the finite series sum (-N)^i = prod_j (I + (-N)^(2^j)), log2(C) squarings."""
    C = strict.shape[-1]
    power = -strict
    inverse = mx.eye(C, dtype=strict.dtype) + power
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        power = power @ power
        inverse = inverse @ (mx.eye(C, dtype=strict.dtype) + power)
    return inverse


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """L tokens at once, equal to L :func:`gated_delta_step` calls. q, k (B, H, L, Dk), v
    (B, H, L, Dv), g, beta (B, H, L), state (B, H, Dk, Dv), float32 -> ((B, H, L, Dv), state)."""
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    C = min(chunk, L)
    pad = -L % C
    if pad:  # padded tokens: no key, no value, no decay -- they leave S as it is
        q, k, v = (mx.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)]) for a in (q, k, v))
        g, beta = (mx.pad(a, [(0, 0), (0, 0), (0, pad)]) for a in (g, beta))
    n = (L + pad) // C
    q, k, v = (a.reshape(B, H, n, C, -1) for a in (q, k, v))  # (B, H, n, C, D)
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)
    decay = mx.cumsum(g, axis=-1)  # (B, H, n, C): log of the decay from the chunk's start
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    # pair[i, j] = exp(decay_i - decay_j) for j <= i: the decay between tokens j and i
    pair = mx.where(lower, mx.exp(decay[..., :, None] - decay[..., None, :]), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.swapaxes(-1, -2)) * pair  # (B, H, n, C, C)
    inverse = _unit_lower_inverse(mx.where(mx.tril(lower, -1), system, 0.0))
    values = inverse @ v_beta  # (B, H, n, C, Dv): the chunk's corrections, before S is read
    reads = inverse @ (k_beta * mx.exp(decay)[..., None])  # (B, H, n, C, Dk)
    within = (q @ k.swapaxes(-1, -2)) * pair  # (B, H, n, C, C)
    q_decayed = q * mx.exp(decay)[..., None]
    k_decayed = k * mx.exp(decay[..., -1:] - decay)[..., None]  # to the chunk's end
    chunk_decay = mx.exp(decay[..., -1])[..., None, None]  # (B, H, n, 1, 1)
    outs = []
    for i in range(n):
        new = values[:, :, i] - reads[:, :, i] @ state  # (B, H, C, Dv)
        outs.append(q_decayed[:, :, i] @ state + within[:, :, i] @ new)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].swapaxes(-1, -2) @ new
    out = mx.stack(outs, axis=2).reshape(B, H, n * C, Dv)
    return out[:, :, :L], state


class GatedRMSNorm(RMSNorm):
    """``rms_norm(x) * w * silu(z)``: the output norm of a Gated DeltaNet head, gated by z."""

    # ignore: the gate makes it no drop-in RMSNorm (it subclasses for the weight and normalize)
    def __call__(self, x: mx.array, z: mx.array) -> mx.array:  # type: ignore[override]
        return self.normalize(x, self["weight"]) * nn.silu(z.astype(mx.float32)).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention layer under its checkpoint names.

    ``in_proj_qkvz`` gives, per key head, its q and k (Dk each) and the v and z (Dv each) of
    its ``n_v // n_k`` value heads; ``in_proj_ba`` the b (learning rate) and a (decay) of
    each of those value heads. q, k, v run through ``conv1d`` (depthwise, width K) and SiLU;
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the recurrence's output is
    normed per value head, gated by silu(z) and projected by ``out_proj``.

    ``separate`` (Qwen3.5): the same quantities from four projections instead, ``in_proj_qkv``
    (all q heads, then k, then v), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``.
    """

    def __init__(
        self,
        dim: int,
        *,
        n_k: int,
        n_v: int,
        head_k: int,
        head_v: int,
        width: int,
        eps: float,
        separate: bool = False,
    ):
        super().__init__()
        self.separate = separate
        self.n_k, self.n_v, self.head_k, self.head_v, self.width = n_k, n_v, head_k, head_v, width
        self.key_dim, self.value_dim = n_k * head_k, n_v * head_v
        conv_dim = 2 * self.key_dim + self.value_dim
        if separate:
            self.in_proj_qkv = nn.Linear(dim, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(dim, n_v, bias=False)
            self.in_proj_a = nn.Linear(dim, n_v, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(dim, 2 * n_v, bias=False)
        # weight (conv_dim, K, 1): MLX's (out, width, in / groups); see sanitize_conv
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, bias=False)
        self.dt_bias = mx.ones((n_v,))
        self.A_log = mx.zeros((n_v,))
        self.norm = GatedRMSNorm(head_v, eps=eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def _split(self, x: mx.array) -> tuple[mx.array, ...]:
        """x (B, L, dim) -> q, k (B, L, key_dim), v, z (B, L, n_v, head_v), b, a (B, L, n_v)."""
        B, L, _ = x.shape
        if self.separate:
            q, k, v = mx.split(self.in_proj_qkv(x), [self.key_dim, 2 * self.key_dim], axis=-1)
            z = self.in_proj_z(x).reshape(B, L, self.n_v, self.head_v)
            v = v.reshape(B, L, self.n_v, self.head_v)
            return q, k, v, z, self.in_proj_b(x), self.in_proj_a(x)
        per = self.n_v // self.n_k  # value heads per key head
        qkvz = self.in_proj_qkvz(x).reshape(B, L, self.n_k, -1)  # grouped by key head
        sizes = [self.head_k, 2 * self.head_k, 2 * self.head_k + per * self.head_v]
        q, k, v, z = mx.split(qkvz, sizes, axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(B, L, self.n_k, 2 * per), [per], axis=-1)
        q, k = q.reshape(B, L, -1), k.reshape(B, L, -1)
        v, z = v.reshape(B, L, self.n_v, self.head_v), z.reshape(B, L, self.n_v, self.head_v)
        return q, k, v, z, b.reshape(B, L, self.n_v), a.reshape(B, L, self.n_v)

    def __call__(self, x: mx.array, cache: StateCache | None) -> mx.array:
        B, L, _ = x.shape
        q, k, v, z, b, a = self._split(x)
        mixed = mx.concatenate([q, k, v.reshape(B, L, -1)], axis=-1)  # (B, L, conv_dim)
        past, state = (None, None) if cache is None else cache.arrays
        if past is None:  # the start of the sequence: zeros before it, as the conv's padding
            past = mx.zeros((B, self.width - 1, mixed.shape[-1]), mixed.dtype)
        window = mx.concatenate([past, mixed], axis=1)  # (B, K - 1 + L, conv_dim)
        mixed = nn.silu(self.conv1d(window))  # (B, L, conv_dim)
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)

        # (B, L, heads, D) -> (B, n_v, L, D) in float32; each key head serves `per` value heads
        per = self.n_v // self.n_k
        q, k = (
            mx.repeat(a.reshape(B, L, self.n_k, self.head_k), per, axis=2)
            .transpose(0, 2, 1, 3)
            .astype(mx.float32)
            for a in (q, k)
        )
        v = v.reshape(B, L, self.n_v, self.head_v).transpose(0, 2, 1, 3).astype(mx.float32)
        q, k = _l2norm(q) * self.head_k**-0.5, _l2norm(k)
        beta = mx.sigmoid(b.astype(mx.float32)).transpose(0, 2, 1)  # (B, n_v, L)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(
            a.astype(mx.float32) + self.dt_bias.astype(mx.float32)
        )
        g = g.transpose(0, 2, 1)  # (B, n_v, L)
        if state is None:
            state = mx.zeros((B, self.n_v, self.head_k, self.head_v), mx.float32)
        start = state
        if L == 1:
            out, state = gated_delta_step(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], g[..., 0], beta[..., 0], state
            )
            out = out[:, :, None]
        else:
            out, state = gated_delta_chunked(q, k, v, g, beta, state)
        if cache is not None:
            positions = None
            if cache.recording:  # a verification pass: the state after each token, on demand

                def positions(i: int) -> list[mx.array]:
                    # The recurrence over the first i + 1 tokens again (no projections: cheap),
                    # and the conv's last K - 1 inputs there.
                    n = i + 1
                    s = gated_delta_chunked(
                        q[:, :, :n], k[:, :, :n], v[:, :, :n], g[..., :n], beta[..., :n], start
                    )[1]
                    return [window[:, n : n + self.width - 1], s]

            cache.update([window[:, L:], state], L, positions)  # the last K - 1 inputs, and S
        out = out.transpose(0, 2, 1, 3).astype(x.dtype)  # (B, L, n_v, head_v)
        out = self.norm(out, z).reshape(B, L, -1)
        return self.out_proj(out)


def sanitize_conv(key: str, value: mx.array) -> mx.array:
    """A checkpoint's depthwise conv weight (C, 1, K) in MLX's (C, K, 1) layout; ours as is."""
    if key.endswith("conv1d.weight") and value.ndim == 3 and value.shape[1] == 1:
        return value.swapaxes(1, 2)
    return value
